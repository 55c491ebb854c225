"""What the tests of the patched `model.generate()` share (test_hf_generate.py, test_hf_generate_fallbacks.py): the
tiny model, patched and not, and its prompts (fixtures, imported by both); a left- or right-padded batch, greedy
options, transformers' own generate(), a streamer that records; no fallback passes silently."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation import GenerationMixin

from pagedcore.adapters.hf import FallbackWarning, patched

HF_GENERATE = GenerationMixin.generate  # transformers' own, whatever is patched later
TINY_SETTINGS = dict(num_kv_blocks=128, block_size=8)


@pytest.fixture(autouse=True)
def no_silent_fallback():
    """A fallback is an error unless a test records warnings itself (the fallback tests do)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        yield


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")), dtype=torch.float32).eval()


@pytest.fixture
def patched_tiny(tiny_llama):
    with patched(tiny_llama, **TINY_SETTINGS) as model:
        yield model


@pytest.fixture(scope="module")
def tiny_prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 33, 12)]


def pad_batch(rows: list[list[int]], side: str, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids, mask = [], []
    for r in rows:
        fill = [pad_id] * (width - len(r))
        ids.append(fill + r if side == "left" else r + fill)
        mask.append([0] * len(fill) + [1] * len(r) if side == "left" else [1] * len(r) + [0] * len(fill))
    return torch.tensor(ids), torch.tensor(mask)



def greedy_kw(**kw):
    return dict(do_sample=False, **kw)


class RecordingStreamer:
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1
