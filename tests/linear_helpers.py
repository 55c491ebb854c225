"""Checks the packed-linear tests share (panels, VNNI pairs, oneDNN)."""

from __future__ import annotations

import torch


def check_leading_dims_strided_input_and_nan(linear: torch.nn.Linear, rows: int) -> None:
    """A [2, rows, 64] input whose rows are strided views, one NaN: the output keeps the leading dims, the NaN
    reaches exactly its own row, and the other rows match the fp32 product."""
    x = torch.randn(2, rows, 128, dtype=torch.bfloat16)[..., :64]
    x[1, 2, 3] = float("nan")
    with torch.inference_mode():
        got = linear(x)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert got.shape == (2, rows, linear.out_features)
    assert torch.isnan(got[1, 2]).all() and not torch.isnan(got[0]).any() and not torch.isnan(got[1, 3:]).any()
    assert torch.allclose(got[0].float(), want[0], atol=0.05, rtol=0.01)
