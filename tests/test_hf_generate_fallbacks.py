"""pagedcore.adapters.hf: unpatching gives the model back bit for bit, and what the engine does not run falls
back to transformers' generate() with one warning and the same output."""

from __future__ import annotations

import warnings

import pytest
import torch
# Fixtures too (pytest finds them imported): names the tests take as arguments.
from hf_generate_helpers import (HF_GENERATE, TINY_SETTINGS, RecordingStreamer, greedy_kw,  # noqa: F401
                                 no_silent_fallback, pad_batch, patched_tiny, tiny_llama, tiny_prompts)
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation import GenerationMixin

from pagedcore.adapters.hf import FallbackWarning, get_engine, patch, patch_all, patched, unpatch, unpatch_all
from pagedcore.kernels import cpu_ext


def test_unpatch_restores_transformers_generate(tiny_llama, tiny_prompts):
    model = tiny_llama
    ids, mask = pad_batch(tiny_prompts, "left")
    kw = greedy_kw(max_new_tokens=6, pad_token_id=0)
    original_method, original_attn = model.generate, model.config._attn_implementation
    before = model.generate(ids, attention_mask=mask, **kw)

    patch(model, **TINY_SETTINGS)
    assert model.generate != original_method
    assert torch.equal(model.generate(ids, attention_mask=mask, **kw), before)
    assert get_engine(model) is not None and model.config._attn_implementation == original_attn
    assert torch.equal(HF_GENERATE(model, ids, attention_mask=mask, **kw), before)  # original still works
    unpatch(model)
    assert "generate" not in model.__dict__ and model.generate == original_method
    assert model.generate.__func__ is type(model).generate
    assert model.config._attn_implementation == original_attn and get_engine(model) is None
    assert torch.equal(model.generate(ids, attention_mask=mask, **kw), before)

    with patched(model, **TINY_SETTINGS):
        assert model.generate != original_method
        assert torch.equal(model.generate(ids, attention_mask=mask, **kw), before)
    assert model.generate == original_method and model.config._attn_implementation == original_attn


def pagedcore_traces(model) -> list[str]:
    """Whatever of pagedcore is left on a model's modules: instance forwards, pagedcore attributes or classes."""
    found = []
    for name, m in model.named_modules():
        found += [f"{name}.{a}" for a in vars(m) if a == "forward" or "pagedcore" in a]
        found += [f"{name}: {type(m).__name__}"] if type(m).__module__.startswith("pagedcore") else []
    return found


@pytest.mark.parametrize("settings", [{}, {"quantization": "int4"}], ids=["default", "int4"])
def test_unpatch_gives_the_model_back_bit_for_bit(settings, tiny_model_dir, tiny_prompts, smollm2_tokenizer):
    load = lambda: AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")), dtype=torch.float32).eval()
    model, untouched = load(), load()
    ids, mask = pad_batch(tiny_prompts, "left")
    kw = greedy_kw(max_new_tokens=6, pad_token_id=0)

    patch(model, **TINY_SETTINGS, **settings)
    model.generate(ids, attention_mask=mask, **kw)
    # stop strings need a tokenizer: the engine is remade, installing itself a second time
    model.generate(ids, attention_mask=mask, stop_strings=["zqxj"], tokenizer=smollm2_tokenizer, **kw)
    assert pagedcore_traces(model) or cpu_ext.load() is None  # the engine did change the model
    unpatch(model)

    assert pagedcore_traces(model) == []
    assert [type(m) for m in model.modules()] == [type(m) for m in untouched.modules()]
    assert model.config._attn_implementation == untouched.config._attn_implementation
    state, ref_state = model.state_dict(), untouched.state_dict()
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)
    with torch.inference_mode():
        assert torch.equal(model(ids, attention_mask=mask).logits, untouched(ids, attention_mask=mask).logits)
    assert torch.equal(model.generate(ids, attention_mask=mask, **kw), untouched.generate(ids, attention_mask=mask, **kw))


def test_patch_all_and_unpatch_all(tiny_model_dir, tiny_prompts):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")), dtype=torch.float32).eval()
    ids, mask = pad_batch(tiny_prompts[:2], "left")
    kw = greedy_kw(max_new_tokens=5, pad_token_id=0)
    before = model.generate(ids, attention_mask=mask, **kw)
    patch_all(**TINY_SETTINGS)
    try:
        assert torch.equal(model.generate(ids, attention_mask=mask, **kw), before)
        assert get_engine(model) is not None
    finally:
        unpatch_all()
    assert GenerationMixin.generate is HF_GENERATE and get_engine(model) is None
    assert torch.equal(model.generate(ids, attention_mask=mask, **kw), before)


class BanToken(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores[:, 100] = -float("inf")
        return scores


@pytest.mark.parametrize("option", ["no_repeat_ngram_size", "logits_processor", "prefix_allowed_tokens_fn",
                                    "beam_sample", "output_attentions", "streamer_batch"])
def test_unsupported_option_falls_back_with_one_warning(option, patched_tiny, tiny_prompts):
    model = patched_tiny
    ids, mask = pad_batch(tiny_prompts[:2], "left")
    kw = greedy_kw(max_new_tokens=5, pad_token_id=0)
    kw.update({
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "logits_processor": dict(logits_processor=LogitsProcessorList([BanToken()])),
        "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=lambda batch, ids: list(range(50, 5000))),
        "beam_sample": dict(do_sample=True, num_beams=2, top_k=1),
        "output_attentions": dict(return_dict_in_generate=True, output_attentions=True),
        "streamer_batch": dict(streamer=RecordingStreamer()),
    }[option])
    torch.manual_seed(0)
    expected = HF_GENERATE(model, ids, attention_mask=mask, **kw)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model.generate(ids, attention_mask=mask, **kw)
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]
    assert fallbacks[0].filename == __file__  # points at the caller's line
    expected = expected.sequences if option == "output_attentions" else expected
    got = got.sequences if option == "output_attentions" else got
    assert torch.equal(got, expected)


def test_encoder_decoder_model_falls_back():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_heads=2, decoder_start_token_id=0)).eval()
    ids = torch.tensor([[5, 6, 7, 1]])
    expected = model.generate(ids, max_new_tokens=4)
    with patched(model), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model.generate(ids, max_new_tokens=4)
    assert sum(issubclass(w.category, FallbackWarning) for w in caught) == 1
    assert torch.equal(got, expected)
