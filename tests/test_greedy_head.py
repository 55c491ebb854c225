"""The greedy head (pagedcore/greedy_head.py, kernels/csrc/cpu_greedy_head.cpp): the argmax of the LM head from int8
codes and a few exact logits must be the full logits' argmax (pack_linear_weight's fp32 panels, or the bf16 VNNI
pairs' or bf16 panels' logits rounded to bf16; argmax_logsumexp's lowest index on ties), bit for bit, whatever the
input; and the engine's greedy tokens must not change with it."""

from __future__ import annotations

import pytest
import torch

from pagedcore import LLMEngine, SamplingParams
from pagedcore.greedy_head import OUTLIER_DIMS
from pagedcore.kernels import cpu_ext

ext = cpu_ext.load()
pytestmark = pytest.mark.skipif(ext is None or not ext.greedy_head_supported(),
                                reason="the greedy head needs the C++ ops on an AVX-512 BW + VNNI or AVX2 + FMA CPU")


def full_argmax(x: torch.Tensor, panels: torch.Tensor, vocab: int) -> torch.Tensor:
    """The reference: every logit from the fp32 panels, then argmax_logsumexp's argmax (first index of the max)."""
    return ext.argmax_logsumexp(ext.packed_linear(x, panels, vocab))[0]


def greedy(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    panels = ext.pack_linear_weight(weight)
    codes, stats = ext.greedy_head_pack(weight)
    tokens, exact = ext.greedy_head(x, codes, stats, weight)
    return tokens, exact, full_argmax(x, panels, weight.shape[0])


@pytest.mark.parametrize("vocab,k,rows", [(1000, 64, 1), (1000, 64, 13), (4099, 576, 7), (333, 63, 6), (16, 2, 3)])
def test_equals_the_full_logits_argmax(vocab, k, rows):
    g = torch.Generator().manual_seed(vocab + k + rows)
    weight = torch.randn(vocab, k, generator=g) * 0.1
    x = torch.randn(rows, k, generator=g) * 3
    tokens, exact, want = greedy(x, weight)
    assert torch.equal(tokens, want)
    assert bool((exact >= 1).all()) and bool((exact <= vocab).all())


def test_few_logits_are_computed_exactly():
    """The point of it: on a peaked row (one token well ahead) the bound rules out nearly every token."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(8192, 256, generator=g) * 0.05
    x = torch.randn(8, 256, generator=g)
    x += 4 * weight[torch.arange(8) * 1000] / weight[torch.arange(8) * 1000].norm(dim=1, keepdim=True) * 16
    tokens, exact, want = greedy(x, weight)
    assert torch.equal(tokens, want) and torch.equal(tokens, torch.arange(8) * 1000)
    assert int(exact.max()) < 64


def test_near_ties_and_exact_ties():
    """Columns whose logits differ in their last bits, or not at all: the exact pass decides, lowest index first."""
    g = torch.Generator().manual_seed(2)
    k, vocab = 576, 2048
    weight = torch.randn(vocab, k, generator=g) * 0.05
    x = torch.randn(16, k, generator=g)
    best = full_argmax(x, ext.pack_linear_weight(weight), vocab)
    for r, j in enumerate(best.tolist()):  # near-copies of each row's winner elsewhere, one exact copy before it
        for c, eps in enumerate((0.0, 1e-7, -1e-7, 3e-7)):
            other = (j + 97 * (r + 1) * (c + 1)) % vocab
            weight[other] = weight[j] * (1 + eps)
    tokens, _, want = greedy(x, weight)
    assert torch.equal(tokens, want)


def test_outlier_activations():
    """A few huge dims (LLMs' massive activations) coarsen the int16 codes of the rest: still exact."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(3000, 576, generator=g) * 0.05
    x = torch.randn(5, 576, generator=g)
    x[:, [7, 300]] = torch.tensor([400.0, -900.0])
    tokens, _, want = greedy(x, weight)
    assert torch.equal(tokens, want)


def test_a_row_that_is_not_finite_is_left_to_the_caller():
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(500, 64, generator=g)
    x = torch.randn(3, 64, generator=g)
    x[1, 5] = float("nan")
    tokens, _, want = greedy(x, weight)
    assert tokens[1] == -1 and tokens[0] == want[0] and tokens[2] == want[2]


def test_pack_refuses_a_weight_that_is_not_finite():
    weight = torch.ones(32, 8)
    weight[3, 3] = float("inf")
    with pytest.raises(RuntimeError, match="not finite"):
        ext.greedy_head_pack(weight)
    weight[3, 3] = float("nan")
    with pytest.raises(RuntimeError, match="not finite"):
        ext.greedy_head_pack(weight)


# ---- bf16 heads in VNNI pairs (the AVX512-BF16 tiles' logits, rounded to bf16) ---------------------------------
needs_bf16 = pytest.mark.skipif(not ext.greedy_head_bf16_supported(),
                                reason="the bf16 greedy head needs AVX512-BF16 without AMX")


def greedy_bf16(x: torch.Tensor, weight: torch.Tensor,
                n_dims: int = OUTLIER_DIMS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    panels = ext.pack_linear_weight_vnni(weight.bfloat16())
    codes, stats, colsum = ext.greedy_head_pack_bf16(panels, weight.shape[0])
    dims = x.abs().amax(0).float().topk(min(n_dims, x.shape[1])).indices.to(torch.int32)  # GreedyHead's outlier dims
    wo = ext.greedy_head_outliers(panels, dims)
    tokens, exact = ext.greedy_head_bf16(x.bfloat16(), codes, stats, colsum, weight.bfloat16(), dims, wo)
    return tokens, exact, full_argmax(x.bfloat16(), panels, weight.shape[0])


@needs_bf16
@pytest.mark.parametrize("vocab,k,rows", [(1000, 64, 1), (1000, 64, 13), (4099, 576, 7), (333, 32, 6), (49152, 576, 3)])
def test_bf16_equals_the_full_logits_argmax(vocab, k, rows):
    g = torch.Generator().manual_seed(vocab + k + rows)
    tokens, exact, want = greedy_bf16(torch.randn(rows, k, generator=g) * 3, torch.randn(vocab, k, generator=g) * 0.1)
    assert torch.equal(tokens, want)
    assert bool((exact >= 1).all()) and bool((exact <= vocab).all())


@needs_bf16
def test_bf16_step_checks_its_dims_then_answers_as_the_kernel():
    """greedy_head_bf16_step (a decode step's call): the dim of x's largest |value| as torch finds it (a NaN's first);
    nothing computed where that dim is not among the outlier dims (unless told to); else the kernel's tokens and the
    sum of its exact counts, or None where a row gave -1."""
    g = torch.Generator().manual_seed(11)
    vocab, k = 4099, 576
    weight = torch.randn(vocab, k, generator=g) * 0.1
    x = (torch.randn(5, k, generator=g) * 3).bfloat16()
    x[2, 77] = 40.0
    panels = ext.pack_linear_weight_vnni(weight.bfloat16())
    codes, stats, colsum = ext.greedy_head_pack_bf16(panels, vocab)
    rows = weight.bfloat16().contiguous()
    top = int(x.abs().amax(0).float().argmax())
    assert top == 77
    dims = x.abs().amax(0).float().topk(OUTLIER_DIMS).indices.sort().values.to(torch.int32)
    wo = ext.greedy_head_outliers(panels, dims)
    tokens, counts = ext.greedy_head_bf16(x, codes, stats, colsum, rows, dims, wo)
    got, exact, dim = ext.greedy_head_bf16_step(x, codes, stats, colsum, rows, dims, wo)
    assert torch.equal(got, tokens) and exact == int(counts.sum()) and dim == 77
    others = torch.tensor([d for d in range(k) if d != 77][:OUTLIER_DIMS], dtype=torch.int32)
    wo2 = ext.greedy_head_outliers(panels, others)
    assert ext.greedy_head_bf16_step(x, codes, stats, colsum, rows, others, wo2) == (None, -1, 77)
    got, exact, _ = ext.greedy_head_bf16_step(x, codes, stats, colsum, rows, others, wo2, check_dims=False)
    assert torch.equal(got, full_argmax(x, panels, vocab)) and exact >= 5
    x[1, 5], x[3, 3] = float("nan"), float("nan")
    assert int(x.abs().amax(0).float().argmax()) == 3  # torch: the first NaN
    got, exact, dim = ext.greedy_head_bf16_step(x, codes, stats, colsum, rows, dims, wo, check_dims=False)
    assert got is None and dim == 3


@needs_bf16
def test_bf16_ties_after_rounding_and_outliers():
    """bf16 logits tie far more often than fp32 ones: columns whose logits differ below a bf16 ulp, or not at all,
    must go to the lowest index; and a few huge dims coarsen the uint8 codes of the rest."""
    g = torch.Generator().manual_seed(2)
    k, vocab = 576, 2048
    weight = (torch.randn(vocab, k, generator=g) * 0.05).bfloat16().float()
    x = torch.randn(16, k, generator=g)
    x[:3, [7, 300]] = torch.tensor([400.0, -900.0])
    best = full_argmax(x.bfloat16(), ext.pack_linear_weight_vnni(weight.bfloat16()), vocab)
    for r, j in enumerate(best.tolist()):  # copies of each row's winner, some after a 1-ulp nudge of one weight
        for c in range(4):
            other = (j + 97 * (r + 1) * (c + 1)) % vocab
            weight[other] = weight[j]
            if c % 2:
                weight[other, (r * 31 + c) % k] = weight[other, (r * 31 + c) % k].bfloat16().float() * (1 + 2**-7)
    tokens, exact, want = greedy_bf16(x, weight)
    assert torch.equal(tokens, want)
    assert int(exact.min()) >= 1


@needs_bf16
@pytest.mark.parametrize("n_dims", [0, 1, 5, 16, 31])
def test_bf16_any_count_of_outlier_dims(n_dims):
    """The outlier dims go two to a vdpbf16ps: an odd count's last pairs with a zero; none leaves every dim coded."""
    g = torch.Generator().manual_seed(n_dims)
    k, vocab = 96, 1500
    x = torch.randn(9, k, generator=g) * 2
    x[:, [3, 50, 51, 90]] *= torch.tensor([60.0, -35.0, 20.0, 80.0])  # massive activations, as LLMs' final states have
    tokens, exact, want = greedy_bf16(x, torch.randn(vocab, k, generator=g) * 0.1, n_dims)
    assert torch.equal(tokens, want)
    assert bool((exact >= 1).all())


@needs_bf16
def test_bf16_outlier_weights_in_pairs():
    """greedy_head_outliers: dims 2i and 2i + 1 of the list side by side for each column, as x's pairs hold them."""
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 32, generator=g).bfloat16()  # 3 panels, the last one partial
    dims = torch.tensor([30, 2, 17], dtype=torch.int32)
    wo = ext.greedy_head_outliers(ext.pack_linear_weight_vnni(weight), dims)
    assert wo.dtype == torch.bfloat16 and wo.shape == (3, 2, 32)
    cols = torch.arange(3 * 16).clamp(max=39)
    for i, d in enumerate(dims.tolist()):
        got = wo[:, i // 2, i % 2::2].reshape(-1)[:40]
        assert torch.equal(got, weight[cols[:40], d])
    assert not bool(wo[:, 1, 1::2].any())  # the odd list's last dim paired with zeros


@needs_bf16
def test_bf16_a_row_that_is_not_finite_is_left_to_the_caller():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=g)
    x[1, 5] = float("inf")
    tokens, _, want = greedy_bf16(x, torch.randn(500, 64, generator=g))
    assert tokens[1] == -1 and tokens[0] == want[0] and tokens[2] == want[2]


# ---- bf16 heads in VNNI pairs on AMX tiles (every logit from the head's own tiles, folded into the argmax) --------
needs_amx = pytest.mark.skipif(not ext.greedy_head_amx_supported(), reason="greedy_head_amx needs AMX tiles")


def greedy_amx(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    panels = ext.pack_linear_weight_vnni(weight.bfloat16())
    return ext.greedy_head_amx(x.bfloat16(), panels, weight.shape[0]), full_argmax(x.bfloat16(), panels, weight.shape[0])


@needs_amx
@pytest.mark.parametrize("vocab,k,rows", [(1000, 64, 1), (1000, 64, 16), (4099, 576, 7), (333, 32, 17), (37, 32, 40),
                                          (49152, 576, 3), (49152, 576, 64)])
def test_amx_equals_the_full_logits_argmax(vocab, k, rows):
    """Any row count (whole and partial 16-row tiles), a vocabulary that ends inside a panel or a 4-panel group."""
    g = torch.Generator().manual_seed(vocab + k + rows)
    tokens, want = greedy_amx(torch.randn(rows, k, generator=g) * 3, torch.randn(vocab, k, generator=g) * 0.1)
    assert torch.equal(tokens, want)


@needs_amx
def test_amx_ties_after_rounding_go_to_the_lowest_index():
    """Copies of each row's winner, some a bf16 ulp apart in one weight (equal after the logits round to bf16, or
    not), before and after it, in either thread's half of the vocabulary."""
    g = torch.Generator().manual_seed(2)
    k, vocab = 576, 2048
    weight = (torch.randn(vocab, k, generator=g) * 0.05).bfloat16().float()
    x = torch.randn(16, k, generator=g)
    best = full_argmax(x.bfloat16(), ext.pack_linear_weight_vnni(weight.bfloat16()), vocab)
    for r, j in enumerate(best.tolist()):
        for c in range(4):
            other = (j + 97 * (r + 1) * (c + 1)) % vocab
            weight[other] = weight[j]
            if c % 2:
                weight[other, (r * 31 + c) % k] = weight[other, (r * 31 + c) % k].bfloat16().float() * (1 + 2**-7)
    tokens, want = greedy_amx(x, weight)
    assert torch.equal(tokens, want)
    logits = ext.packed_linear(x.bfloat16(), ext.pack_linear_weight_vnni(weight.bfloat16()), vocab).float()
    assert int((logits == logits.amax(1, keepdim=True)).sum(1).max()) > 1  # exact ties did occur


@needs_amx
def test_amx_a_row_or_logit_that_is_not_finite_is_left_to_the_caller():
    g = torch.Generator().manual_seed(4)
    x, weight = torch.randn(3, 64, generator=g), torch.randn(500, 64, generator=g)
    x[1, 5] = float("inf")
    tokens, want = greedy_amx(x, weight)
    assert tokens[1] == -1 and tokens[0] == want[0] and tokens[2] == want[2]
    weight[499, 3] = float("nan")  # the last column of a part panel: every row meets it
    tokens, _ = greedy_amx(torch.randn(3, 64, generator=g), weight)
    assert tokens.tolist() == [-1, -1, -1]


# ---- bf16 heads in plain panels (AVX2: the same fp32 chain over the widened values, logits rounded to bf16) ------
needs_bf16_panels = pytest.mark.skipif(not ext.greedy_head_bf16_panels_supported(),
                                       reason="bf16 rows go to the AVX2 kernel (CPUs without AVX-512)")


def greedy_bf16_panels(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = weight.bfloat16()
    codes, stats = ext.greedy_head_pack(rows.float())
    tokens, exact = ext.greedy_head(x.bfloat16().float(), codes, stats, rows)
    return tokens, exact, full_argmax(x.bfloat16(), ext.pack_linear_weight(rows), weight.shape[0])


@needs_bf16_panels
@pytest.mark.parametrize("vocab,k,rows", [(1000, 64, 1), (1000, 64, 13), (4099, 576, 7), (333, 63, 6), (16, 2, 3)])
def test_bf16_panels_equal_the_full_logits_argmax(vocab, k, rows):
    g = torch.Generator().manual_seed(vocab + k + rows)
    tokens, exact, want = greedy_bf16_panels(torch.randn(rows, k, generator=g) * 3,
                                             torch.randn(vocab, k, generator=g) * 0.1)
    assert torch.equal(tokens, want)
    assert bool((exact >= 1).all()) and bool((exact <= vocab).all())


@needs_bf16_panels
def test_bf16_panels_ties_after_rounding_and_the_last_column():
    """Logits that differ below a bf16 ulp tie once rounded: the lowest index wins; the winner may be the last
    column, whose weights are gathered one by one (a vector gather would read past the rows)."""
    g = torch.Generator().manual_seed(5)
    k, vocab = 576, 2048
    weight = (torch.randn(vocab, k, generator=g) * 0.05).bfloat16().float()
    x = torch.randn(16, k, generator=g)
    best = full_argmax(x.bfloat16(), ext.pack_linear_weight(weight.bfloat16()), vocab)
    for r, j in enumerate(best.tolist()):  # copies of each row's winner, some after a 1-ulp nudge of one weight
        for c in range(4):
            other = vocab - 1 if (r, c) == (0, 0) else (j + 97 * (r + 1) * (c + 1)) % vocab
            weight[other] = weight[j]
            if c % 2:
                weight[other, (r * 31 + c) % k] = weight[other, (r * 31 + c) % k].bfloat16().float() * (1 + 2**-7)
    weight[vocab - 1] *= 1.5  # row 0's copy in the last column now leads it by far
    tokens, exact, want = greedy_bf16_panels(x, weight)
    assert torch.equal(tokens, want) and int(tokens[0]) == vocab - 1
    ties = [r for r in range(1, 16) if int(exact[r]) > 1]
    assert ties, "no row had a tie to break"


@needs_bf16_panels
def test_bf16_panels_a_row_that_is_not_finite_is_left_to_the_caller():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=g)
    x[1, 5] = float("inf")
    tokens, _, want = greedy_bf16_panels(x, torch.randn(500, 64, generator=g))
    assert tokens[1] == -1 and tokens[0] == want[0] and tokens[2] == want[2]


PROMPTS = [list(range(100 + 5 * i, 130 + 9 * i)) for i in range(6)]


def _tokens(engine: LLMEngine, params: SamplingParams) -> list[tuple[list[int], float | None]]:
    ids = [engine.add_request(None, p, params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].cumulative_logprob)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    return [done[i] for i in ids]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_with_and_without_the_greedy_head(smollm2_dir, dtype):
    """The bundled model, greedy, batch 6 over 24 steps: the same tokens with the head as with full logits; the
    head answered the decode steps; such requests report no cumulative logprob, logprobs=0 ones do."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    on = LLMEngine(model=str(smollm2_dir), max_num_seqs=8, num_kv_blocks=128, dtype=dtype)
    head = on.runner.decode_stack.greedy_head if on.runner.decode_stack is not None else None
    if head is None:
        pytest.skip("no decode stack / greedy head for this model here")
    got = _tokens(on, params)
    assert head.rows >= 6 * 20 and (head.amx or head.exact < head.rows * 200)  # AMX: every logit (no codes)
    off = LLMEngine(model=str(smollm2_dir), max_num_seqs=8, num_kv_blocks=128, dtype=dtype)
    off.runner.decode_stack.greedy_head = None
    want = _tokens(off, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0))
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(c is None for _, c in got) and all(c is not None and c < 0 for _, c in want)
