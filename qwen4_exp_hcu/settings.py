"""The plugin's own settings, `--additional-config '{"qwen4_exp_hcu": {...}}'` (what vLLM's `EngramConfig` has no
field for), as one pydantic model. A leaf module (no torch, no vLLM): the plugin parses them while vLLM builds its
config, long before a model exists, and the model reads what was parsed there."""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SETTINGS_KEY = "qwen4_exp_hcu"
WHERE = f"--additional-config.{SETTINGS_KEY}"
ENGRAM = ("cpu_offload", "dp_shared_memory", "use_thp")  # named as `--engram-config`'s fields; ours win over vLLM's

# Each kind of value with what a bad one is told it must be.
GiB = Annotated[float, Field(ge=0, allow_inf_nan=False, description="a number of GiB >= 0")]
Calibration = Annotated[str | None, Field(description="the path of a safetensors file")]  # with a `tokens` stream
Flag = Annotated[bool | None, Field(description="true or false")]


class PluginSettings(BaseModel):
    """The settings, checked: unknown names and wrong types are errors naming the setting; what depends on the
    model or platform is checked where the model is built (`model.ple_placement`). `host_table_gib` > 0 turns on
    the file tier (`ple.tiers.file_rows`): that many GiB of the most-read rows stay in host memory, the others are
    read from the checkpoint's files per lookup; with `hot_rows_gib` too, a GPU hot-row cache sits in front of
    both. Strict: JSON's types only (a number of GiB is no string, a flag no number)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    hot_rows_gib: GiB = 0  # GPU hot-row cache, GiB per rank over all PLE layers, row maps included (0 = off)
    hot_rows_calibration: Calibration = None  # its calibration tokens (None: it follows served traffic)
    host_table_gib: GiB = 0  # host bytes per rank for resident PLE rows; the rest stay in the files (0 = off)
    host_table_calibration: Calibration = None  # the resident rows' calibration tokens (None: they follow traffic)
    # `--engram-config`'s storage settings of the same names, on every release (they win where both are set;
    # vLLM before 0.30 parses no `--engram-config`). None: vLLM's value, or its default.
    cpu_offload: Flag = None
    dp_shared_memory: Flag = None
    use_thp: Flag = None

    @model_validator(mode="after")
    def _calibrated_only_with_a_size(self) -> "PluginSettings":
        pairs = (("hot_rows_calibration", "hot_rows_gib"), ("host_table_calibration", "host_table_gib"))
        for calibration, size in pairs:
            if getattr(self, calibration) is not None and not getattr(self, size):
                raise ValueError(f"{WHERE}.{calibration} is set but {size} is not: there is nothing to calibrate.")
        return self


SETTINGS = tuple(PluginSettings.model_fields)
_KEPT = "_qwen4_exp_hcu_settings"  # where an engine's config keeps its parsed settings


def plugin_settings(additional_config: dict | None) -> PluginSettings:
    """The settings under `additional_config[SETTINGS_KEY]`, parsed; a bad one is a `ValueError` naming it."""
    values = (additional_config or {}).get(SETTINGS_KEY, {})
    try:
        return PluginSettings.model_validate(values)
    except ValidationError as e:
        raise ValueError(_message(e, values)) from None  # the message is whole; pydantic's adds no more


def engine_settings(vllm_config) -> PluginSettings:
    """The engine's settings, parsed where the plugin first sees its config (vLLM's config hook, while the config is
    built) and kept on it: vLLM hands the config whole (pickled or inherited) to its engine processes, so the model
    reads what the hook checked. A config that never met the hook (a copy vLLM makes field by field, a test's
    stand-in) has them parsed at the first read."""
    settings = getattr(vllm_config, _KEPT, None)
    if settings is None:
        settings = plugin_settings(vllm_config.additional_config)
        setattr(vllm_config, _KEPT, settings)
    return settings


def _message(error: ValidationError, values) -> str:
    """One line for pydantic's first complaint, in the settings' own words."""
    errors = error.errors()
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        return f"{WHERE}: unknown setting(s) {unknown}; the settings are {list(SETTINGS)}."
    first = errors[0]
    if first["type"] == "model_type":
        return f"{WHERE}: expected a mapping of {list(SETTINGS)}, got {values!r}."
    if not first["loc"]:  # a rule between settings (`_calibrated_only_with_a_size`)
        return str(first["ctx"]["error"])
    name = str(first["loc"][0])
    return f"{WHERE}.{name} must be {PluginSettings.model_fields[name].description}, got {first['input']!r}."
