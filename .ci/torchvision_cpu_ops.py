"""Lets PyPI's torchvision import beside torch's CPU build (the dev/CI venv of `make install`).

PyPI's torchvision wheels are CUDA builds: their `_C` extension cannot load beside torch 2.13+cpu, and
`torchvision._meta_registrations` then registers fake kernels for two ops `_C` would have defined
(`torchvision::nms`, `qnms`), which fails and aborts `import torchvision`. Defining those two schemas
first lets the pure-Python parts import: the image/video transforms that transformers' Qwen-VL
processors and vLLM's Qwen3-VL processing use. The detection ops themselves stay unavailable.
`make install` copies this module into the venv and a .pth file imports it at interpreter start-up; it
defines the schemas when torchvision is first imported, so other processes never import torch for it.
"""

import sys

_LIB = None  # the schemas live as long as this library object


class _DefineTorchvisionOps:
    def find_spec(self, name, path=None, target=None):
        global _LIB
        if name == "torchvision" and _LIB is None:
            import torch

            _LIB = torch.library.Library("torchvision", "DEF")
            _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _LIB.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")
        return None  # the regular finders import torchvision itself


sys.meta_path.insert(0, _DefineTorchvisionOps())
