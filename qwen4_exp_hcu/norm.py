"""Zero-centred grouped RMSNorm of Qwen4Exp (`x_hat * (1 + w)` over groups, in fp32 like the reference):
the PLE layer's key/query/conv norms and the hyper-connections' stream norm."""

import torch
from torch import nn


class GroupedRMSNorm(nn.Module):
    def __init__(self, dim: int, group_size: int, eps: float, device=None) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"GroupedRMSNorm: dim {dim} is not a multiple of group_size {group_size}")
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float().unflatten(-1, (-1, self.group_size))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (h * (1.0 + self.weight.float())).type_as(x)
