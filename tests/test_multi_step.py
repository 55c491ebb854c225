"""Multi-step decode (config.num_scheduler_steps; LLMEngine._num_decode_steps, ModelRunner._decode_more): a step of
argmax-only decode rows runs several forwards, each row's token fed back, before the engine's Python runs again.
The tokens must be the ones one forward a step gives (and transformers' greedy ones), whatever stops a row inside a
group, and every block must come back."""

from __future__ import annotations

import pytest
import torch

from api_helpers import assert_pool_whole, greedy
from pagedcore import LLMEngine, OutputKind, SamplingParams
from pagedcore.decode_stack import DecodeStack
from pagedcore.input_batch import InputBatch
from pagedcore.scheduler import SchedulerOutput

PROMPTS = [list(range(100 + 3 * i, 117 + 11 * i)) for i in range(5)]  # 17..61 tokens: rows cross blocks at once
MAX_TOKENS = [23, 9, 30, 5, 17]  # not multiples of 4: groups end short at max_tokens


@pytest.fixture
def forwards_again(monkeypatch):
    """How many extra forwards multi-step decodes ran (DecodeStack.decode_again returning tokens)."""
    count = [0]
    original = DecodeStack.decode_again

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        count[0] += out is not None
        return out

    monkeypatch.setattr(DecodeStack, "decode_again", counted)
    return count


def _run(model_dir, steps: int, params=None, prompts=PROMPTS, engine=None, **settings):
    """(engine, each request's token ids, each request's tokens per output event)."""
    settings.setdefault("max_num_seqs", 8)
    engine = engine or LLMEngine(model=str(model_dir), num_scheduler_steps=steps, **settings)
    params = params or [greedy(n, ignore_eos=True) for n in MAX_TOKENS[:len(prompts)]]
    ids = [engine.add_request(None, p, sp, output_kind=OutputKind.DELTA) for p, sp in zip(prompts, params)]
    tokens = {i: [] for i in ids}
    events = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = out.outputs[0].token_ids if out.outputs else []
            tokens[out.request_id] += new
            if new:
                events[out.request_id].append(len(new))
    assert_pool_whole(engine)
    return engine, [tokens[i] for i in ids], [events[i] for i in ids]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_step_tokens_equal_one_forward_a_step(tiny_model_dir, forwards_again, dtype):
    model_dir = tiny_model_dir("llama")
    engine, got, events = _run(model_dir, 4, dtype=dtype)
    assert engine.runner.decode_stack is not None and forwards_again[0] > 0, "no multi-step decode ran"
    assert max(max(e) for e in events) == 4 and all(sum(e) == n for e, n in zip(events, MAX_TOKENS))
    runs = forwards_again[0]
    _, want, single = _run(model_dir, 1, dtype=dtype)
    assert forwards_again[0] == runs and all(set(e) == {1} for e in single)
    assert got == want


def test_multi_step_equals_transformers_greedy(tiny_model_dir, forwards_again):
    from transformers import AutoModelForCausalLM

    from conftest import hf_greedy

    model_dir = tiny_model_dir("llama")
    _, got, _ = _run(model_dir, 8, dtype="float32", prompts=PROMPTS[:3])
    assert forwards_again[0] > 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    for prompt, tokens, n in zip(PROMPTS, got, MAX_TOKENS):
        assert tokens == hf_greedy(model, prompt, n)[0]


def test_a_stop_inside_a_group_drops_the_rest_and_frees_every_block(tiny_model_dir, forwards_again):
    model_dir = tiny_model_dir("llama")
    _, want, _ = _run(model_dir, 1, dtype="float32", prompts=PROMPTS[:3])
    # Each row stops at a token first seen at an output index inside a group of 4 (not at its end).
    params, cut = [], []
    for tokens, n in zip(want, MAX_TOKENS):
        i = next(i for i in range(5, len(tokens)) if i % 4 != 3 and tokens[i] not in tokens[:i])
        params.append(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop_token_ids=[tokens[i]]))
        cut.append(tokens[:i + 1])
    engine, got, events = _run(model_dir, 4, params, dtype="float32", prompts=PROMPTS[:3])
    assert forwards_again[0] > 0 and got == cut
    assert any(e[-1] < 4 for e in events)
    # The engine goes on serving: the same rows again, whole.
    _, again, _ = _run(model_dir, 4, engine=engine, prompts=PROMPTS[:3])
    assert again == want


