"""Zero-centred grouped RMSNorm of Qwen4Exp (`x_hat * (1 + w)` over groups, in fp32 like the reference):
the PLE layer's key/query/conv norms and the hyper-connections' stream norm."""

import torch
from torch import nn

from qwen4_exp_hcu.kernels import dispatch
from qwen4_exp_hcu.kernels.hyper_connection import inject_norm, inject_norm_reference


class GroupedRMSNorm(nn.Module):
    def __init__(self, dim: int, group_size: int, eps: float, device=None) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"GroupedRMSNorm: dim {dim} is not a multiple of group_size {group_size}")
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch(inject_norm, inject_norm_reference, x, self.weight, self.eps, self.group_size)[1]
