"""Incremental detokenization and stop strings: generated token ids in, streamable text out.

One IncrementalDetokenizer per generated sequence. Each step decodes only a small window of
ids (vLLM/TGI's prefix_offset / read_offset scheme), so the cost per token does not grow with
the output's length, and the text it commits is always a prefix of the full decode:

    ids:  ... | prefix_offset ........ read_offset ....... end
                 last committed tokens   pending tokens
                 (context, already text) (decoded now)

    new text = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

What "the full decode" means:
  * The output text is what the output tokens add to the prompt's text. The window starts with
    the prompt's last few tokens as context, so a SentencePiece tokenizer renders the output's
    leading "▁" as the space it is in the full text (decode(output_ids) alone would strip it).
  * For byte-level BPE (GPT-2, Llama-3, SmolLM2) decoding has no such context, and the text
    equals tokenizer.decode(output_ids, skip_special_tokens=...) exactly, invalid bytes included.
  * A trailing partial UTF-8 character (which decodes to U+FFFD) is held back until its last
    byte arrives, so streamed text never shows a broken character; whatever is still pending
    when the sequence finishes is flushed as the tokenizer renders it.
  * clean_up_tokenization_spaces is off: it rewrites " ." etc. over the whole text and so is
    not incremental (transformers already ignores it for BPE tokenizers).
  * Known limit: a byte-fallback (SentencePiece) decoder renders an *invalid* run of byte
    tokens as one U+FFFD per byte over the whole run, which no streaming decoder can foresee;
    text made of valid UTF-8 is exact.

Stop strings: the first stop string to be completed wins (ties: the one starting earlier), the
text is cut before it (or after it with include_stop_str_in_output), and only the tail that a
new match could touch is searched. While streaming, a tail that could still grow into a stop
string is withheld, so a stop string never leaks into a delta.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the output as context only (vLLM uses 5 too).
INITIAL_CONTEXT_TOKENS = 5

# A UTF-8 character has at most 4 bytes, so a character still arriving spans at most 3 pending
# tokens. More than this many pending tokens ending in U+FFFD means invalid bytes are in the
# way; we then commit them instead of letting the decode window grow.
MAX_PENDING_TOKENS = 4


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids that decode(skip_special_tokens=True) drops: the special added tokens."""
    added = {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    return frozenset(added | set(tokenizer.all_special_ids))


def fast_decode(tokenizer) -> Callable[..., str] | None:
    """The Rust tokenizer's own decode(ids, skip_special_tokens) where transformers' decode would only call it
    (a fast tokenizer whose decode and _decode are transformers' own; clean-up off, as here): ~1.2 against ~4 us
    a window, two windows a token for every sequence of a step. None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    from transformers import PreTrainedTokenizerBase

    try:  # transformers 5
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast
    except ImportError:  # transformers 4
        from transformers import PreTrainedTokenizerFast as Fast
    cls = type(tokenizer)
    if not isinstance(tokenizer, Fast) or cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not Fast._decode:
        return None
    return backend.decode


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """Find the stop string completed first within the last `new_char_count` characters.

    Returns (stop string, length to truncate output_text to), or None. Only matches ending in
    the new characters are new, and such a match starts at most len(s) - 1 characters before
    them, so each search covers new_char_count + len(s) - 1 characters, not the whole text.
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        start = output_text.find(s, max(0, len(output_text) - new_char_count - len(s) + 1))
        # find() returns the earliest start, hence the earliest end for this string.
        if start != -1 and (best is None or (start + len(s), start) < best[:2]):
            best = (start + len(s), start, s)
    if best is None:
        return None
    end, start, s = best
    return s, end if include_in_output else start


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self._fast = fast_decode(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]  # "" would match everywhere
        self.include_stop_str_in_output = include_stop_str_in_output
        # Dropped up front (decode would drop them anyway) so they never widen the window.
        self._skipped_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        # The ids the window slides over: prompt context, then the output ids that render.
        self.token_ids = self._prompt_context(prompt_token_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._text = ""
        self._sent_offset = 0  # chars of _text already returned by a delta
        self.stop_string: str | None = None  # the stop string matched, once one has

    @property
    def output_text(self) -> str:
        """The committed text so far: complete characters only until the sequence finishes,
        cut at the stop string if one matched."""
        return self._text

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append generated tokens; return the stop string if this completed one, else None.

        After a stop string matched, the text is final and further tokens are ignored.
        """
        if self.stop_string is not None:
            return None
        for token_id in new_token_ids:
            if token_id in self._skipped_ids:
                continue
            self.token_ids.append(token_id)
            # One token at a time: the window stays small and a stop ends the text right there.
            if self._append(self._decode_next()):
                return self.stop_string
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the client: what was not returned yet (delta) or all of it so far.

        Until finished, a tail that may be the start of a stop string is withheld.
        """
        if finished:
            self._flush()
        end = len(self._text) - (0 if finished else self._stop_prefix_len())
        if not delta:
            return self._text[:end]
        # A withheld tail is never part of what was sent (it was withheld then too); max() only
        # guards callers that asked with finished=True and then carried on.
        end = max(end, self._sent_offset)
        text, self._sent_offset = self._text[self._sent_offset:end], end
        return text

    # -- decoding ------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last few rendering tokens, starting where they decode cleanly."""
        tail: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if len(tail) == INITIAL_CONTEXT_TOKENS + 3:
                break
            if token_id not in self._skipped_ids:
                tail.append(token_id)
        tail.reverse()
        # A byte-fallback decoder turns a whole run of byte tokens into U+FFFDs when the run
        # starts mid-character; one of 4 consecutive starts is on a character boundary.
        for n in range(min(INITIAL_CONTEXT_TOKENS, len(tail)), len(tail) + 1):
            if not self._decode(tail[-n:]).endswith(REPLACEMENT_CHAR):
                return tail[-n:]
        # The prompt ends mid-character. The output's first bytes would complete it, but the
        # output owns only its own bytes: decode it on its own, like decode(output_ids).
        return []

    def _decode_next(self) -> str:
        """Decode the pending tokens; return the text they complete ("" while waiting)."""
        ids = self.token_ids
        prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(ids[self.prefix_offset:])
        if not new_text.endswith(REPLACEMENT_CHAR):
            return self._commit(len(ids), prefix_text, new_text)
        if len(ids) - self.read_offset > MAX_PENDING_TOKENS:
            return self._commit_invalid(prefix_text, new_text)
        return ""  # a character is still arriving

    def _commit(self, end: int, prefix_text: str, text: str) -> str:
        """Commit ids[:end], whose window decode is `text`; return the new part."""
        new_text = text[len(prefix_text):]
        # The window must keep starting at a token that renders: a SentencePiece decoder
        # strips the first token's leading space, and it must strip the same one each time.
        if new_text:
            self.prefix_offset = self.read_offset
        self.read_offset = end
        return new_text

    def _commit_invalid(self, prefix_text: str, new_text: str) -> str:
        """The pending tokens hold invalid bytes: commit up to a character boundary.

        Only the last 3 bytes (an incomplete character) can still change, so a boundary at
        least 4 tokens from the end is final. It is a boundary when decoding either side alone
        renders the same text; every 4 consecutive token boundaries include one (a character
        or an invalid sequence has at most 4 bytes), so 4 candidates suffice.
        """
        ids, start = self.token_ids, self.prefix_offset
        for end in range(len(ids) - 4, max(self.read_offset, len(ids) - 8), -1):
            head = self._decode(ids[start:end])
            if head + self._decode(ids[end:]) == new_text:
                return self._commit(end, prefix_text, head)
        return ""

    def _flush(self) -> None:
        """The sequence finished: commit pending tokens as they render, partial char and all."""
        if self.stop_string is not None or self.read_offset == len(self.token_ids):
            return
        ids = self.token_ids
        prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(ids[self.prefix_offset:])
        self._append(self._commit(len(ids), prefix_text, new_text))

    # -- stop strings ------------------------------------------------------------------

    def _append(self, new_text: str) -> bool:
        """Add committed text; return True if it completed a stop string (text then cut)."""
        if not new_text:
            return False
        self._text += new_text
        if not self.stop:
            return False
        match = check_stop_strings(self._text, len(new_text), self.stop,
                                   self.include_stop_str_in_output)
        if match is None:
            return False
        self.stop_string, truncate_to = match
        self._text = self._text[:truncate_to]
        return True

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if not self.stop or self.include_stop_str_in_output or self.stop_string is not None:
            return 0  # included stop strings may be streamed; a stopped text is final
        text, hold = self._text, 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold
