"""A request's greedy tokens and logprobs are the same bits whether it runs alone or beside others: every linear
computes each output as one chain over k whatever the row count, and decode attention splits a long sequence by
its own length only (kernels/csrc/cpu_decode_attention.cpp; before, its logprobs moved by ~3e-6 with the batch)."""

from __future__ import annotations

import pytest
import torch

from pagedcore import LLM, SamplingParams


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_request_alone_and_in_a_batch(ext, tiny_model_dir, dtype):
    llm = LLM(str(tiny_model_dir("llama")), dtype=dtype, enable_prefix_caching=False, num_kv_blocks=512)
    g = torch.Generator().manual_seed(1)
    # 300 + 12 positions: past the 256 at which a sequence's decode attention is split over threads
    prompts = [torch.randint(5, 40000, (n,), generator=g).tolist() for n in [300] + [200 + 9 * i for i in range(12)]]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
    batch = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == batch.token_ids
    got = [lp[t].logprob for t, lp in zip(batch.token_ids, batch.logprobs)]
    want = [lp[t].logprob for t, lp in zip(alone.token_ids, alone.logprobs)]
    assert got == want
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
