"""The offline API's sampling: seeded requests reproducible alone and in any batch, n samples, best_of."""

from __future__ import annotations

from api_helpers import assert_pool_whole, gen1, greedy, sampled, tiny_prompts
from pagedcore import SamplingParams


# ---- sampling: seeds, n, best_of -------------------------------------------------------------
def test_seeded_sampling_is_reproducible_alone_and_in_any_batch(tiny):
    target = tiny_prompts(1, seed=42)[0]
    alone = gen1(tiny, target, sampled(1234)).token_ids
    again = gen1(tiny, target, sampled(1234)).token_ids
    assert alone == again

    others = tiny_prompts(4, seed=43)
    prompts = [others[0], target, others[1], others[2], others[3]]
    params = [sampled(1), sampled(1234), SamplingParams(temperature=1.0, max_tokens=20), greedy(10), sampled(7)]
    in_batch = tiny.generate(prompts, params, use_tqdm=False)[1].outputs[0].token_ids
    assert in_batch == alone

    other_seed = gen1(tiny, target, sampled(4321)).token_ids
    assert other_seed != alone
    assert_pool_whole(tiny.engine)


def test_unseeded_sampling_differs_between_runs(tiny):
    p = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    assert gen1(tiny, "Hi", p).token_ids != gen1(tiny, "Hi", p).token_ids
    assert_pool_whole(tiny.engine)


def test_n_returns_n_different_samples(tiny):
    (out,) = tiny.generate(["Tell me a story"], SamplingParams(temperature=0.8, top_p=0.9, n=3, max_tokens=12,
                                                               ignore_eos=True), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({c.text for c in out.outputs}) == 3
    assert_pool_whole(tiny.engine)


def test_seeded_n_is_reproducible(tiny):
    p = sampled(99, n=3)
    a = tiny.generate(["Tell me a story"], p, use_tqdm=False)[0]
    b = tiny.generate(["Tell me a story"], p, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    assert_pool_whole(tiny.engine)


def test_best_of_returns_the_n_with_highest_cumulative_logprob(tiny):
    prompt = tiny_prompts(1, seed=5)[0]
    # The i-th sample of a seeded request draws from its own stream, so n=4 shows all 4 candidates.
    (all4,) = tiny.generate([prompt], sampled(2024, n=4), use_tqdm=False)
    (best,) = tiny.generate([prompt], sampled(2024, n=2, best_of=4), use_tqdm=False)
    assert len(all4.outputs) == 4 and len(best.outputs) == 2
    assert [c.index for c in best.outputs] == [0, 1]
    ranked = sorted(all4.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert ranked[1].cumulative_logprob > ranked[2].cumulative_logprob  # a clear top 2
    assert {tuple(c.token_ids) for c in best.outputs} == {tuple(c.token_ids) for c in ranked[:2]}
    for c in best.outputs:
        assert c.cumulative_logprob >= ranked[1].cumulative_logprob - 1e-4
        assert c.finish_reason == "length"
    assert_pool_whole(tiny.engine)

