"""Speculative decoding (issue 16): greedy output with speculation is token-identical to greedy without
(fp32; batch 1 and 8; chunked prefill, prefix caching, swap and recompute preemption) for the n-gram
proposer, the target as its own draft and a proposer that guesses at random; random sampling keeps
the target's distribution (chi-square over seeded draws, and the test is shown to catch a wrong
residual); every block, the draft's too, goes back to its pool.

The model: a tiny random Llama with a 64-token vocabulary, so that greedy text repeats itself often
enough for n-gram proposals to be accepted now and then (and rejected more often), and a chi-square
over the vocabulary needs only a few thousand draws.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_config
from pagedcore import LLM, SamplingParams
from pagedcore.config import EngineConfig
from pagedcore.metrics import EngineMetrics
from pagedcore.sampler import SamplingBatch
from pagedcore.spec_decode.cost_model import SpecPolicy, StepCosts
from pagedcore.spec_decode.ngram_proposer import NgramProposer
from pagedcore.spec_decode.rejection_sampler import RejectionSampler

VOCAB = 64
ALWAYS = 1000  # disable_by_batch_size for tests: speculate at every batch size, no start-up measurement


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    d = tmp_path_factory.mktemp("tiny-vocab64")
    model.save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    return d


def repetitive_prompts(n: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """A short random phrase repeated, after an optional prefix all prompts share."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 8))]
        prompts.append(prefix + (phrase * 10)[:rng.randint(12, 40)])
    return prompts


class RandomProposer:
    """Guesses uniformly over the vocabulary: almost every draft is rejected."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def propose(self, seqs, num_tokens):
        return [[self.rng.randrange(VOCAB) for _ in range(k)] for k in num_tokens]


SPEC = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    "self": {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 2},  # all of the tiny model's
    "random": {"method": "ngram", "num_speculative_tokens": 3},  # its proposer replaced by RandomProposer
}
SETTINGS = {
    "batch1": dict(num_prompts=1, seed=3),  # a prompt whose greedy text repeats itself a little
    "batch8": dict(num_prompts=8),
    "chunked": dict(num_prompts=8, max_num_batched_tokens=12),  # drafts trimmed to the budget too
    "prefix-recompute": dict(num_prompts=8, shared_prefix=16, num_kv_blocks=24, preemption_mode="recompute"),
    "prefix-swap": dict(num_prompts=8, shared_prefix=16, num_kv_blocks=24, preemption_mode="swap",
                        num_cpu_blocks=64),
}


def make_llm(model_dir, spec=None, **settings):
    settings.setdefault("num_kv_blocks", 256)
    llm = LLM(str(model_dir), dtype="float32", block_size=4, speculative_config=spec, **settings)
    return llm


def generate(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    draft_kv = getattr(getattr(llm.engine.spec, "proposer", None), "kv", None)
    if draft_kv is not None:
        assert draft_kv.num_free_blocks == draft_kv.num_blocks, "draft blocks leaked"
        assert not llm.engine.spec.proposer.shadows
    return outs


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy without speculation, per setting (its own engine settings: preemption changes nothing)."""
    cache = {}

    def get(name, params):
        key = (name, repr(params))
        if key not in cache:
            s = dict(SETTINGS[name])
            prompts = repetitive_prompts(s.pop("num_prompts"), s.pop("seed", 0), s.pop("shared_prefix", 0))
            llm = make_llm(model_dir, **s)
            cache[key] = [o.outputs for o in generate(llm, prompts, params)]
        return cache[key]

    return get


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("proposer", list(SPEC))
def test_greedy_with_speculation_is_token_identical(proposer, setting, model_dir, reference):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    s = dict(SETTINGS[setting])
    prompts = repetitive_prompts(s.pop("num_prompts"), s.pop("seed", 0), s.pop("shared_prefix", 0))
    llm = make_llm(model_dir, {**SPEC[proposer], "disable_by_batch_size": ALWAYS}, **s)
    if proposer == "random":
        llm.engine.spec.proposer = RandomProposer()
    outs = generate(llm, prompts, params)
    ref = reference(setting, params)
    for got, want in zip(outs, ref):
        assert got.outputs[0].token_ids == want[0].token_ids
        # the logprobs of every emitted token are the target's own, from the verification rows
        for g, w in zip(got.outputs[0].logprobs, want[0].logprobs):
            assert g.keys() == w.keys()
            assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in g)
    st = llm.engine.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_draft_tokens >= st.spec_num_drafts, "no proposals: the path never ran"
    if proposer == "ngram":
        assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    elif proposer == "self":
        assert st.spec_acceptance_rate == 1.0  # k drafts and the bonus, every time k was not cut short
        assert st.spec_mean_acceptance_length == pytest.approx(1 + st.spec_num_draft_tokens / st.spec_num_drafts)
    else:
        assert st.spec_acceptance_rate < 0.1
    if "prefix" in setting:
        assert llm.engine.scheduler.num_preemptions > 0, "the KV budget did not force preemption"
        assert llm.engine.kv.num_prefix_hit_tokens > 0
    if setting == "prefix-swap":
        assert llm.engine.scheduler.num_swap_outs > 0


