"""IncrementalDetokenizer stop strings: cut exactly, never streamed, searched for in the new tail only."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from detokenizer_helpers import HYPOTHESIS, NATURAL_TEXTS, encode, full_decode, sp_tok, stream, tok  # noqa: F401
from pagedcore import detokenizer as detok_mod
from pagedcore.detokenizer import IncrementalDetokenizer, check_stop_strings

# -- the stop search covers only the new tail ------------------------------------------


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
