"""The plugin system: every hook in `pagedcore.hookspecs` is called and takes effect, and plugins
are discovered through the `pagedcore` entry-point group (tiny random-weight Llama, CPU)."""

from __future__ import annotations

import sys
import textwrap
from collections import deque

import pytest
import torch

import pagedcore
from pagedcore import builtin_plugins
from pagedcore.attention.torch_backend import TorchAttentionBackend
from pagedcore.llm import LLM
from pagedcore.llm_engine import EngineStats
from pagedcore.model_loader import load_model_and_tokenizer
from pagedcore.plugins import make_plugin_manager
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


# ---- registration ------------------------------------------------------------------------------
def count_builtin(pm) -> int:
    return sum(1 for p in pm.get_plugins() if p is builtin_plugins)


def test_builtin_registered_exactly_once():
    pm = make_plugin_manager()
    assert count_builtin(pm) == 1
    assert pm.get_plugin("builtin") is builtin_plugins
    # One implementation per hook: the project's own "builtin" entry point did not add a second.
    for hook in ("pagedcore_load_model", "pagedcore_attention_backend", "pagedcore_scheduling_policy"):
        impls = getattr(pm.hook, hook).get_hookimpls()
        assert [i.plugin for i in impls] == [builtin_plugins], hook


def test_plugins_passed_in_code_are_called_before_builtin():
    plugin = RecordingPlugin()
    pm = make_plugin_manager([plugin])
    assert pm.is_registered(plugin) and count_builtin(pm) == 1
    # firstresult: the plugin's answer wins; its None defers to the built-in.
    assert pm.hook.pagedcore_scheduling_policy(name="lifo").name == "lifo"
    assert pm.hook.pagedcore_scheduling_policy(name="fcfs").name == "fcfs"
    assert pm.hook.pagedcore_scheduling_policy(name="nope") is None
    assert plugin.policy_calls == ["lifo", "fcfs", "nope"]
    assert pm.hook.pagedcore_attention_backend(name=None, device=torch.device("cpu")) is plugin.backend
    assert isinstance(pm.hook.pagedcore_attention_backend(name="torch", device=torch.device("cpu")),
                      TorchAttentionBackend)


THIRDPARTY_SRC = textwrap.dedent('''
    from pagedcore import hookimpl
    from pagedcore.attention.torch_backend import TorchAttentionBackend

    STEPS = []
    EVENTS = []

    class ThirdBackend(TorchAttentionBackend):
        name = "thirdparty"
        calls = 0

        def forward(self, *args, **kwargs):
            type(self).calls += 1
            return super().forward(*args, **kwargs)

    @hookimpl
    def pagedcore_attention_backend(name, device):
        return ThirdBackend() if name == "thirdparty" else None

    @hookimpl
    def pagedcore_step_end(stats):
        STEPS.append(stats)

    @hookimpl
    def pagedcore_request_event(event, request_id, seq_index, info):
        EVENTS.append((event, request_id))
''')


