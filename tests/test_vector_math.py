"""The engine settles MKL's vector math with one serial call before anything of its own calls into it
(pagedcore/vector_math.py): the decode stack's RoPE table, made once, kept a first call's ~12-bit cos for the
engine's life. conftest.py settles it for the whole suite too, so these tests check the engine's own call."""

from __future__ import annotations

import torch

from pagedcore import LLM, SamplingParams, decode_stack, vector_math


def test_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(vector_math, "_done", False)
    monkeypatch.setattr(torch.Tensor, "cos", lambda self: calls.append(self.numel()) or torch.ones_like(self))
    vector_math.warm_up()
    vector_math.warm_up()
    assert calls == [1] and vector_math._done


def test_engine_settles_it_before_its_rope_table(tiny_model_dir, monkeypatch):
    seen = []
    real = decode_stack.DecodeStack._rope_tables

    def rope_tables(self, dtype):
        seen.append(vector_math._done)
        return real(self, dtype)

    monkeypatch.setattr(vector_math, "_done", False)
    monkeypatch.setattr(decode_stack.DecodeStack, "_rope_tables", rope_tables)
    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", num_kv_blocks=16, decode_stack=True)
    assert llm.engine.runner.decode_stack is not None and seen and all(seen)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