def test_one_forward_a_step_while_requests_wait(tiny_model_dir, forwards_again):
    """Two rows at a time: while others wait for a row, a step is one forward (admission is not held back)."""
    engine = LLMEngine(model=str(tiny_model_dir("llama")), num_scheduler_steps=4, max_num_seqs=2, dtype="float32")
    seen = []
    original = engine.scheduler.reserve_lookahead

    def reserve(out, num_steps):
        seen.append(bool(engine.scheduler.waiting))
        return original(out, num_steps)

    engine.scheduler.reserve_lookahead = reserve
    _, got, _ = _run(None, 4, engine=engine)
    assert seen and not any(seen), "a lookahead was reserved while requests waited"
    assert forwards_again[0] > 0  # once the last ones run alone
    _, want, _ = _run(tiny_model_dir("llama"), 1, max_num_seqs=2, dtype="float32")
    assert got == want


def test_short_of_blocks_and_preempted_rows_give_the_same_tokens(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    # 14 blocks of 16 for 5 rows reaching 40-91 tokens: the lookahead runs short, rows are preempted.
    _, got, _ = _run(model_dir, 4, dtype="float32", num_kv_blocks=14)
    _, want, _ = _run(model_dir, 1, dtype="float32")
    assert got == want


def test_reserve_lookahead_all_rows_or_one_step(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir("llama")), num_kv_blocks=3, max_num_seqs=2)
    engine.add_request(None, PROMPTS[0][:15], greedy(4, ignore_eos=True))  # 1 block; with 3 tokens ahead: 2
    engine.step()
    seq = engine.scheduler.running[0]
    sched = engine.scheduler.schedule()
    assert engine.scheduler.reserve_lookahead(sched, 4) == 4 and len(seq.block_table) == 2
    sched2 = SchedulerOutput(scheduled=[(seq, 1)])
    assert engine.scheduler.reserve_lookahead(sched2, 40) == 1  # 2 more blocks: only 1 is free
    assert len(seq.block_table) == 2, "a failed lookahead took blocks"


def test_stop_multi_step_ends_a_step_at_its_next_forward(tiny_model_dir, forwards_again):
    model_dir = tiny_model_dir("llama")
    engine = LLMEngine(model=str(model_dir), num_scheduler_steps=4, max_num_seqs=8, dtype="float32")
    engine.stop_multi_step = lambda: True
    _, got, events = _run(None, 4, engine=engine)
    assert forwards_again[0] == 0 and all(set(e) == {1} for e in events)
    _, want, _ = _run(model_dir, 1, dtype="float32")
    assert got == want


def test_async_engine_stops_a_multi_step_for_queued_commands(tiny_model_dir):
    from pagedcore import AsyncLLMEngine

    engine = LLMEngine(model=str(tiny_model_dir("llama")), max_num_seqs=2)
    a = AsyncLLMEngine(engine)
    a.shutdown()  # the loop thread gone: nothing takes the command below off the queue
    assert engine.stop_multi_step is not None and engine.stop_multi_step() is False
    a._commands.put(("abort", "no-such-request"))
    assert engine.stop_multi_step() is True


def test_advance_equals_the_next_steps_build():
    """StepInputs.advance against the batch InputBatch builds after each row appended its token."""
    from types import SimpleNamespace

    batch = InputBatch(4, 128, 16)
    seqs = [SimpleNamespace(seq_id=i, token_ids=list(range(10, 10 + n)), block_table=[7 * i + b for b in range(4)],
                            num_computed_tokens=n - 1, num_draft_tokens=0, num_prompt_tokens=5, is_finished=False)
            for i, n in enumerate((15, 16, 31, 40))]
    sched = SchedulerOutput(scheduled=[(s, 1) for s in seqs])
    step = batch.apply(sched)
    for _ in range(3):
        new = [100 + s.seq_id for s in seqs]
        step.advance(torch.tensor(new).numpy(), 16)
        for s, t in zip(seqs, new):
            s.token_ids.append(t)
            s.num_computed_tokens += 1
        want = batch.apply(sched)
        for f in ("input_ids", "positions", "seq_lens", "slot_mapping", "block_table", "query_start_loc"):
            assert torch.equal(getattr(step, f), getattr(want, f)), f
        assert step.seq_lens_cpu == want.seq_lens_cpu and step.max_seq_len == want.max_seq_len


def test_num_scheduler_steps_is_checked():
    from pagedcore.config import EngineConfig

    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=0)
