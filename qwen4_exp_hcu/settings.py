"""The plugin's own settings, `--additional-config '{"qwen4_exp_hcu": {...}}'` (what vLLM's `EngramConfig` has no
field for). A leaf module (no torch, no vLLM): the plugin checks the names and types while vLLM builds its
config, long before a model exists, and the model reads the values through the same function."""

from typing import NamedTuple

SETTINGS_KEY = "qwen4_exp_hcu"
SETTINGS = ("hot_rows_gib", "hot_rows_calibration", "host_table_gib", "host_table_calibration",
            *(ENGRAM := ("cpu_offload", "dp_shared_memory", "use_thp")))  # fmt: skip
WHERE = f"--additional-config.{SETTINGS_KEY}"


class PluginSettings(NamedTuple):
    hot_rows_gib: float  # GPU hot-row cache, GiB per rank over all PLE layers, row maps included (0 = off)
    hot_rows_calibration: str | None  # its calibration tokens (None: it follows served traffic)
    host_table_gib: float  # host bytes per rank for resident PLE rows; the rest stay in the files (0 = off)
    host_table_calibration: str | None  # the resident rows' calibration tokens (None: they follow traffic)
    # `--engram-config`'s storage settings of the same names, on every release (they win where both are set;
    # vLLM before 0.30 parses no `--engram-config`). None: vLLM's value, or its default.
    cpu_offload: bool | None
    dp_shared_memory: bool | None
    use_thp: bool | None


def _gib(settings: dict, name: str) -> float:
    value = settings.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{WHERE}.{name} must be a number of GiB >= 0, got {value!r}.")
    return value


def _calibration(settings: dict, name: str, size: str) -> str | None:
    """A safetensors file with a `tokens` stream, only with its size setting."""
    value = settings.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{WHERE}.{name} must be the path of a safetensors file, got {value!r}.")
    if value is not None and not settings.get(size):
        raise ValueError(f"{WHERE}.{name} is set but {size} is not: there is nothing to calibrate.")
    return value


def _flag(settings: dict, name: str) -> bool | None:
    value = settings.get(name)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{WHERE}.{name} must be true or false, got {value!r}.")
    return value


def plugin_settings(additional_config: dict | None) -> PluginSettings:
    """The settings, checked: unknown names and wrong types are errors naming the setting; what depends on the
    model or platform is checked where the model is built. `host_table_gib` > 0 turns on the file tier
    (`ple.file_rows`): that many GiB of the most-read rows stay in host memory, the others are read from the
    checkpoint's files per lookup; with `hot_rows_gib` too, a GPU hot-row cache sits in front of both."""
    settings = (additional_config or {}).get(SETTINGS_KEY, {})
    if not isinstance(settings, dict):
        raise ValueError(f"{WHERE}: expected a mapping of {list(SETTINGS)}, got {settings!r}.")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"{WHERE}: unknown setting(s) {unknown}; the settings are {list(SETTINGS)}.")
    out = PluginSettings(
        _gib(settings, "hot_rows_gib"), _calibration(settings, "hot_rows_calibration", "hot_rows_gib"),
        _gib(settings, "host_table_gib"), _calibration(settings, "host_table_calibration", "host_table_gib"),
        *(_flag(settings, name) for name in ENGRAM),
    )  # fmt: skip
    return out
