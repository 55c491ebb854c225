"""Sampler masks and penalties: every one against a slow, obviously-correct per-row reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagedcore.logits_processors import apply_min_p, apply_penalties, apply_top_k, apply_top_p, token_counts
from pagedcore.sampler import Sampler
from pagedcore.sampling_params import SamplingParams
from sampler_helpers import FAST, NEG_INF, build, kept, random_logits

pytestmark = pytest.mark.usefixtures("sampler_path")  # every test on both paths (conftest.py)


# --------------------------------------------------------------------------- references


def ref_top_k(row: list[float], k: int) -> list[bool]:
    if k <= 0 or k >= len(row):
        return [True] * len(row)
    kth = sorted(row, reverse=True)[k - 1]
    return [x >= kth for x in row]


def softmax64(row: list[float]) -> list[float]:
    finite = [x for x in row if x != NEG_INF]
    m = max(finite)
    e = [math.exp(x - m) if x != NEG_INF else 0.0 for x in row]
    s = sum(e)
    return [x / s for x in e]


def ref_top_p(row: list[float], p: float) -> tuple[list[bool], float]:
    """Keep-mask, and the distance of p from the nearest prefix mass (for `assume`)."""
    if p >= 1.0:
        return [True] * len(row), 1.0
    probs = softmax64(row)
    order = sorted(range(len(row)), key=lambda i: -row[i])
    keep = [False] * len(row)
    mass, margin = 0.0, 1.0
    for rank, i in enumerate(order):
        if rank > 0:
            margin = min(margin, abs(mass - p))
        if rank == 0 or mass < p:
            keep[i] = True
        mass += probs[i]
    return keep, margin


def ref_min_p(row: list[float], min_p: float) -> tuple[list[bool], float]:
    probs = softmax64(row)
    threshold = min_p * max(probs)
    keep = [q >= threshold for q in probs]
    margin = min((abs(q - threshold) / max(threshold, 1e-30) for q in probs if q != max(probs)), default=1.0)
    return keep, margin


def ref_penalties(logits, prompts, outputs, presence, frequency, repetition):
    rows = logits.tolist()
    for i, row in enumerate(rows):
        for tok in set(prompts[i]) | set(outputs[i]):
            row[tok] = row[tok] / repetition[i] if row[tok] > 0 else row[tok] * repetition[i]
        for tok in set(outputs[i]):
            row[tok] -= frequency[i] * outputs[i].count(tok) + presence[i]
    return torch.tensor(rows)


# --------------------------------------------------------------------------- masks


@FAST
@given(
    data=st.data(),
    B=st.integers(1, 6),
    V=st.integers(1, 64),
    seed=st.integers(0, 2**31 - 1),
)
def test_top_k_matches_reference(data, B, V, seed):
    logits = random_logits(seed, B, V)
    ks = data.draw(st.lists(st.sampled_from([0, 1, 2, V // 2, V - 1, V, V + 3]) | st.integers(0, V), min_size=B, max_size=B))
    out = apply_top_k(logits, torch.tensor(ks))
    rows = logits.tolist()
    assert kept(out) == [ref_top_k(r, k) for r, k in zip(rows, ks)]
    # Survivors keep their value exactly.
    assert torch.equal(out[out != NEG_INF], logits[out != NEG_INF])


def test_top_k_keeps_ties_and_exact_count():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k(logits, torch.tensor([2, 3]))
    assert kept(out) == [[False, True, True, False, False], [True, True, True, False, False]]
    out = apply_top_k(logits, torch.tensor([1, 0]))
    assert kept(out) == [[False, True, True, False, False], [True] * 5]


@FAST
@given(
    data=st.data(),
    B=st.integers(1, 6),
    V=st.integers(1, 64),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.1, 1.0, 3.0, 10.0]),
)
def test_top_p_matches_reference(data, B, V, seed, scale):
    logits = random_logits(seed, B, V, scale)
    p_values = st.sampled_from([1.0, 1e-6, 0.5, 0.9, 0.99]) | st.floats(1e-4, 1.0)
    ps = data.draw(st.lists(p_values, min_size=B, max_size=B))
    refs = [ref_top_p(r, p) for r, p in zip(logits.tolist(), ps)]
    # A p within float32 rounding of a prefix mass is a coin flip for any implementation.
    assume(all(margin > 1e-5 for _, margin in refs))
    out = apply_top_p(logits, torch.tensor(ps, dtype=torch.float32))
    assert kept(out) == [keep for keep, _ in refs]
    assert torch.equal(out[out != NEG_INF], logits[out != NEG_INF])


def test_top_p_edges():
    logits = random_logits(1, 4, 50, 0.01)  # nearly uniform: cumsum reaches ~1 - eps
    out = apply_top_p(logits, torch.tensor([1.0, 1e-9, 1.0, 1e-9]))
    assert kept(out)[0] == [True] * 50 and kept(out)[2] == [True] * 50
    for row in (1, 3):
        assert kept(out)[row] == [i == int(logits[row].argmax()) for i in range(50)]
    # Composes with an earlier mask: -inf entries stay dropped, the rest renormalise.
    pre = apply_top_k(logits, torch.tensor([3, 3, 3, 3]))
    out = apply_top_p(pre, torch.tensor([0.999, 0.999, 1.0, 0.5]))
    assert ((out != NEG_INF).sum(-1) <= 3).all()
    # Exactly representable masses: the prefix that *reaches* p is kept, nothing more.
    flat = torch.zeros(3, 4)  # probs 0.25 each, cumsum 0.25, 0.5, 0.75, 1.0 exactly
    out = apply_top_p(flat, torch.tensor([0.5, 0.25, 0.75]))
    assert (out != NEG_INF).sum(-1).tolist() == [2, 1, 3]


@FAST
@given(
    data=st.data(),
    B=st.integers(1, 6),
    V=st.integers(1, 64),
    seed=st.integers(0, 2**31 - 1),
)
def test_min_p_matches_reference(data, B, V, seed):
    logits = random_logits(seed, B, V)
    mins = data.draw(st.lists(st.sampled_from([0.0, 1.0, 0.05, 0.5]) | st.floats(0.0, 1.0), min_size=B, max_size=B))
    refs = [ref_min_p(r, m) for r, m in zip(logits.tolist(), mins)]
    assume(all(margin > 1e-4 for _, margin in refs))
    out = apply_min_p(logits, torch.tensor(mins, dtype=torch.float32))
    assert kept(out) == [keep for keep, _ in refs]
    for row, m in enumerate(mins):
        if m == 0.0:
            assert kept(out)[row] == [True] * V
        if m == 1.0:
            assert kept(out)[row] == [i == int(logits[row].argmax()) for i in range(V)]


# --------------------------------------------------------------------------- penalties


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    B=st.integers(1, 5),
    V=st.integers(2, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_penalties_match_reference(data, B, V, seed):
    logits = random_logits(seed, B, V)
    ids = st.lists(st.integers(0, V - 1), max_size=12)
    prompts = data.draw(st.lists(ids, min_size=B, max_size=B))
    outputs = data.draw(st.lists(ids, min_size=B, max_size=B))
    pen = st.sampled_from([0.0, -2.0, 2.0, 0.5]) | st.floats(-2.0, 2.0)
    presence = data.draw(st.lists(pen, min_size=B, max_size=B))
    frequency = data.draw(st.lists(pen, min_size=B, max_size=B))
    repetition = data.draw(st.lists(st.sampled_from([1.0, 1.3, 0.7]) | st.floats(0.1, 3.0), min_size=B, max_size=B))
    params = [
        SamplingParams(temperature=0.0, presence_penalty=pr, frequency_penalty=fr, repetition_penalty=rp)
        for pr, fr, rp in zip(presence, frequency, repetition)
    ]
    batch = build(params, V, prompts, outputs)
    out = apply_penalties(
        logits,
        batch.prompt_token_ids,
        batch.output_token_ids,
        batch.presence_penalties,
        batch.frequency_penalties,
        batch.repetition_penalties,
    )
    ref = ref_penalties(logits, prompts, outputs, presence, frequency, repetition)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # Greedy on penalised logits is exactly their argmax.
    got = Sampler()(logits, batch).sampled_token_ids
    assert torch.equal(got, out.argmax(-1))


def test_penalty_semantics_by_hand():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    # Repetition (HF): seen positive logit divided, seen negative multiplied; prompt counts.
    out = apply_penalties(logits, torch.tensor([[0, 4]]), torch.tensor([[1, 4]]), None, None, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    # Presence/frequency (OpenAI): output only, 2 occurrences of token 2, prompt ignored.
    out = apply_penalties(
        logits, None, torch.tensor([[2, 2, 4]]), torch.tensor([0.5]), torch.tensor([0.25]), None
    )
    assert out.tolist() == [[2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5]]
    assert token_counts(torch.tensor([[2, 2, 4, 1]]), 4).tolist() == [[0, 1, 2, 0]]


def test_build_skips_unused_tensors():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)]
    batch = build(params, 10, prompts=[[1, 2], [3]], outputs=[[4], []])
    assert batch.no_penalties and batch.prompt_token_ids is None and batch.output_token_ids is None
    assert batch.no_top_k and batch.no_top_p and batch.no_min_p
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None
    assert batch.min_tokens_block is None and batch.max_num_logprobs is None
    assert not batch.all_greedy and not batch.all_random and batch.needs_default_rng

    # Only presence/frequency: no prompt ids needed.
    batch = build([SamplingParams(presence_penalty=0.5)], 10, prompts=[[1]], outputs=[[2]])
    assert batch.prompt_token_ids is None and batch.output_token_ids is not None
    assert batch.repetition_penalties is None

    # Truncation on a greedy row alone does not switch on the truncation passes.
    batch = build([SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)], 10)
    assert batch.all_greedy and batch.temperature is None and batch.no_top_k and batch.no_top_p
    # top_k >= V is a no-op.
    assert build([SamplingParams(top_k=10)], 10).no_top_k
    assert build([SamplingParams(logprobs=0), SamplingParams(logprobs=5), SamplingParams()], 10).max_num_logprobs == 5
    assert build([SamplingParams(logprobs=20)], 4).max_num_logprobs == 4  # clamped to the vocabulary



@pytest.mark.parametrize("scale", [0.3, 3.0, 10.0])  # flat (fallback to the full sort) .. peaked
def test_top_p_over_candidates_equals_full_sort(scale):
    """Top-p over the largest logits first keeps exactly the tokens the full-vocabulary sort keeps."""
    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(16, 49152, generator=g) * scale
    p = torch.rand(16, generator=g) * 0.98 + 0.01
    fast = apply_top_p(logits, p)
    full = apply_top_p(logits, p, candidates=logits.shape[-1])
    assert torch.equal(fast.isinf(), full.isinf())
    assert torch.equal(fast[~fast.isinf()], logits[~full.isinf()])
    assert (~fast.isinf()).sum(-1).min() >= 1
