"""The padding-safe state scatter kernel vs its torch reference."""

import pytest
import torch

from qwen4_exp_hcu.kernels.state_scatter import scatter_rows, scatter_rows_reference


@pytest.mark.parametrize("seed", range(3))
def test_state_scatter_kernel_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    dst = torch.randn(6, 3, 5, generator=g)
    slots = torch.tensor([4, -1, 0, -1, 2, 9])  # padding and an out-of-range slot write nothing
    src = torch.randn(6, 3, 5, generator=g)
    assert torch.equal(scatter_rows(dst.clone(), slots, src), scatter_rows_reference(dst.clone(), slots, src))
