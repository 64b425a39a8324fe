"""sisrl.common.tensors.masked_mean: hand-computed means, and nothing at a masked position leaks."""

from __future__ import annotations

import pytest
import torch
from sisrl.common.tensors import masked_mean


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_nan_and_inf_at_masked_positions_do_not_leak(dtype: torch.dtype) -> None:
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 5.0, -float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]]).to(dtype)
    mean = masked_mean(x, mask)
    assert mean.item() == pytest.approx(3.0)  # (1 + 3 + 5) / 3
    mean.backward()
    assert x.grad is not None
    third = 1 / 3
    torch.testing.assert_close(x.grad, torch.tensor([[third, 0.0, third], [0.0, third, 0.0]]), rtol=0, atol=1e-7)


def test_all_masked_is_zero_and_shape_mismatch_is_refused() -> None:
    x = torch.tensor([float("nan"), 2.0])
    assert masked_mean(x, torch.zeros(2)).item() == 0.0
    with pytest.raises(ValueError, match=r"x shape \(2,\) != mask shape \(1, 2\)"):
        masked_mean(x, torch.ones(1, 2))
