"""End to end: the engine's greedy output is identical with the Triton backend (run by Triton's
interpreter on this CPU) and the torch backend."""

from __future__ import annotations

import torch

from pagedcore import LLM, SamplingParams


def test_engine_greedy_identical_with_triton_and_torch_backends(tiny_model_dir):
    d = str(tiny_model_dir("llama"))
    g = torch.Generator().manual_seed(3)
    # Lengths cross block boundaries; a small budget chunks the longest prompt (prefill over a cached prefix).
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3, 9, 21)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(d, attention_backend=backend, num_kv_blocks=32, block_size=8, max_num_batched_tokens=16)
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.kv.num_free_blocks == 32
    assert outs["triton"] == outs["torch"]
    assert all(len(t) == 6 for t in outs["torch"])
