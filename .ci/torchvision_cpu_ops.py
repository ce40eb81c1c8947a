"""Lets PyPI's torchvision import beside torch's CPU build (the dev/CI venv of `make install`).

PyPI's torchvision wheels are CUDA builds: their `_C` extension cannot load beside torch 2.13+cpu, and
`torchvision._meta_registrations` then registers fake kernels for two ops `_C` would have defined
(`torchvision::nms`, `qnms`), which fails and aborts `import torchvision`. Defining those two schemas
first lets the pure-Python parts import: the image/video transforms that transformers' Qwen-VL
processors and vLLM's Qwen3-VL processing use. The detection ops themselves stay unavailable.
`make install` copies this module into the venv and a .pth file imports it at interpreter start-up. It acts
when torchvision is first imported, so other processes never import torch for it, and only when `_C`
does not load, so a working torchvision is left alone.
"""

import importlib.machinery
import sys
from pathlib import Path

_DONE = False
_LIB = None  # the schemas live as long as this library object


def _define_missing_schemas() -> None:
    global _LIB
    import torch

    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for ext in Path(spec.submodule_search_locations[0]).glob("_C*.so"):
        try:
            torch.ops.load_library(str(ext))
            return  # a working build: its extension defines the ops
        except OSError:
            break
    _LIB = torch.library.Library("torchvision", "DEF")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")


class _DefineTorchvisionOps:
    def find_spec(self, name, path=None, target=None):
        global _DONE
        if name == "torchvision" and not _DONE:
            _DONE = True
            _define_missing_schemas()
        return None  # the regular finders import torchvision itself


sys.meta_path.insert(0, _DefineTorchvisionOps())
