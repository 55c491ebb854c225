"""pagedcore.adapters.hf: a patched `model.generate()` returns what transformers' generate() returns
(fp32; a differing row must be a near-tie) and streams the same text (unpatching and fallbacks:
test_hf_generate_fallbacks.py)."""

from __future__ import annotations

import contextlib
import io
import json
import threading

import pytest
import torch
# Fixtures too (pytest finds them imported): names the tests take as arguments.
from hf_generate_helpers import (HF_GENERATE, TINY_SETTINGS, RecordingStreamer, greedy_kw,  # noqa: F401
                                 no_silent_fallback, pad_batch, patched_tiny, tiny_llama, tiny_prompts)
from transformers import AutoModelForCausalLM, GenerationConfig, TextIteratorStreamer, TextStreamer

from pagedcore import hookimpl
from pagedcore.adapters.hf import FallbackWarning, get_engine, patched
from pagedcore.attention.hf_glue import ATTN_IMPLEMENTATION

SMOL_SETTINGS = dict(num_kv_blocks=256, block_size=16)
NEAR_TIE = 1e-3


# ---- fixtures and helpers ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()



@pytest.fixture
def patched_smollm2(smollm2):
    with patched(smollm2, **SMOL_SETTINGS) as model:
        yield model



def reference(model, input_ids, mask, **kw):
    """transformers' generate() with the logits needed to judge near-ties."""
    return HF_GENERATE(model, input_ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **kw)


def assert_same_or_near_tie(ours: torch.Tensor, ref, width: int) -> None:
    """Rows equal token for token; a row may differ only where transformers' top two were within NEAR_TIE."""
    assert ours.shape[0] == ref.sequences.shape[0]
    assert torch.equal(ours[:, :width], ref.sequences[:, :width]), "the prompt part must be the input as given"
    ties = 0
    for r in range(ours.shape[0]):
        a, b = ref.sequences[r, width:].tolist(), ours[r, width:].tolist()
        t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if t is None:
            continue
        lp = torch.log_softmax(ref.logits[t][r].float(), -1)
        gap = abs(lp[a[t]] - lp[b[t]]).item()
        assert gap < NEAR_TIE, f"row {r} step {t}: transformers chose {a[t]}, pagedcore {b[t]}, gap {gap:.2e}"
        ties += 1
    if ties == 0:
        assert torch.equal(ours, ref.sequences)



# ---- greedy --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side,eos", [("left", None), ("right", "period")])
def test_smollm2_greedy_batch_equals_transformers(side, eos, patched_smollm2, chat_prompt_ids, smollm2_tokenizer):
    model, rows = patched_smollm2, chat_prompt_ids[:4]
    kw = greedy_kw(max_new_tokens=32)
    if eos == "period":  # rows stop at their first period: different lengths, padded after
        kw["eos_token_id"] = [2, smollm2_tokenizer.convert_tokens_to_ids(".")]
    ids, mask = pad_batch(rows, side, pad_id=2)
    # transformers continues right-padded rows after the pads (wrong positions, it warns); the same rows
    # left-padded are the correct reference, and pagedcore must return them laid out as given.
    ref_ids, ref_mask = pad_batch(rows, "left", pad_id=2)
    ref = reference(model, ref_ids, ref_mask, **kw)
    ours = model.generate(ids, attention_mask=mask, **kw)
    ref.sequences = torch.cat([ids, ref.sequences[:, ids.shape[1]:]], 1)
    assert_same_or_near_tie(ours, ref, ids.shape[1])
    if eos == "period":
        lengths = {(ours[r, ids.shape[1]:] != 2).sum().item() for r in range(len(rows))}
        assert len(lengths) > 1, "rows should stop at different steps"
    assert model.config._attn_implementation != ATTN_IMPLEMENTATION  # switched only during the call


