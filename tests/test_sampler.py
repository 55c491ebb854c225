"""Sampler tests: greedy, min_tokens, seeded draws, the sampled distribution, logprobs, finiteness.
The masks and penalties, each against a per-row reference: test_sampler_masks.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedcore.sampler as sampler_mod
from pagedcore.sampler import Sampler, SamplingBatch, make_generator
from pagedcore.sampling_params import SamplingParams
from sampler_helpers import build, random_logits

pytestmark = pytest.mark.usefixtures("sampler_path")  # every test on both paths (conftest.py)


# --------------------------------------------------------------------------- greedy, min_tokens


def test_greedy_equals_argmax_and_all_greedy_skips_random_work(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("all-greedy batch ran random-sampling work")

    for name in ("apply_top_k", "apply_top_p", "apply_min_p", "sample_from_probs", "exponential_race"):
        monkeypatch.setattr(sampler_mod, name, boom)
    monkeypatch.setattr(Sampler, "sample_random", staticmethod(boom))
    logits = random_logits(0, 7, 100)
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1, ignore_eos=i % 2 == 0) for i in range(7)]
    out = Sampler()(logits, build(params, 100))
    assert torch.equal(out.sampled_token_ids, torch.argmax(logits, dim=-1))
    assert out.topk_logprobs is None and out.topk_token_ids is None


def test_greedy_rows_in_mixed_batch_are_argmax():
    logits = random_logits(3, 6, 30)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=4) for i in range(6)]
    out = Sampler()(logits, build(params, 30))
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(-1))


def test_greedy_accepts_low_precision_logits():
    logits = random_logits(5, 4, 64).to(torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=3)] * 4, 64))
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.sampled_logprobs.dtype == torch.float32 and out.topk_logprobs.dtype == torch.float32


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_ids(temperature):
    V, eos, stop = 20, 7, 11
    logits = torch.zeros(4, V)
    logits[:, eos] = 50.0  # overwhelmingly likely
    logits[:, stop] = 30.0
    logits[:, 3] = 20.0  # next best once EOS and the stop id are masked
    p = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[stop], seed=1)
    outputs = [[], [1], [1, 2], [1, 2, 3]]
    sampler = Sampler()
    for _ in range(20 if temperature else 1):
        got = sampler(logits, build([p] * 4, V, outputs=outputs, eos=[eos])).sampled_token_ids.tolist()
        assert got[:3] == [3, 3, 3]  # under min_tokens: neither EOS nor the stop id
        assert got[3] == eos  # reached: EOS allowed again
    # min_tokens masks regardless of ignore_eos; otherwise ignore_eos leaves greedy alone.
    one = logits[:1]
    p2 = SamplingParams(temperature=0.0, min_tokens=1, ignore_eos=True)
    assert sampler(one, build([p2], V, eos=[eos])).sampled_token_ids.tolist() == [stop]  # p2 has no stop ids
    p3 = SamplingParams(temperature=0.0, ignore_eos=True)
    assert sampler(one, build([p3], V, eos=[eos])).sampled_token_ids.tolist() == [eos]
    # Logprobs stay those of the raw distribution even for masked tokens.
    out = sampler(one, build([SamplingParams(temperature=0.0, min_tokens=2, logprobs=1)], V, eos=[eos]))
    assert out.topk_token_ids.tolist() == [[eos]]


# --------------------------------------------------------------------------- seeded sampling


def _run_steps(seed: int, row: int, batch_size: int, steps: int = 20) -> list[int]:
    """Generate `steps` tokens for the seeded request at `row`; other rows are a mix."""
    V = 50
    target = SamplingParams(seed=seed, temperature=0.8, top_p=0.9)
    others = [
        SamplingParams(seed=1234, temperature=1.0, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.05),
        SamplingParams(seed=99, temperature=0.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.9, presence_penalty=1.0, logprobs=2),
        SamplingParams(temperature=0.0, seed=5),  # greedy with a seed: generator must not move
        SamplingParams(temperature=1.0),
    ]
    params = [others[(i + row) % len(others)] for i in range(batch_size)]
    params[row] = target
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    outputs: list[list[int]] = [[] for _ in range(batch_size)]
    prompts = [[1, 2, 3]] * batch_size
    table = torch.randn(steps, V, generator=torch.Generator().manual_seed(42)) * 2
    sampler = Sampler()
    for t in range(steps):
        logits = torch.randn(batch_size, V) * 2  # whatever the other rows see
        logits[row] = table[t]
        batch = SamplingBatch.build(params, prompts, outputs, gens, [0], V, "cpu")
        tokens = sampler(logits, batch).sampled_token_ids.tolist()
        for i, tok in enumerate(tokens):
            outputs[i].append(tok)
    return outputs[row]


def test_seeded_sampling_is_independent_of_batch_composition():
    torch.manual_seed(0)
    alone = _run_steps(seed=7, row=0, batch_size=1)
    torch.manual_seed(1)
    first_of_five = _run_steps(seed=7, row=0, batch_size=5)
    torch.manual_seed(2)
    fourth_of_eight = _run_steps(seed=7, row=3, batch_size=8)
    assert alone == first_of_five == fourth_of_eight
    assert len(set(alone)) > 3  # it really sampled
    assert _run_steps(seed=8, row=0, batch_size=1) != alone


def test_greedy_row_does_not_advance_its_generator():
    g_greedy, g_random = make_generator(3), make_generator(3)
    before = g_greedy.get_state().clone()
    params = [SamplingParams(temperature=0.0, seed=3), SamplingParams(temperature=1.0, seed=3)]
    Sampler()(random_logits(0, 2, 16), build(params, 16, generators=[g_greedy, g_random]))
    assert torch.equal(g_greedy.get_state(), before)
    assert not torch.equal(g_random.get_state(), before)


# --------------------------------------------------------------------------- distribution


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    n = tokens.numel()
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * n
    nz = expected > 0
    assert (observed[~nz] == 0).all(), "sampled a token with probability 0"
    return float(((observed[nz] - expected[nz]) ** 2 / expected[nz]).sum())


# chi-square critical values at p = 0.001 by degrees of freedom.
_CHI2_999 = {1: 10.83, 3: 16.27, 5: 20.52}


def test_unseeded_sampling_matches_softmax():
    torch.manual_seed(123)
    V, N = 6, 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0]]).expand(N, V)
    out = Sampler()(logits, build([SamplingParams(temperature=1.0)] * N, V))
    assert _chi_square(out.sampled_token_ids, logits[0].softmax(-1)) < _CHI2_999[5]


def test_seeded_rows_sampling_matches_softmax():
    V, N = 4, 4000
    logits = torch.tensor([[0.3, -0.2, 1.0, 0.0]]).expand(N, V)
    gens = [make_generator(s) for s in range(N)]
    out = Sampler()(logits, build([SamplingParams(temperature=1.0, seed=0)] * N, V, generators=gens))
    assert _chi_square(out.sampled_token_ids, logits[0].softmax(-1)) < _CHI2_999[3]


def test_temperature_and_top_k_distribution():
    torch.manual_seed(321)
    V, N = 6, 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0]]).expand(N, V)
    out = Sampler()(logits, build([SamplingParams(temperature=2.0, top_k=2)] * N, V))
    expected = torch.zeros(V)
    expected[[4, 0]] = (logits[0, [4, 0]] / 2.0).softmax(-1)
    assert _chi_square(out.sampled_token_ids, expected) < _CHI2_999[1]


# --------------------------------------------------------------------------- logprobs, finiteness


def test_logprobs_are_raw_and_sorted():
    V = 40
    logits = random_logits(9, 5, V)
    params = [
        SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.5, logprobs=4),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
        SamplingParams(temperature=1.2, min_p=0.3, logprobs=2),
    ]
    out = Sampler()(logits, build(params, V, prompts=[[1, 2]] * 5, outputs=[[3]] * 5))
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.topk_logprobs.shape == (5, 4) and out.topk_token_ids.shape == (5, 4)
    torch.testing.assert_close(out.sampled_logprobs, raw.gather(1, out.sampled_token_ids[:, None]).squeeze(1))
    ref = torch.topk(raw, 4, dim=-1)
    torch.testing.assert_close(out.topk_logprobs, ref.values)
    assert torch.equal(out.topk_token_ids, ref.indices)
    assert (out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:]).all()


def test_sampled_logprobs_without_logprobs_requested():
    logits = random_logits(10, 6, 33) * 5
    params = [SamplingParams(temperature=t, top_k=k) for t, k in [(0, 0), (1, 3), (0.5, 0)] * 2]
    out = Sampler()(logits, build(params, 33))
    assert out.topk_logprobs is None
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.sampled_logprobs, raw.gather(1, out.sampled_token_ids[:, None]).squeeze(1))


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    B=st.integers(1, 6),
    V=st.integers(2, 48),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e3]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_outputs_finite_and_in_range(data, B, V, seed, scale, dtype):
    logits = (random_logits(seed, B, V) * scale).to(dtype)
    param = st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.0, 1e-5, 0.3, 1.0, 2.0]),
        top_k=st.integers(0, V + 2),
        top_p=st.sampled_from([1.0, 0.9, 0.3, 1e-6]),
        min_p=st.sampled_from([0.0, 0.1, 1.0]),
        repetition_penalty=st.sampled_from([1.0, 1.2, 0.8]),
        presence_penalty=st.sampled_from([0.0, 2.0, -2.0]),
        frequency_penalty=st.sampled_from([0.0, 1.0]),
        seed=st.none() | st.integers(0, 100),
        min_tokens=st.integers(0, 3),
        stop_token_ids=st.lists(st.integers(0, V - 1), max_size=2),
        logprobs=st.none() | st.integers(0, 5),
    )
    params = data.draw(st.lists(param, min_size=B, max_size=B))
    ids = st.lists(st.integers(0, V - 1), max_size=6)
    prompts = data.draw(st.lists(ids, min_size=B, max_size=B))
    outputs = data.draw(st.lists(ids, min_size=B, max_size=B))
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    batch = SamplingBatch.build(params, prompts, outputs, gens, [V - 1], V, "cpu")
    out = Sampler()(logits, batch)
    tokens = out.sampled_token_ids
    assert tokens.dtype == torch.long and tokens.shape == (B,)
    assert ((tokens >= 0) & (tokens < V)).all()
    assert torch.isfinite(out.sampled_logprobs).all()
    for i, p in enumerate(params):  # min_tokens held even under extreme logits
        if len(outputs[i]) < p.min_tokens:
            assert int(tokens[i]) not in {V - 1, *p.stop_token_ids} or {V - 1, *p.stop_token_ids} >= set(range(V))
    if batch.max_num_logprobs is not None:
        assert torch.isfinite(out.topk_logprobs).all()


def test_greedy_nan_row_falls_back_to_torch_semantics():
    logits = random_logits(12, 3, 50)
    logits[1, 20] = float("nan")
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 3, 50))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))  # torch.argmax picks the NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_grammar_rows_take_the_fast_path_with_raw_logprobs(monkeypatch, sampler_path, dtype):
    """A bitmask on an all-greedy batch: argmax over the allowed tokens, the model's own logprob, and the
    same answer as the torch path (process_logits + argmax), without running it."""
    V, B = 1000, 5
    logits = random_logits(21, B, V).to(dtype)
    g = torch.Generator().manual_seed(5)
    allowed = torch.rand(B, V, generator=g) < 0.05
    allowed[:, 7] = True
    bits = torch.zeros(B, (V + 31) // 32 * 32, dtype=torch.int64)
    bits[:, :V] = allowed.long()
    mask = (bits.view(B, -1, 32) << torch.arange(32)).sum(-1)
    mask = torch.where(mask >= 2 ** 31, mask - 2 ** 32, mask).to(torch.int32)
    rows = [0, 2, 3]
    mask[[1, 4]] = -1  # unconstrained rows: every bit set
    batch = build([SamplingParams(temperature=0.0)] * B, V)
    batch.token_bitmask = (mask, rows)
    want = logits.float().masked_fill(~allowed, float("-inf"))
    want[[1, 4]] = logits.float()[[1, 4]]
    if sampler_path == "cpu-ext":
        monkeypatch.setattr(Sampler, "process_logits", staticmethod(lambda *a: pytest.fail("took the torch path")))
    out = Sampler()(logits, batch)
    assert torch.equal(out.sampled_token_ids, want.argmax(-1))
    raw = torch.log_softmax(logits.float(), -1).gather(1, out.sampled_token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.sampled_logprobs, raw, rtol=1e-5, atol=1e-5)
