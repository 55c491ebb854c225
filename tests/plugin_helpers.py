"""Shared by the plugin tests (test_plugins.py, test_plugin_registration.py): the tiny engine, a driver, and test
plugins that implement every hook and record each call."""

from __future__ import annotations

from collections import deque

import pytest

import pagedcore
from pagedcore.attention.torch_backend import TorchAttentionBackend
from pagedcore.llm import LLM
from pagedcore.llm_engine import EngineStats
from pagedcore.model_loader import load_model_and_tokenizer
from pagedcore.sampling_params import SamplingParams

hookimpl = pagedcore.hookimpl

NUM_BLOCKS, BLOCK_SIZE = 64, 8
# Distinct token-id prompts (no shared prefix, no tokenizer dependence).
PROMPTS = [[1, 523, 1990, 77, 3021], [1, 88, 4410, 912, 65, 3003, 17], [1, 2222, 301]]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def make_llm(model_dir, plugins=(), **settings):
    settings = {"num_kv_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, **settings}
    return LLM(model_dir, plugins=list(plugins), **settings)


def run_engine(engine, prompts, params, ids=None) -> tuple[int, dict]:
    """Drive the engine step by step; return (number of steps that did work, final outputs by id)."""
    ids = ids or [str(i) for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    steps, final = 0, {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        assert steps < 500, "engine does not finish"
        for o in outs:
            if o.finished:
                final[o.request_id] = o
    return steps, final


# ---- test plugins ------------------------------------------------------------------------------
class CountingBackend(TorchAttentionBackend):
    name = "counting"

    def __init__(self):
        self.forward_calls = 0
        self.metadata_calls = 0

    def build_metadata(self, common):
        self.metadata_calls += 1
        return super().build_metadata(common)

    def forward(self, *args, **kwargs):
        self.forward_calls += 1
        return super().forward(*args, **kwargs)


class LIFOPolicy:
    name = "lifo"

    def add(self, waiting: deque, seq) -> None:
        waiting.appendleft(seq)

    def readd_preempted(self, waiting: deque, seq) -> None:
        waiting.appendleft(seq)


class RecordingPlugin:
    """Implements every hook; records each call."""

    def __init__(self, load=True):
        self.load = load
        self.load_calls = []
        self.loaded = None
        self.backend_calls = []
        self.backend = CountingBackend()
        self.banned: set[int] = set()
        self.processor_calls = []
        self.policy_calls = []
        self.events = []
        self.stats: list[EngineStats] = []

    @hookimpl
    def pagedcore_load_model(self, config):
        self.load_calls.append(config)
        if not self.load:
            return None  # defer to the built-in loader
        device = config.torch_device()
        self.loaded = load_model_and_tokenizer(config.model, config.torch_dtype(device), device, config.tokenizer)
        return self.loaded

    @hookimpl
    def pagedcore_attention_backend(self, name, device):
        self.backend_calls.append((name, device))
        return self.backend if name in (None, "counting") else None

    @hookimpl
    def pagedcore_logits_processors(self, config):
        def ban(logits, sequences):
            assert logits.dim() == 2 and logits.shape[0] == len(sequences)
            self.processor_calls.append((logits.shape, [s.request_id for s in sequences]))
            for t in self.banned:
                logits[:, t] = float("-inf")
            return logits

        return [ban]

    @hookimpl
    def pagedcore_scheduling_policy(self, name):
        self.policy_calls.append(name)
        return LIFOPolicy() if name == "lifo" else None

    @hookimpl
    def pagedcore_request_event(self, event, request_id, seq_index, info):
        self.events.append((event, request_id, seq_index, dict(info)))

    @hookimpl
    def pagedcore_step_end(self, stats):
        assert isinstance(stats, EngineStats)
        self.stats.append(stats)

    def events_of(self, kind):
        return [e for e in self.events if e[0] == kind]
