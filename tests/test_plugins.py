"""The plugin system: every hook in `pagedcore.hookspecs` is called and takes effect (tiny random-weight Llama,
CPU); registration and entry-point discovery: test_plugin_registration.py."""

from __future__ import annotations

import pytest
import torch

from plugin_helpers import (NUM_BLOCKS, PROMPTS, RecordingPlugin, greedy, make_llm, model_dir,  # noqa: F401
                            run_engine)


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
