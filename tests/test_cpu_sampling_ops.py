"""The sampler's C++ row reductions (kernels/csrc/cpu_sampling.cpp) on their edges; the sampler
tests (test_sampler.py) check them again through the Sampler, on both paths."""

from __future__ import annotations

import pytest
import torch




def random_logits(seed: int, B: int, V: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale


def test_inverse_cdf_edges(ext):
    V = 600  # spans several of the kernel's 256-token chunks
    probs = torch.zeros(4, V)
    probs[:, [3, 300, 599 - 7]] = torch.tensor([0.25, 0.5, 0.25])
    tiny = probs[3]
    tiny.zero_()
    tiny[[10, 500]] = torch.tensor([1e-30, 1.0])  # far below fp32's resolution of a running sum near 1
    u = torch.tensor([0.0, 0.25 - 1e-12, 1.0 - 2.0**-53, 1e-31], dtype=torch.float64)
    picks = ext.sample_inverse_cdf(probs, u).tolist()
    assert picks == [3, 3, 592, 10]
    # The last positive token when rounding leaves the running sum under the target.
    assert ext.sample_inverse_cdf(probs[:1] * 3.3, torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)).item() == 592
    # Unnormalised rows: the draw is relative to the row's own sum.
    assert ext.sample_inverse_cdf(probs[:1] * 7.0, torch.tensor([0.6], dtype=torch.float64)).item() == 300


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_logsumexp_matches_torch(ext, dtype):
    logits = (random_logits(11, 9, 49152, scale=6.0)).to(dtype)
    logits[2, 100] = logits[2, 7] = logits[2].max() + 1  # a tie: the first index, as torch.argmax
    idx, lse = ext.argmax_logsumexp(logits)
    assert torch.equal(idx, logits.argmax(-1))
    torch.testing.assert_close(lse, logits.float().logsumexp(-1), rtol=1e-5, atol=1e-5)
    logits[4, 9] = float("nan")
    assert torch.isnan(ext.argmax_logsumexp(logits)[1][4])  # visible, so the sampler falls back