@pytest.mark.parametrize("side", ["left", "right"])
def test_tiny_llama_greedy_with_eos_list_equals_transformers(side, patched_tiny, tiny_prompts):
    model = patched_tiny
    ids, mask = pad_batch(tiny_prompts, "left")
    free = reference(model, ids, mask, **greedy_kw(max_new_tokens=12, pad_token_id=0))
    # End row 0 at its 3rd token and row 2 at its 6th: an eos_token_id list that is not the model's.
    gen = free.sequences[:, ids.shape[1]:]
    eos = [int(gen[0, 2]), int(gen[2, 5])]
    kw = greedy_kw(max_new_tokens=12, pad_token_id=0, eos_token_id=eos)
    ref = reference(model, ids, mask, **kw)
    ids_side, mask_side = pad_batch(tiny_prompts, side)
    ours = model.generate(ids_side, attention_mask=mask_side, **kw)
    ref.sequences = torch.cat([ids_side, ref.sequences[:, ids.shape[1]:]], 1)
    assert_same_or_near_tie(ours, ref, ids.shape[1])
    assert ours.shape[1] - ids.shape[1] == 12 and (ours[0, ids.shape[1] + 3:] == 0).all()


@pytest.mark.parametrize("variant", ["max_length", "default_length", "min_new_tokens", "generation_config",
                                     "repetition_penalty", "input_ids_kwarg", "inferred_mask"])
def test_tiny_llama_generation_options_equal_transformers(variant, patched_tiny, tiny_prompts):
    model = patched_tiny
    ids, mask = pad_batch(tiny_prompts, "left")
    width = ids.shape[1]
    free = reference(model, ids, mask, **greedy_kw(max_new_tokens=10, pad_token_id=0))
    early = int(free.sequences[1, width + 1])  # row 1 would stop at its 2nd token
    kw = {
        "max_length": dict(max_length=width + 7, do_sample=False, pad_token_id=0),
        "min_new_tokens": greedy_kw(max_new_tokens=10, min_new_tokens=5, eos_token_id=[early, 2], pad_token_id=0),
        "generation_config": dict(generation_config=GenerationConfig(max_new_tokens=9, do_sample=False,
                                                                     pad_token_id=0, eos_token_id=2)),
        "repetition_penalty": greedy_kw(max_new_tokens=10, repetition_penalty=1.5, pad_token_id=0),
        "default_length": greedy_kw(pad_token_id=0),  # transformers' default: 20 new tokens
        "input_ids_kwarg": greedy_kw(max_new_tokens=6, pad_token_id=0),
        "inferred_mask": greedy_kw(max_new_tokens=6, pad_token_id=0),  # from the pads (0 is not the EOS)
    }[variant]
    if variant == "inferred_mask":
        mask = None
    ref = reference(model, ids, mask, **kw)
    if variant == "input_ids_kwarg":
        ours = model.generate(input_ids=ids, attention_mask=mask, **kw)
    else:
        ours = model.generate(ids, attention_mask=mask, **kw)
    assert_same_or_near_tie(ours, ref, width)


def test_rows_are_separate_engine_requests(tiny_llama, tiny_prompts):
    events = []

    class Events:
        @hookimpl
        def pagedcore_request_event(self, event, request_id, seq_index, info):
            events.append((event, request_id, info))

    ids, mask = pad_batch(tiny_prompts, "left")
    free = reference(tiny_llama, ids, mask, **greedy_kw(max_new_tokens=16, pad_token_id=0))
    eos = [int(free.sequences[0, ids.shape[1] + 1])]
    with patched(tiny_llama, plugins=[Events()], **TINY_SETTINGS) as model:
        out = model.generate(ids, attention_mask=mask, **greedy_kw(max_new_tokens=16, pad_token_id=0,
                                                                   eos_token_id=eos))
        engine = get_engine(model)
        assert engine.model is model  # the patched model's own weights, not a copy
        assert engine.model.get_input_embeddings().weight.data_ptr() == \
            tiny_llama.get_input_embeddings().weight.data_ptr()
    added = [e for e in events if e[0] == "added"]
    finished = [e for e in events if e[0] == "finished"]
    assert len(added) == len(finished) == len(tiny_prompts)
    generated = sorted(e[2]["num_output_tokens"] for e in finished)
    assert generated[0] == 2 and generated[-1] == 16  # row 0 stopped early; the engine did not pad it
    assert engine.total_generated_tokens == sum(generated) < len(tiny_prompts) * (out.shape[1] - ids.shape[1])


