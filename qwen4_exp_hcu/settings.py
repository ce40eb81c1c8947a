"""The plugin's own settings, `--additional-config '{"qwen4_exp_hcu": {...}}'` (what vLLM's `EngramConfig` has no
field for). A leaf module (no torch, no vLLM): the plugin checks the names and types while vLLM builds its
config, long before a model exists, and the model reads the values through the same function."""

SETTINGS_KEY = "qwen4_exp_hcu"
SETTINGS = ("hot_rows_gib", "hot_rows_calibration")
WHERE = f"--additional-config.{SETTINGS_KEY}"


def plugin_settings(additional_config: dict | None) -> tuple[float, str | None]:
    """(`hot_rows_gib`, `hot_rows_calibration`) of the hot-row cache: GiB per rank for all PLE layers, row maps
    included (0 = off), and a safetensors file with a `tokens` stream (None: the cache follows served
    traffic). Unknown names and wrong types are errors naming the setting; what depends on the model or
    platform is checked where the model is built."""
    settings = (additional_config or {}).get(SETTINGS_KEY, {})
    if not isinstance(settings, dict):
        raise ValueError(f"{WHERE}: expected a mapping of {list(SETTINGS)}, got {settings!r}.")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"{WHERE}: unknown setting(s) {unknown}; the settings are {list(SETTINGS)}.")
    gib, calibration = settings.get("hot_rows_gib", 0), settings.get("hot_rows_calibration")
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib < 0:
        raise ValueError(f"{WHERE}.hot_rows_gib must be a number of GiB >= 0, got {gib!r}.")
    if calibration is not None and not isinstance(calibration, str):
        raise ValueError(f"{WHERE}.hot_rows_calibration must be the path of a safetensors file, got {calibration!r}.")
    if calibration is not None and not gib:
        raise ValueError(f"{WHERE}.hot_rows_calibration is set but hot_rows_gib is not: the cache has no size.")
    return gib, calibration
