"""Packed weights moved into one buffer of 2 MiB transparent huge pages (pagedcore/huge_pages.py)."""

from __future__ import annotations

import pytest
import torch

from pagedcore import LLM, SamplingParams, huge_pages


def test_buffer_is_2mib_aligned_and_usable(ext):
    buf = ext.huge_page_buffer(5 << 20)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 << 20 and buf.data_ptr() % (2 << 20) == 0
    buf.fill_(7)
    assert int(buf[-1]) == 7 and int(buf.sum()) == 7 * (5 << 20)
    with pytest.raises(RuntimeError, match="positive"):
        ext.huge_page_buffer(0)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_every_packed_weight_moves_and_the_tokens_stay(ext, tiny_model_dir, monkeypatch, quantization):
    """With the size floor lowered for a tiny model: every packed tensor (fused weights, their members' views,
    int4 codes and scales) ends in one storage at the buffer, and greedy tokens and logprobs are those of the
    engine without it."""
    prompts = [[5 + i for i in range(n)] for n in (3, 20, 41)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    runs = {}
    for floor in (1 << 62, 0):
        monkeypatch.setattr(huge_pages, "MIN_BYTES", floor)
        llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_kv_blocks=64, quantization=quantization)
        tensors = huge_pages.packed_tensors(llm.engine.model)
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        assert len(tensors) >= 10
        if floor == 0:
            assert len(storages) == 1 and storages.pop() % (2 << 20) == 0
        else:
            assert len(storages) > 1
        runs[floor] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    for a, b in zip(*runs.values()):
        assert a.token_ids == b.token_ids
        assert [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)] == \
            [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_buffer_faulted_while_the_model_loads_is_the_one_filled(ext, tiny_model_dir, monkeypatch, dtype):
    """The engine starts faulting the buffer before it loads the model, from config.json's shapes: that estimate
    bounds the packed bytes from above (by little), and the weights land in that very buffer."""
    import json
    from pathlib import Path

    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    taken, take = [], huge_pages.Prefault.take

    def recording_take(self, nbytes):
        taken.append((self.nbytes, nbytes, take(self, nbytes)))
        return taken[-1][2]

    monkeypatch.setattr(huge_pages.Prefault, "take", recording_take)
    model = tiny_model_dir("llama")
    llm = LLM(str(model), dtype=dtype, num_kv_blocks=64)
    (estimated, total, buffer), = taken
    assert buffer is not None and estimated >= total
    element = 4 if dtype == "float32" else 2
    assert estimated == huge_pages.estimate_bytes(json.loads((Path(model) / "config.json").read_text()), element)
    assert estimated - total <= 64 * 64 * 16 * element  # fused groups' padding and alignment at most
    storages = {t.untyped_storage().data_ptr() for t in huge_pages.packed_tensors(llm.engine.model)}
    assert storages == {buffer.data_ptr()}
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
               .outputs[0].token_ids) == 4


def test_a_prefaulted_buffer_too_small_is_not_used(ext):
    pre = huge_pages.Prefault(ext, 3 << 20)
    assert pre.take(4 << 20) is None
    pre = huge_pages.Prefault(ext, 3 << 20)
    buf = pre.take(2 << 20)
    assert buf.numel() == 3 << 20 and buf.data_ptr() % (2 << 20) == 0
    assert pre.take(1) is None  # once


def test_a_prefaulted_buffer_far_larger_than_needed_is_not_kept(ext):
    """A model that packs fewer weights than its config's estimate gets an exact buffer, not one holding the
    surplus for the engine's life; a few MiB over (alignment, fused groups' padding) is kept."""
    pre = huge_pages.Prefault(ext, 24 << 20)
    assert pre.take(10 << 20) is None
    pre = huge_pages.Prefault(ext, 24 << 20)
    assert pre.take(21 << 20).numel() == 24 << 20


def test_estimates_only_the_model_types_it_knows():
    assert huge_pages.estimate_bytes({"model_type": "gpt2", "hidden_size": 8}, 2) is None


def test_adopt_moves_whole_tensors_in_place_and_leaves_views(ext, monkeypatch):
    """adopt (the greedy head's codes and rows): each tensor that owns its storage keeps its object and values in one
    2 MiB-aligned buffer; a view into another tensor's storage, and anything under the size floor, stays put."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1 << 20)
    a = torch.arange(300_000, dtype=torch.int32)
    b = torch.randn(700, 576).to(torch.bfloat16)
    base = torch.randn(4, 100)
    view = base[1:]
    want_a, want_b, view_ptr = a.clone(), b.clone(), view.data_ptr()
    moved = huge_pages.adopt([a, b, view])
    assert moved >= a.nbytes + b.nbytes
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one buffer
    assert a.data_ptr() % (2 << 20) == 0 and b.data_ptr() % 64 == 0
    assert torch.equal(a, want_a) and torch.equal(b, want_b)
    assert view.data_ptr() == view_ptr
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1 << 30)
    small = torch.ones(10)
    ptr = small.data_ptr()
    assert huge_pages.adopt([small]) == 0 and small.data_ptr() == ptr