def test_draft_model_from_a_directory_n_stop_and_beams(model_dir, reference):
    """A separate draft model (here the target's own weights, loaded again: acceptance 1); n > 1,
    stop tokens (the accepted drafts after a stop are dropped) and a beam-search request (which
    speculates not at all) beside it."""
    prompts = repetitive_prompts(4, seed=3)
    base = make_llm(model_dir)
    spec = make_llm(model_dir, {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 4,
                                "disable_by_batch_size": ALWAYS})
    ref = generate(base, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stops = [r.outputs[0].token_ids[17] for r in ref]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stops[0]]),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, use_beam_search=True, n=2),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stops[3]])]
    want = generate(base, prompts, params)
    got = generate(spec, prompts, params)
    for g, w in zip(got, want):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert [o.finish_reason for o in g.outputs] == [o.finish_reason for o in w.outputs]
    assert got[0].outputs[0].finish_reason == "stop" and len(got[0].outputs[0].token_ids) <= 18
    st = spec.engine.stats()
    assert st.spec_num_drafts > 0 and st.spec_acceptance_rate == 1.0


def test_stats_and_metrics_report_acceptance(model_dir):
    llm = make_llm(model_dir, {**SPEC["ngram"], "disable_by_batch_size": ALWAYS})
    generate(llm, repetitive_prompts(4), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    st, m = llm.engine.stats(), EngineMetrics.from_engine(llm.engine)
    assert m.spec_decode_num_drafts == st.spec_num_drafts > 0
    assert m.spec_decode_num_accepted_tokens == st.spec_num_accepted_tokens
    assert m.spec_decode_acceptance_rate == pytest.approx(st.spec_num_accepted_tokens / st.spec_num_draft_tokens)
    assert m.spec_decode_mean_acceptance_length == pytest.approx(1 + st.spec_num_accepted_tokens / st.spec_num_drafts)
    assert st.spec_max_batch_size == ALWAYS - 1
    off = make_llm(model_dir)
    assert EngineMetrics.from_engine(off.engine).spec_decode_num_drafts == 0 and off.engine.stats().spec_num_drafts == 0


# ---- random sampling keeps the target's distribution ---------------------------------------------------
def chi2_pvalue(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square (homogeneity) over token ids; cells expected < 5 pooled into one."""
    ta, tb = torch.bincount(torch.tensor(a), minlength=VOCAB).double(), torch.bincount(torch.tensor(b), minlength=VOCAB).double()
    total = ta + tb
    na, nb = ta.sum(), tb.sum()
    small = total * min(na, nb) / (na + nb) < 5
    if small.any():
        ta = torch.cat([ta[~small], ta[small].sum(0, keepdim=True)])
        tb = torch.cat([tb[~small], tb[small].sum(0, keepdim=True)])
        total = ta + tb
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    keep = total > 0
    stat = (((ta - ea) ** 2 / ea)[keep].sum() + ((tb - eb) ** 2 / eb)[keep].sum()).item()
    df = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)).item()


# Every sampling parameter that changes p: temperature, top-k/p, min-p and penalties (which count the
# drafts before each verification row as output tokens).
RANDOM_PARAMS = dict(temperature=0.9, top_k=24, top_p=0.95, min_p=0.02, repetition_penalty=1.3,
                     presence_penalty=0.4, frequency_penalty=0.2, max_tokens=4, ignore_eos=True)
NUM_DRAWS = 2000


def sampled_tokens(llm, prompt) -> list[list[int]]:
    params = [SamplingParams(seed=i, **RANDOM_PARAMS) for i in range(NUM_DRAWS)]
    return [o.outputs[0].token_ids for o in generate(llm, [prompt] * NUM_DRAWS, params)]


@pytest.fixture(scope="module")
def random_reference(model_dir):
    prompt = repetitive_prompts(1, seed=5)[0]
    return prompt, sampled_tokens(make_llm(model_dir, max_num_seqs=256, num_kv_blocks=4096), prompt)


def speculative_draws(model_dir, prompt, proposer):
    llm = make_llm(model_dir, {**SPEC[proposer], "num_speculative_tokens": 2, "disable_by_batch_size": ALWAYS},
                   max_num_seqs=256, num_kv_blocks=4096)
    if proposer == "random":
        llm.engine.spec.proposer = RandomProposer()
    return llm, sampled_tokens(llm, prompt)


@pytest.mark.parametrize("proposer", ["self", "random"])
def test_random_sampling_keeps_the_target_distribution(proposer, model_dir, random_reference):
    """Tokens 2-4 come out of verification (token 1 from the prefill); each position's marginal over
    2000 seeded draws matches the one without speculation."""
    prompt, ref = random_reference
    llm, got = speculative_draws(model_dir, prompt, proposer)
    st = llm.engine.stats()
    assert st.spec_num_drafts > 0 and 0 < st.spec_num_draft_tokens
    if proposer == "self":  # greedy drafts under sampling: some accepted, some rejected
        assert 0.1 < st.spec_acceptance_rate < 0.95
    for pos in (1, 2, 3):
        p = chi2_pvalue([t[pos] for t in ref], [t[pos] for t in got])
        assert p > 1e-3, f"position {pos}: p-value {p:.2e}"


def test_the_chi_square_catches_a_wrong_residual(model_dir, random_reference, monkeypatch):
    """Resampling from p itself instead of the residual p - q over-weights the draft: caught."""
    prompt, ref = random_reference
    monkeypatch.setattr(RejectionSampler, "residual", staticmethod(lambda probs, drafts, draft_probs: probs))
    _, got = speculative_draws(model_dir, prompt, "self")
    assert min(chi2_pvalue([t[pos] for t in ref], [t[pos] for t in got]) for pos in (1, 2, 3)) < 1e-6


@pytest.mark.parametrize("point_mass", [True, False])
def test_rejection_sampler_draws_exactly_from_p(point_mass):
    """One draft per sequence from q, judged against p: the first emitted token is distributed as p,
    for a point-mass q (n-gram, greedy drafts) and a full draft distribution."""
    g = torch.Generator().manual_seed(0)
    V, B = 8, 20000
    p_logits = torch.randn(V, generator=g) * 1.5
    q = torch.softmax(torch.randn(V, generator=g), -1)
    logits = p_logits.repeat(2 * B, 1)  # each sequence: the draft's row and the bonus row
    drafts = torch.multinomial(q, B, replacement=True, generator=g)
    if point_mass:
        draft_probs = None
    else:
        draft_probs = q.repeat(2 * B, 1)
    params = [SamplingParams(temperature=1.0)] * (2 * B)
    batch = SamplingBatch.build(params, [[]] * (2 * B), [[]] * (2 * B), [None] * (2 * B), [], V)
    torch.manual_seed(1)
    out = RejectionSampler()(logits, [[d] for d in drafts.tolist()], batch, draft_probs)
    first = torch.tensor([t[0] for t in out.token_ids])
    freq = torch.bincount(first, minlength=V).double() / B
    p = torch.softmax(p_logits, -1).double()
    # 5 standard errors per cell
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / B).sqrt() + 1e-9).all(), (freq, p)
    accepted = torch.tensor(out.num_accepted).double().mean()
    want = (p * q.double()).sum() if point_mass else torch.minimum(p, q.double()).sum()
    assert abs(accepted - want) < 0.02, (accepted, want)  # the acceptance speculative sampling promises


def test_greedy_rejection_emits_the_argmax_at_the_first_mismatch_and_a_bonus():
    V = 10
    logits = torch.full((6, V), -5.0)
    for row, best in enumerate([3, 4, 5, 6, 7, 8]):
        logits[row, best] = 5.0
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 6, [[]] * 6, [[]] * 6, [None] * 6, [], V)
    # sequence 1: drafts 3, 4 (both right) -> bonus 5; sequence 2: drafts 6, 0 (second wrong) -> 6, 7
    out = RejectionSampler()(logits, [[3, 4], [6, 0]], batch)
    assert out.token_ids == [[3, 4, 5], [6, 7]] and out.num_accepted == [2, 1]


# ---- proposers, config, policy ------------------------------------------------------------------------
def test_ngram_lookup_takes_the_longest_latest_match():
    ng = NgramProposer(1, 3)
    assert ng.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == [7, 8, 5]  # no "5 2 3" before; latest "2 3"
    assert ng.lookup([4, 1, 2, 3, 8, 9, 2, 3, 7, 1, 2, 3], 2) == [8, 9]  # "1 2 3" beats the later "2 3"
    assert ng.lookup([5, 6, 7, 5, 6, 7, 5, 6], 4) == [7, 5, 6]  # the latest "5 6", up to the end
    assert ng.lookup([1, 2, 3, 4], 2) == []
    # int32 bytes of 256, 0 hold those of 1 at a byte offset: matches must start on a token
    assert ng.lookup([256, 0, 5, 1], 2) == []
    assert ng.lookup([1, 7, 256, 0, 5, 1], 2) == [7, 256]
    assert NgramProposer(2, 3).lookup([4, 9, 4], 2) == []  # 1-grams not looked up


@pytest.mark.parametrize("bad, match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_bad_speculative_config_is_a_clear_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=bad)


def test_a_draft_with_another_vocabulary_is_refused(model_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="vocabulary size differs"):
        make_llm(model_dir, {"method": "draft_model", "model": str(tiny_model_dir("llama")), "num_speculative_tokens": 2})


def test_policy_speculates_only_where_the_measured_cost_pays():
    costs = StepCosts([1, 4, 16], [0.010, 0.012, 0.020], [0.011, 0.024, 0.080])  # ratios 1.1, 2, 4 (x 1.1 margin)
    policy = SpecPolicy(4, None, costs)  # optimistic start: 3 tokens per verified sequence
    assert policy.should_speculate(1) and policy.should_speculate(3) and not policy.should_speculate(16)
    assert not policy.should_speculate(17)  # past the table
    assert policy.max_batch_size() == 4
    for _ in range(100):  # drafts almost never accepted: only batch 1 still pays, then none
        policy.observe(10, 10)
    assert policy.max_batch_size() == 0
    probes = sum(policy.should_speculate(1) for _ in range(64))
    assert probes == 64 // SpecPolicy.PROBE_EVERY  # it keeps probing now and then
    assert SpecPolicy(4, 8, None).should_speculate(7) and not SpecPolicy(4, 8, None).should_speculate(8)


def test_measured_threshold_at_start_up(model_dir):
    llm = make_llm(model_dir, {**SPEC["ngram"]}, max_num_seqs=8)
    costs = llm.engine.spec.costs
    assert costs.batch_sizes and costs.batch_sizes[0] == 1 and max(costs.batch_sizes) <= 8
    assert all(d > 0 and v > 0 for d, v in zip(costs.decode_s, costs.verify_s))
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks  # the dummy sequences gave every block back
    out = generate(llm, repetitive_prompts(2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.slow
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
    {"method": "layer_skip", "num_layers": 10, "num_speculative_tokens": 3},
])
def test_smollm2_speculation_on_input_grounded_prompts(spec, smollm2_dir):
    """The real model copying its input: same greedy tokens in fp32, and most drafts accepted."""
    from pagedcore.bench.spec import local_passages, prompt_sets

    base = LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=256)
    prompts = prompt_sets(base.get_tokenizer())["grounded"][:2]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = [o.outputs[0].token_ids for o in generate(base, prompts, params)]
    llm = LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=256,
              speculative_config={**spec, "disable_by_batch_size": ALWAYS})
    got = [o.outputs[0].token_ids for o in generate(llm, prompts, params)]
    assert got == want and local_passages()
    st = llm.engine.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_accepted_tokens > 0
    if spec["method"] == "ngram":
        assert st.spec_acceptance_rate > 0.5