@pytest.fixture
def thirdparty_dist(tmp_path, monkeypatch):
    """An 'installed' third-party distribution: a module plus a dist-info with an entry point."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "thirdparty_plugin.py").write_text(THIRDPARTY_SRC)
    info = root / "thirdparty_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty_plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pagedcore]\nthird = thirdparty_plugin\n")
    monkeypatch.syspath_prepend(str(root))
    yield root
    sys.modules.pop("thirdparty_plugin", None)


def test_entry_point_plugin_is_discovered(thirdparty_dist, model_dir):
    pm = make_plugin_manager()
    third = pm.get_plugin("third")
    assert third is not None, f"entry-point plugin not registered: {pm.list_name_plugin()}"
    assert third.__name__ == "thirdparty_plugin"
    assert count_builtin(pm) == 1
    dists = {d.project_name for _, d in pm.list_plugin_distinfo()}
    assert "thirdparty_plugin" in dists
    # An engine built with no plugins in code uses it: its backend (selected by name) and its hooks.
    llm = make_llm(model_dir, attention_backend="thirdparty")
    assert llm.engine.pm.get_plugin("third") is third
    assert type(llm.engine.runner.backend).__name__ == "ThirdBackend"
    third.STEPS.clear(), third.EVENTS.clear()
    steps, final = run_engine(llm.engine, PROMPTS[:2], greedy(3))
    assert steps == 3 and len(final) == 2
    assert len(third.STEPS) == steps
    assert third.ThirdBackend.calls == steps * llm.engine.runner.shape.num_layers
    assert sorted(rid for ev, rid in third.EVENTS if ev == "finished") == ["0", "1"]


def test_entry_point_plugin_absent_without_dist():
    pm = make_plugin_manager()
    assert pm.get_plugin("third") is None
    assert [name for name, _ in pm.list_name_plugin()] == ["builtin"]


# ---- hooks take effect in a real engine --------------------------------------------------------
def test_all_hooks_called_and_take_effect(model_dir):
    plugin = RecordingPlugin()
    llm = make_llm(model_dir, plugins=[plugin])
    engine = llm.engine
    # load_model: the plugin's model is the engine's (the built-in loader was not used).
    assert len(plugin.load_calls) == 1 and plugin.load_calls[0].model == model_dir
    assert engine.model is plugin.loaded[0] and engine.tokenizer is plugin.loaded[1]
    # attention_backend: asked once for "the best" on this device, and the plugin's is used.
    assert plugin.backend_calls == [(None, torch.device("cpu"))]
    assert engine.runner.backend is plugin.backend
    # scheduling_policy: asked for the default; it deferred, so the built-in FCFS runs.
    assert plugin.policy_calls == ["fcfs"] and engine.scheduler.policy.name == "fcfs"

    max_tokens = 5
    steps, final = run_engine(engine, PROMPTS[:2], greedy(max_tokens))
    num_layers = engine.runner.shape.num_layers
    assert num_layers == 2
    # One prefill step samples the first token of both, then one decode step per further token.
    assert steps == max_tokens
    assert plugin.backend.forward_calls == num_layers * steps > 0
    assert plugin.backend.metadata_calls == steps
    assert len(plugin.processor_calls) == steps
    assert plugin.processor_calls[0][0] == (2, engine.vocab_size)
    assert all(len(final[r].outputs[0].token_ids) == max_tokens for r in ("0", "1"))

    # request events, per request id, in order.
    for rid, prompt in zip(("0", "1"), PROMPTS):
        evs = [e for e in plugin.events if e[1] == rid]
        assert [e[0] for e in evs] == ["added", "scheduled", "finished"], evs
        assert evs[0][2] is None and evs[0][3] == {"num_prompt_tokens": len(prompt)}
        assert evs[1][2] == 0 and evs[2][2] == 0
        assert evs[2][3]["finish_reason"] == "length" and evs[2][3]["num_output_tokens"] == max_tokens
        assert evs[2][3]["num_preemptions"] == 0

    # step_end: one EngineStats per step, with sane numbers.
    stats = plugin.stats
    assert len(stats) == steps
    assert all(s.num_total_blocks == NUM_BLOCKS and 0 <= s.num_free_blocks <= NUM_BLOCKS for s in stats)
    assert all(s.step_time > 0 and s.num_preemptions == 0 and s.num_swapped == 0 for s in stats)
    assert stats[0].num_scheduled_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    assert stats[0].num_running == 2 and stats[0].num_free_blocks < NUM_BLOCKS
    assert [s.num_generated_tokens for s in stats] == [2] * steps
    assert [s.num_scheduled_tokens for s in stats[1:]] == [2] * (steps - 1)
    assert [s.total_generated_tokens for s in stats] == [2 * (i + 1) for i in range(steps)]
    assert stats[-1].num_running == 0 and stats[-1].num_waiting == 0
    assert stats[-1].num_free_blocks == NUM_BLOCKS and stats[-1].kv_usage == 0


def test_loader_returning_none_defers_to_builtin(model_dir):
    plugin = RecordingPlugin(load=False)
    llm = make_llm(model_dir, plugins=[plugin])
    assert len(plugin.load_calls) == 1 and plugin.loaded is None
    assert type(llm.engine.model).__name__ == "LlamaForCausalLM"
    assert llm.engine.model.config.num_hidden_layers == 2
    out = llm.generate([PROMPTS[0]], greedy(3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert plugin.backend.forward_calls == 2 * 3 and len(plugin.stats) == 3


def test_logits_processor_bans_token(model_dir):
    plugin = RecordingPlugin()
    llm = make_llm(model_dir, plugins=[plugin])
    params = greedy(8)
    base = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(base) == 8
    banned = base[0]  # what greedy picks first
    plugin.banned = {banned}
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 8
    assert banned not in out
    assert out[0] != base[0]
    # Lifting the ban restores greedy's own output: the processor was the only difference.
    plugin.banned = set()
    again = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == base


def test_scheduling_policy_changes_admission_order(model_dir):
    order = {}
    for policy in ("fcfs", "lifo"):
        plugin = RecordingPlugin()
        llm = make_llm(model_dir, plugins=[plugin], scheduling_policy=policy, max_num_seqs=1)
        assert llm.engine.scheduler.policy.name == policy
        outs = llm.generate(PROMPTS, greedy(2), use_tqdm=False)
        assert [o.request_id for o in outs] == ["0", "1", "2"]  # results still in prompt order
        scheduled = [e[1] for e in plugin.events_of("scheduled")]
        finished = [e[1] for e in plugin.events_of("finished")]
        by_first_token = [o.request_id for o in sorted(outs, key=lambda o: o.metrics.first_token_time)]
        assert scheduled == finished == by_first_token  # one at a time (max_num_seqs=1)
        order[policy] = scheduled
    assert order["fcfs"] == ["0", "1", "2"]
    assert order["lifo"] == ["2", "1", "0"]


def test_request_events_aborted(model_dir):
    plugin = RecordingPlugin()
    engine = make_llm(model_dir, plugins=[plugin]).engine
    engine.add_request("a", PROMPTS[0], greedy(10))
    engine.step()  # "a" is now running and holds blocks
    engine.add_request("b", PROMPTS[1], greedy(10))  # "b" waits: never scheduled
    assert engine.kv.num_free_blocks < NUM_BLOCKS
    engine.abort_request(["a", "b"])
    assert [(e[0], e[1]) for e in plugin.events] == [
        ("added", "a"), ("scheduled", "a"), ("added", "b"), ("aborted", "a"), ("aborted", "b")]
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == NUM_BLOCKS
    assert engine.step() == []


def test_request_events_preempted(model_dir):
    # 4 blocks of 8 = 32 token slots; two sequences of 6 prompt + 20 new tokens need 4 blocks each.
    plugin = RecordingPlugin()
    engine = make_llm(model_dir, plugins=[plugin], num_kv_blocks=4).engine
    prompts = [[1, 523, 1990, 77, 3021, 9], [1, 88, 4410, 912, 65, 3003]]
    steps, final = run_engine(engine, prompts, greedy(20))
    assert sorted(final) == ["0", "1"]
    assert all(len(final[r].outputs[0].token_ids) == 20 for r in final)
    preempted = plugin.events_of("preempted")
    assert preempted and all(e[1] == "1" for e in preempted)  # the newest running one is the victim
    assert preempted[0][3]["num_preemptions"] == 1
    evs1 = [e[0] for e in plugin.events if e[1] == "1"]
    # preempted, then scheduled again (recompute), then finished
    first_pre = evs1.index("preempted")
    assert "scheduled" in evs1[first_pre:] and evs1[-1] == "finished"
    fin = {e[1]: e[3] for e in plugin.events_of("finished")}
    assert fin["1"]["num_preemptions"] == len(preempted) and fin["0"]["num_preemptions"] == 0
    assert plugin.stats[-1].num_preemptions == len(preempted) == engine.scheduler.num_preemptions
    assert len(plugin.stats) == steps
    assert all(s.num_total_blocks == 4 for s in plugin.stats)
    assert plugin.stats[-1].num_free_blocks == 4


# ---- errors ------------------------------------------------------------------------------------
def test_unknown_attention_backend(model_dir):
    with pytest.raises(ValueError, match="no attention backend 'nope'"):
        make_llm(model_dir, attention_backend="nope")


def test_unknown_scheduling_policy(model_dir):
    plugin = RecordingPlugin()  # knows only "lifo"
    with pytest.raises(ValueError, match="unknown scheduling policy 'nope'"):
        make_llm(model_dir, plugins=[plugin], scheduling_policy="nope")
    assert plugin.policy_calls == ["nope"]


def test_rejected_event_names_the_field(tiny_model_dir):
    from pagedcore import LLM, InvalidRequestError, hookimpl

    class Recorder:
        def __init__(self):
            self.events = []

        @hookimpl
        def pagedcore_request_event(self, event, request_id, seq_index, info):
            self.events.append((event, info))

    rec = Recorder()
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=8, plugins=[rec])
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6, 7]], {"top_p": 1.5})
    assert rec.events == [("rejected", {"field": "top_p", "error": rec.events[0][1]["error"], "reason": "invalid"})]
    assert "top_p" in rec.events[0][1]["error"]
