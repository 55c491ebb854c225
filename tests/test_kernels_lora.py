"""The LoRA products: the Triton BGMV kernel (Triton's interpreter here), torch's gathered BGMV and
the grouped SGMV the CPU runs all equal a per-token loop in fp32 (scattered and contiguous adapter
layouts, base-model tokens, ranks below the padded one, sizes off the block sizes); the GPU build is
in test_kernels_aot_compile.py."""

from __future__ import annotations

import pytest
import torch

from pagedcore.lora import punica

pytest.importorskip("triton")


def case(num_tokens=13, in_features=200, out_features=150, slots=3, max_rank=8, ranks=(8, 5, 0), dtype=torch.float32,
         seed=0, token_slots=None):
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(slots, max_rank, in_features)
    b = torch.zeros(slots, out_features, max_rank)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, in_features, generator=g)
        b[s, :, :r] = torch.randn(out_features, r, generator=g)
    x = torch.randn(num_tokens, in_features, generator=g)
    y = torch.randn(num_tokens, out_features, generator=g)
    if token_slots is None:
        token_slots = torch.randint(-1, slots, (num_tokens,), generator=g)
    return [t.to(dtype) for t in (y, x, a, b)] + [torch.as_tensor(token_slots, dtype=torch.int64), list(ranks)]


def loop_reference(y, x, a, b, token_slots):
    out = y.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] += b[s].double() @ (a[s].double() @ x[t].double())
    return out


def groups_of(token_slots):
    """The runner's mapping, built from per-token slots as if each token were its own sequence."""
    return punica.make_mapping(token_slots.tolist(), [1] * len(token_slots), torch.device("cpu"))


@pytest.mark.parametrize("layout", ["scattered", "contiguous", "all-base", "one-token"])
def test_triton_bgmv_torch_bgmv_and_sgmv_equal_the_loop(layout):
    slots = {"scattered": None, "contiguous": [-1, -1, 0, 0, 0, 0, 2, 2, 1, 1, 1, 1, -1],
             "all-base": [-1] * 13, "one-token": [1]}[layout]
    y, x, a, b, token_slots, ranks = case(num_tokens=len(slots) if slots else 13, token_slots=slots)
    ref = loop_reference(y, x, a, b, token_slots)
    from pagedcore.kernels import lora_bgmv

    got_triton = lora_bgmv.add_lora(y.clone(), x, a, b, token_slots)
    got_bgmv = punica.bgmv(y.clone(), x, a, b, token_slots)
    mapping = groups_of(token_slots)
    got_sgmv = y.clone() if mapping is None else punica.sgmv(y.clone(), x, a, b, ranks, mapping.groups)
    got = [got_triton, got_bgmv, got_sgmv]
    if mapping is not None and mapping.onehot is not None:  # several adapters: the CPU's stacked product too
        got.append(punica.stacked(y.clone(), x, a, b.transpose(1, 2).contiguous(), mapping.span, mapping.onehot))
    assert (mapping is not None and mapping.onehot is not None) == (layout in ("scattered", "contiguous"))
    for got in got:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    if layout == "all-base":
        assert torch.equal(got_triton, y)


def test_triton_bgmv_half_precision_rounds_once():
    y, x, a, b, token_slots, _ = case(dtype=torch.float16, seed=1)
    from pagedcore.kernels import lora_bgmv

    got = lora_bgmv.add_lora(y.clone(), x, a, b, token_slots)
    ref = loop_reference(y, x, a, b, token_slots)
    torch.testing.assert_close(got.double(), ref, rtol=2e-3, atol=2e-2)


def test_mapping_uses_slices_for_contiguous_runs_and_none_for_base_only():
    m = punica.make_mapping([0, -1, 1, 0], [2, 3, 1, 4], torch.device("cpu"))
    assert m.token_slots.tolist() == [0, 0, -1, -1, -1, 1, 0, 0, 0, 0]
    groups = dict(m.groups)
    assert groups[1] == slice(5, 6)
    assert groups[0].tolist() == [0, 1, 6, 7, 8, 9]  # not contiguous: an index tensor
    assert m.span == slice(0, 2) and m.onehot.tolist() == [[1, 0]] * 2 + [[0, 0]] * 3 + [[0, 1]] + [[1, 0]] * 4
    one = punica.make_mapping([-1, 2, 2], [1, 2, 3], torch.device("cpu"))
    assert dict(one.groups) == {2: slice(1, 6)} and one.onehot is None  # one run: SGMV's single matmul pair
    assert punica.make_mapping([-1, -1], [3, 1], torch.device("cpu")) is None


@pytest.mark.parametrize("max_rank,ranks", [(12, (12, 3, 7)), (64, (64, 16, 0))])
def test_triton_bgmv_ranks_off_a_power_of_two_and_several_k_blocks(max_rank, ranks):
    # rank 12: BLOCK_R 16 masks the padding; rank 64: BLOCK_K 64 walks in_features=200 in 4 blocks
    y, x, a, b, token_slots, _ = case(num_tokens=9, max_rank=max_rank, ranks=ranks, out_features=300, seed=2)
    from pagedcore.kernels import lora_bgmv

    got = lora_bgmv.add_lora(y.clone(), x, a, b, token_slots)
    torch.testing.assert_close(got.double(), loop_reference(y, x, a, b, token_slots), rtol=1e-5, atol=1e-3)