# ---- beam search ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_beams,side", [(2, "left"), (4, "right")])
def test_smollm2_beam_search_equals_transformers(num_beams, side, patched_smollm2, chat_prompt_ids):
    model, rows = patched_smollm2, [chat_prompt_ids[i] for i in (0, 3, 4)]
    kw = dict(num_beams=num_beams, num_return_sequences=2, max_new_tokens=16, do_sample=False,
              return_dict_in_generate=True, output_scores=True)
    ref_ids, ref_mask = pad_batch(rows, "left", pad_id=2)
    ref = HF_GENERATE(model, ref_ids, attention_mask=ref_mask, **kw)
    ids, mask = pad_batch(rows, side, pad_id=2)
    ours = model.generate(ids, attention_mask=mask, **kw)
    width = ids.shape[1]
    assert torch.equal(ours.sequences[:, :width], ids.repeat_interleave(2, 0))
    close = (ours.sequences_scores - ref.sequences_scores).abs()
    for r in range(ours.sequences.shape[0]):
        same = torch.equal(ours.sequences[r, width:], ref.sequences[r, width:]) \
            if ours.sequences.shape == ref.sequences.shape else False
        # A differing hypothesis is a near-tie: its score equals the one transformers ranked there.
        assert same or close[r] < NEAR_TIE, f"row {r} differs and is no near-tie"
    assert torch.allclose(ours.sequences_scores, ref.sequences_scores, atol=1e-4)
    if ours.sequences.shape == ref.sequences.shape and close.max() < 1e-4:
        assert torch.equal(ours.sequences[:, width:], ref.sequences[:, width:])


def test_tiny_llama_beam_search_with_eos_list(patched_tiny, tiny_prompts):
    model = patched_tiny
    ids, mask = pad_batch(tiny_prompts[:3], "left")
    free = HF_GENERATE(model, ids, attention_mask=mask, num_beams=4, max_new_tokens=10, pad_token_id=0,
                       do_sample=False)
    eos = [2, int(free[1, ids.shape[1] + 3])]  # must include the model's own EOS (2)
    kw = dict(num_beams=4, num_return_sequences=3, max_new_tokens=10, pad_token_id=0, eos_token_id=eos,
              do_sample=False, length_penalty=0.7, early_stopping=True)
    ref = HF_GENERATE(model, ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True, **kw)
    ours = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True, **kw)
    plain = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(ours.sequences, ref.sequences)
    assert torch.equal(plain, ref.sequences)
    assert torch.allclose(ours.sequences_scores, ref.sequences_scores, atol=1e-4)


# ---- stop strings, scores, sampling --------------------------------------------------------------------
def test_smollm2_stop_strings_equal_transformers(patched_smollm2, chat_prompt_ids, smollm2_tokenizer):
    model, tok = patched_smollm2, smollm2_tokenizer
    rows = [chat_prompt_ids[i] for i in (0, 2, 6)]
    ids, mask = pad_batch(rows, "left", pad_id=2)
    model.generate(ids[:1], max_new_tokens=2)  # token ids only: an engine without a tokenizer
    first = get_engine(model)
    kw = greedy_kw(max_new_tokens=32, stop_strings=[".", "ing"], tokenizer=tok)
    ref = reference(model, ids, mask, **kw)
    ours = model.generate(ids, attention_mask=mask, **kw)
    assert_same_or_near_tie(ours, ref, ids.shape[1])
    texts = tok.batch_decode(ours[:, ids.shape[1]:], skip_special_tokens=True)
    assert all(t.endswith(".") or "ing" in t for t in texts), texts
    assert get_engine(model) is not first and get_engine(model).tokenizer is tok  # remade for the stop strings


def test_stop_string_that_may_start_in_the_prompt_falls_back(patched_tiny, chat_prompt_ids, smollm2_tokenizer):
    # Chat prompts end in "\n": transformers would stop on a first "\n" (the sequence then ends in
    # "\n\n"), the engine matches stop strings in the output only, so this runs transformers' generate.
    ids = torch.tensor(chat_prompt_ids[:1])
    kw = greedy_kw(max_new_tokens=4, stop_strings=["\n\n"], tokenizer=smollm2_tokenizer, pad_token_id=0)
    expected = HF_GENERATE(patched_tiny, ids, **kw)
    with pytest.warns(FallbackWarning, match="stop string may begin inside a prompt"):
        assert torch.equal(patched_tiny.generate(ids, **kw), expected)


