"""IncrementalDetokenizer: streamed deltas add up to the full decode and the decode window stays bounded."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detokenizer_helpers import HYPOTHESIS, NATURAL_TEXTS, encode, full_decode, sp_tok, stream, tok  # noqa: F401
from pagedcore.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.decode_lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.decode_lengths.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


# -- helpers ---------------------------------------------------------------------------


def assert_streams_full_decode(tokenizer, output_ids, prompt_ids=(), sizes=None,
                               skip_special_tokens=True, expected=None):
    det, deltas, stop, _ = stream(tokenizer, output_ids, prompt_ids, sizes,
                                  skip_special_tokens=skip_special_tokens)
    full = full_decode(tokenizer, output_ids, skip_special_tokens) if expected is None else expected
    assert stop is None
    assert "".join(deltas) == full
    assert det.output_text == full
    if FFFD not in full:
        assert not any(FFFD in d for d in deltas), deltas
    return deltas


# -- deltas add up to the full decode (SmolLM2, byte-level BPE) ----------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", NATURAL_TEXTS)
def test_natural_text_one_token_at_a_time(tok, text, skip_special_tokens):
    ids = encode(tok, text)
    assert full_decode(tok, ids) == text  # byte-level BPE round-trips
    prompt = encode(tok, "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    for prompt_ids in ([], prompt):
        deltas = assert_streams_full_decode(tok, ids, prompt_ids, skip_special_tokens=skip_special_tokens)
        # Nothing is held back but the tokens of a character still arriving: after i tokens
        # the stream is decode(ids[:j]) for the last j <= i where that ends in whole characters.
        complete = ""
        for i in range(1, len(ids) + 1):
            text = full_decode(tok, ids[:i])
            complete = complete if text.endswith(FFFD) else text
            assert "".join(deltas[:i]) == complete


def test_multibyte_characters_are_held_until_complete(tok):
    ids = encode(tok, "🎉")
    assert len(ids) > 1  # the emoji's bytes span tokens
    det = IncrementalDetokenizer(tok, [])
    for token_id in ids[:-1]:
        assert det.update([token_id]) is None
        assert det.get_next_output_text(finished=False, delta=True) == ""
        assert det.output_text == ""
    det.update(ids[-1:])
    assert det.get_next_output_text(finished=False, delta=True) == "🎉"


def test_incomplete_character_is_flushed_when_finished(tok):
    ids = encode(tok, "ok 🎉")[:-1]  # ends mid-emoji
    full = full_decode(tok, ids)
    assert full.endswith(FFFD)
    det = IncrementalDetokenizer(tok, [])
    streamed = ""
    for token_id in ids:
        det.update([token_id])
        streamed += det.get_next_output_text(finished=False, delta=True)
    assert FFFD not in streamed
    streamed += det.get_next_output_text(finished=True, delta=True)
    assert streamed == full == det.output_text
    assert det.get_next_output_text(finished=True, delta=False) == full


@settings(HYPOTHESIS, max_examples=80)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_random_token_ids_stream_to_full_decode(tok, data, skip_special_tokens):
    vocab = st.integers(0, len(tok) - 1)
    # Bias towards special ids and single-byte tokens (ids < 300 here) for lots of broken UTF-8.
    token = st.one_of(vocab, st.integers(0, 16), st.integers(17, 300))
    output = data.draw(st.lists(token, min_size=0, max_size=120), label="output")
    prompt = data.draw(st.lists(token, max_size=8), label="prompt")
    sizes = data.draw(st.one_of(st.none(), st.lists(st.integers(1, 7), min_size=1, max_size=4)),
                      label="chunk sizes")
    assert_streams_full_decode(tok, output, prompt, sizes, skip_special_tokens)


@HYPOTHESIS
@given(text=st.text(st.characters(exclude_categories=("Cs",)), max_size=80),
       prompt_text=st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
       sizes=st.one_of(st.none(), st.lists(st.integers(1, 6), min_size=1, max_size=4)))
def test_natural_text_streams_to_full_decode(tok, text, prompt_text, sizes):
    ids = encode(tok, text)
    assert_streams_full_decode(tok, ids, encode(tok, prompt_text), sizes)


def test_long_mixed_output_in_random_chunks(tok):
    rng = random.Random(0)
    ids = encode(tok, " ".join(NATURAL_TEXTS) * 8)
    for _ in range(3):
        sizes = [rng.randint(1, 9) for _ in range(5)]
        assert_streams_full_decode(tok, ids, encode(tok, "Once upon a time"), sizes)
    noise = [rng.randrange(len(tok)) for _ in range(1500)]
    assert_streams_full_decode(tok, noise, sizes=[1, 3, 2], skip_special_tokens=False)


def test_special_tokens_skipped_or_kept(tok):
    ids = encode(tok, "Hi") + [tok.convert_tokens_to_ids("<|im_end|>")] + encode(tok, " there")
    kept = assert_streams_full_decode(tok, ids, skip_special_tokens=False)
    assert "".join(kept) == "Hi<|im_end|> there"
    skipped = assert_streams_full_decode(tok, ids, skip_special_tokens=True)
    assert "".join(skipped) == "Hi there"


def test_skipped_special_tokens_do_not_widen_the_window(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tok, "Hello") + [im_end] * 500 + encode(tok, " world") + [0, 1, 2] * 100
    window, _ = max_decode_window(tok, ids)
    assert window <= 12


def test_prompt_ending_mid_character_does_not_leak_into_output(tok):
    emoji = encode(tok, "🎉")
    prompt, output = emoji[:-1], emoji[-1:] + encode(tok, " done")
    # The output owns only its own bytes: its first one is a lone continuation byte.
    assert_streams_full_decode(tok, output, prompt)


# -- SentencePiece-style leading spaces -----------------------------------------------


def test_sentencepiece_leading_space_comes_from_prompt_context(sp_tok):
    full = encode(sp_tok, "Hello world, hello world")
    prompt, output = full[:1], full[1:]
    assert sp_tok.convert_ids_to_tokens(output[0]).startswith("▁")
    # On its own the output's first "▁" is stripped; after the prompt it is a space.
    assert full_decode(sp_tok, output).startswith("world")
    expected = full_decode(sp_tok, full)[len(full_decode(sp_tok, prompt)):]
    assert expected.startswith(" world")
    assert_streams_full_decode(sp_tok, output, prompt, expected=expected)
    # Without a prompt there is no text before it to separate from: decode(output) it is.
    assert_streams_full_decode(sp_tok, output)


@pytest.mark.parametrize("text", ["Hello café 🎉 world", "日本 Hello, ü world!", "a  b   c"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_byte_fallback_streams_exactly(sp_tok, text, skip_special_tokens):
    ids = [sp_tok.bos_token_id] + encode(sp_tok, text) + [sp_tok.eos_token_id]
    for cut in range(len(ids)):
        prompt, output = ids[:cut], ids[cut:]
        prompt_text = full_decode(sp_tok, prompt, skip_special_tokens)
        if prompt_text.endswith(FFFD):  # cut mid-character: the output owns only its bytes
            expected = full_decode(sp_tok, output, skip_special_tokens)
        else:
            expected = full_decode(sp_tok, ids, skip_special_tokens)[len(prompt_text):]
        for sizes in (None, [2, 3]):
            assert_streams_full_decode(sp_tok, output, prompt, sizes, skip_special_tokens, expected)


# -- per-token cost does not grow with length ------------------------------------------


def max_decode_window(tokenizer, output_ids, sizes=None) -> tuple[int, int]:
    counting = CountingTokenizer(tokenizer)
    det, deltas, _, _ = stream(counting, output_ids, encode(tokenizer, "Prompt text here"), sizes)
    assert "".join(deltas) == det.output_text == full_decode(tokenizer, output_ids)
    return max(counting.decode_lengths), len(counting.decode_lengths)


def test_decode_window_is_bounded_on_long_outputs(tok):
    ids = encode(tok, " ".join(NATURAL_TEXTS) * 40)
    assert len(ids) > 4000
    short_window, _ = max_decode_window(tok, ids[:200])
    long_window, calls = max_decode_window(tok, ids)
    assert long_window == short_window <= 12
    assert calls <= 2 * len(ids) + 8  # two small decodes per token, plus setup and flush


def test_decode_window_is_bounded_on_invalid_utf8(tok):
    # Byte-level tokens for lone continuation bytes and lead bytes: text that never completes.
    garbage = [tok.convert_tokens_to_ids(t) for t in ("İ", "ī", "æ", "ð", "Ŀ")]
    assert all(isinstance(i, int) and i > 16 for i in garbage)
    rng = random.Random(1)
    for ids in ([garbage[0]] * 3000,
                [rng.choice(garbage) for _ in range(3000)],
                [garbage[2]] * 1000 + encode(tok, " ok") + [garbage[3]] * 1000):
        window, _ = max_decode_window(tok, ids)
        assert window <= 16
    window, _ = max_decode_window(tok, [rng.choice(garbage) for _ in range(3000)], sizes=[5, 1, 7])
    assert window <= 16


def test_fast_decode_is_the_rust_tokenizers_and_equals_transformers(tok, sp_tok):
    """Windows decode through the Rust tokenizer itself where transformers' decode would only call it; a
    tokenizer whose _decode is its own keeps transformers' path."""
    from pagedcore.detokenizer import fast_decode

    rng = random.Random(3)
    for t in (tok, sp_tok):
        fast = fast_decode(t)
        assert fast is not None and IncrementalDetokenizer(t, [1, 2])._fast is not None
        specials = sorted(t.all_special_ids)
        for _ in range(200):
            ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(t)) for _ in range(rng.randint(0, 9))]
            for skip in (True, False):
                assert fast(ids, skip_special_tokens=skip) == full_decode(t, ids, skip)

    class OwnDecode(type(tok)):
        def _decode(self, token_ids, **kwargs):
            return "x"

    own = object.__new__(OwnDecode)
    own.__dict__.update(tok.__dict__)
    assert fast_decode(own) is None and fast_decode(CountingTokenizer(tok)) is None