def test_return_dict_scores_and_logits_equal_transformers(patched_tiny, tiny_prompts):
    model = patched_tiny
    ids, mask = pad_batch(tiny_prompts, "left")
    width = ids.shape[1]
    free = reference(model, ids, mask, **greedy_kw(max_new_tokens=8, pad_token_id=0))
    kw = greedy_kw(max_new_tokens=8, pad_token_id=0, eos_token_id=[int(free.sequences[3, width + 2])],
                   return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = HF_GENERATE(model, ids, attention_mask=mask, **kw)
    ours = model.generate(ids, attention_mask=mask, **kw)
    assert type(ours) is type(ref)
    assert torch.equal(ours.sequences, ref.sequences)
    assert len(ours.scores) == len(ref.scores) == len(ours.logits) == 8
    lengths = [3 if r == 3 else 8 for r in range(len(tiny_prompts))]
    for t in range(8):
        for r, n in enumerate(lengths):
            if t < n:
                torch.testing.assert_close(ours.logits[t][r], ref.logits[t][r], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(ours.scores[t][r], ref.scores[t][r], atol=1e-4, rtol=1e-4)
            else:  # the row had finished: transformers' values there are logits of padding
                assert not ours.logits[t][r].any()


def test_sampling_top_k_1_is_greedy_and_num_return_sequences(patched_tiny, tiny_prompts):
    model = patched_tiny
    ids, mask = pad_batch(tiny_prompts, "left")
    width = ids.shape[1]
    greedy = HF_GENERATE(model, ids, attention_mask=mask, **greedy_kw(max_new_tokens=8, pad_token_id=0))
    ours = model.generate(ids, attention_mask=mask, do_sample=True, top_k=1, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(ours, greedy)
    torch.manual_seed(0)
    many = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.5, top_p=0.9, max_new_tokens=8,
                          num_return_sequences=3, pad_token_id=0)
    assert many.shape == (3 * len(tiny_prompts), width + 8)
    assert torch.equal(many[:, :width], ids.repeat_interleave(3, 0))
    assert len({tuple(r) for r in many[:3, width:].tolist()}) > 1, "samples of one row should differ"



def test_streamers_receive_the_returned_text(patched_smollm2, chat_prompt_ids, smollm2_tokenizer):
    model, tok = patched_smollm2, smollm2_tokenizer
    prompt = chat_prompt_ids[1]
    ids = torch.tensor([prompt])
    kw = greedy_kw(max_new_tokens=24)

    rec, hf_rec = RecordingStreamer(), RecordingStreamer()
    out = model.generate(ids, streamer=rec, **kw)
    ref = HF_GENERATE(model, ids, streamer=hf_rec, **kw)
    assert torch.equal(out, ref)
    assert rec.puts == hf_rec.puts and rec.ended == hf_rec.ended == 1  # transformers' put protocol
    assert rec.puts[0] == [prompt]

    text = tok.decode(out[0, len(prompt):], skip_special_tokens=True)
    it = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    worker = threading.Thread(target=model.generate, args=(ids,), kwargs=dict(streamer=it, **kw))
    worker.start()
    chunks = list(it)
    worker.join()
    assert "".join(chunks) == text and len(chunks) > 1

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model.generate(ids, streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True), **kw)
    hf_printed = io.StringIO()
    with contextlib.redirect_stdout(hf_printed):
        HF_GENERATE(model, ids, streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True), **kw)
    assert printed.getvalue() == hf_printed.getvalue() == text + "\n"


# ---- the benchmark -------------------------------------------------------------------------------------
def test_benchmark_smoke(tiny_model_dir, tmp_path):
    from pagedcore.bench.hf_generate import main

    out = tmp_path / "bench.json"
    assert main(["--model", str(tiny_model_dir("llama")), "--num-prompts", "4", "--max-new-tokens", "8",
                 "--num-kv-blocks", "128", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["num_prompts"] == 4
    assert result["original"]["seconds"] > 0 and result["patched"]["seconds"] > 0
    assert result["speedup"] == pytest.approx(result["original"]["seconds"] / result["patched"]["seconds"], rel=1e-3)
    assert result["outputs_equal"] is True
