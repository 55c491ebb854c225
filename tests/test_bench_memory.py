"""`pagedcore bench memory` on a tiny random model: honest KV accounting, concurrency under a budget,
n-sample sharing, and every block back in the pool afterwards."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedcore import LLMEngine, SamplingParams, hookimpl
from pagedcore.bench import memory
from pagedcore.bench.workload import Workload

BLOCK = 16
# 8 short sequences (2-4 blocks each) in a 12-block budget: more than fits at once.
SMALL = ["--num-prompts", "8", "--input-min", "16", "--input-max", "40", "--output-min", "4", "--output-max", "12",
         "--kv-budget-mib", "0.05", "--max-model-len", "512", "--share-prompt-tokens", "200",
         "--share-output-tokens", "8", "--dtype", "float32", "--num-threads", "1"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    memory.add_parser(parser.add_subparsers())
    return parser.parse_args(["memory", *argv])


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "memory.json"
    assert memory.main(parse(["--model", str(tiny_model_dir("llama")), *SMALL, "--json", str(out)])) == 0
    return json.loads(out.read_text())


def engine_for(tiny_model_dir, plugins=(), **settings) -> LLMEngine:
    return LLMEngine(model=str(tiny_model_dir("llama")), dtype="float32", block_size=BLOCK, num_threads=1,
                     plugins=plugins, **settings)


def test_waste_is_a_share_of_allocated_slots(report):
    w = report["waste"]
    assert w["steps"] > 0
    assert 0 <= w["mean_pct"] <= w["max_pct"] < 100
    # A contiguous 512-token reservation per sequence wastes far more than pages do.
    assert w["contiguous_pct"] > w["mean_pct"]
    assert report["block_size"] == BLOCK


def test_paged_fits_more_sequences_than_a_contiguous_reservation(report):
    c = report["concurrency"]
    # fp32 tiny model: 2 layers x 16 tokens x 2 KV heads x 16 dims x 4 bytes, for K and V.
    assert c["bytes_per_block"] == 2 * 2 * BLOCK * 2 * 16 * 4
    assert c["budget_blocks"] == int(0.05 * 2**20) // c["bytes_per_block"]
    assert c["contiguous"] == 0  # 512 tokens per sequence > the whole 0.05 MiB budget
    assert c["contiguous"] < c["paged_computed"] < 8  # the budget is smaller than the workload needs
    # Admission reserves only the prompt's blocks, so the peak may pass the full-length estimate a little
    # (preemption then makes room); it can never pass one block per running sequence.
    assert c["contiguous"] < c["paged_observed"] <= min(c["budget_blocks"], 8)
    assert c["paged_observed"] <= c["paged_computed"] + 2
    assert 0 < c["paged_observed_mean"] <= c["paged_observed"]


def test_n_samples_hold_fewer_blocks_than_independent_requests(report):
    s = report["sharing"]
    per_seq = -(-(s["prompt_tokens"] + s["output_tokens"]) // BLOCK)
    assert s["blocks_independent"] == s["n"] * per_seq
    assert s["blocks_shared"] < s["blocks_independent"]
    # The prompt's full blocks once, plus each sample's own tail (the copied partial block and growth).
    assert s["blocks_shared"] <= s["prompt_tokens"] // BLOCK + s["n"] * 2
    assert s["saving_pct"] == pytest.approx(100 * (1 - s["blocks_shared"] / s["blocks_independent"]), abs=0.01)


class IndependentCount:
    """Waste counted the plain way (pool blocks in use, computed tokens of running sequences): right
    whenever no block is shared, as in the random-prompt workload."""

    def __init__(self):
        self.engine, self.slots, self.tokens, self.steps = None, 0, 0, 0

    @hookimpl
    def pagedcore_step_end(self, stats):
        kv, running = self.engine.kv, self.engine.scheduler.running
        used = kv.num_blocks - kv.num_free_blocks
        if used == 0:
            return
        tokens = sum(s.num_computed_tokens for s in running)
        assert used * BLOCK >= tokens
        self.slots, self.tokens, self.steps = self.slots + used * BLOCK, self.tokens + tokens, self.steps + 1


def test_waste_matches_an_independent_count_and_every_block_returns(tiny_model_dir):
    count = IndependentCount()
    engine = engine_for(tiny_model_dir, plugins=[count], num_kv_blocks=64)
    count.engine = engine
    prompts, out_lens = Workload(6, (10, 50), (3, 20), seed=1).make(engine.vocab_size)
    trace = memory.run_workload(engine, prompts, out_lens, max_model_len=512)
    assert trace.steps == count.steps > 0
    assert trace.mean_pct == pytest.approx(100 * (1 - count.tokens / count.slots))
    assert trace.unaccounted_blocks == 0
    kv = engine.kv
    assert kv.num_free_blocks == kv.num_blocks, "device blocks leaked"
    # Prefix caching is on: finished prompts' full blocks stay cached, yet they are free, not used.
    assert kv.pool.cached_blocks
    assert memory.kv_snapshot(engine).blocks_used == 0


def test_forked_samples_count_the_shared_prompt_once(tiny_model_dir):
    engine = engine_for(tiny_model_dir, num_kv_blocks=64, enable_prefix_caching=False)
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks and a partial one
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True))
    engine.step()  # the prefill: the 4 samples fork the prompt's blocks
    snap = memory.kv_snapshot(engine)
    assert snap.num_running == 4
    assert snap.blocks_used == snap.pool_blocks_used == 4  # not 16: one copy of the prompt
    assert snap.tokens_stored == 50
    while engine.has_unfinished_requests():
        engine.step()
        snap = memory.kv_snapshot(engine)
        assert snap.blocks_used == snap.pool_blocks_used
        assert snap.tokens_stored <= snap.blocks_used * BLOCK
    memory.check_pool_whole(engine)


def test_snapshot_shortcut_equals_the_block_walk(tiny_model_dir):
    """kv_snapshot counts unshared tables per sequence; with forks (shared blocks) it walks the blocks: both
    equal the block-by-block count at every step."""
    engine = engine_for(tiny_model_dir, num_kv_blocks=64, enable_prefix_caching=False)
    engine.add_request("n3", list(range(100, 140)), SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=5,
                                                                   ignore_eos=True))
    for i in range(3):
        prompt = list(range(200 + i, 223 + 7 * i))
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4 + i, ignore_eos=True))
    shared = unshared = 0
    while engine.has_unfinished_requests():
        engine.step()
        snap = memory.kv_snapshot(engine)
        running = engine.scheduler.running
        assert (snap.blocks_used, snap.tokens_stored) == memory.blocks_and_tokens(running, BLOCK)
        held = sum(len(s.block_table) for s in running)
        shared += snap.blocks_used < held
        unshared += snap.blocks_used == held > 0
    assert shared and unshared  # both counts ran
    memory.check_pool_whole(engine)


def test_budget_smaller_than_the_longest_sequence_is_a_clear_error(tiny_model_dir):
    args = parse(["--model", str(tiny_model_dir("llama")), *SMALL, "--kv-budget-mib", "0.01"])
    with pytest.raises(ValueError, match="less than the longest sequence"):
        memory.main(args)


def test_weights_counts_resident_bytes_per_format(tiny_model_dir, tmp_path):
    """Dense fp32 vs int4 on the tiny model: every storage once; int4 linears hold 4-bit codes plus an fp16
    scale and min per 32 weights (0.625 bytes a weight), the dense ones fp32 plus the packed copy."""
    d = str(tiny_model_dir("llama"))
    out = tmp_path / "weights.json"
    assert memory.main(parse(["--weights", d, "--weights", f"{d}@int4", "--weights", f"{d}@int4:64", "--dtype",
                              "float32", "--num-threads", "1", "--json", str(out)])) == 0
    report = json.loads(out.read_text())
    dense, int4, int4_64 = report["weights"]
    layer = 64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3  # q, o; k, v (2 KV heads of 16); gate, up, down
    linear_weights = 2 * layer + 49152 * 64  # + the untied LM head
    # embedding, two norms per layer, the final norm; rotary inv_freq (head_dim / 2) and its original copy
    other = (49152 * 64 + 2 * 2 * 64 + 64 + 2 * 8) * 4
    assert dense["other"] == int4["other"] == other
    assert (dense["num_quantized"], int4["num_quantized"]) == (0, 15)
    assert dense["linear"] >= 4 * linear_weights  # fp32 (the packed copy, where the C++ ops load, on top)
    assert int4["linear"] == int4["linear_quantized"]
    assert int4["linear"] == 0.625 * linear_weights  # every width a multiple of 16 and of 32: no padding
    assert int4["total_vs_first"] == round(int4["total"] / dense["total"], 3) < 1
    assert int4_64["linear"] == 0.5625 * linear_weights  # groups of 64: half the scale bytes
    # ratios to one dense 16-bit copy of the parameters (the buffers are not weights)
    assert report["dense_bf16_bytes"] == 2 * (linear_weights + 49152 * 64 + 2 * 2 * 64 + 64)
    assert int4_64["total_vs_bf16"] == round(int4_64["total"] / report["dense_bf16_bytes"], 3)
    for row in (dense, int4, int4_64):  # one stream timed per format
        assert row["tpot_ms"] > 0 and row["tok_s"] == pytest.approx(1e3 / row["tpot_ms"], rel=0.02)


def test_kv_capacity_per_kv_cache_dtype(report):
    rows = {r["kv_cache_dtype"]: r for r in report["kv_capacity"]}
    assert list(rows) == ["auto", "int8", "fp8_e4m3"]
    auto, int8 = rows["auto"], rows["int8"]
    # fp32 tiny model (head_dim 16): 4 bytes a value; int8 1 byte a value plus a 2-byte scale per token and head.
    assert auto["bytes_per_block"] == report["concurrency"]["bytes_per_block"]
    assert int8["bytes_per_block"] == 2 * 2 * BLOCK * 2 * (16 + 2)
    assert rows["fp8_e4m3"]["bytes_per_block"] == int8["bytes_per_block"]
    for r in rows.values():
        assert r["budget_blocks"] == int(0.05 * 2**20) // r["bytes_per_block"]
        assert r["max_seqs"] == r["budget_blocks"] // -(-r["seq_len"] // BLOCK)
        assert r["vs_model_dtype"] == pytest.approx(r["budget_blocks"] / auto["budget_blocks"], abs=1e-3)
        assert 0 <= r["agreement"] <= 1 and 0 <= r["identical_prompts"] <= r["num_prompts"] == 8
    assert auto["agreement"] == 1 and auto["identical_prompts"] == 8  # the reference against itself
    assert int8["budget_blocks"] >= 3 * auto["budget_blocks"]
    rendered = dict(memory.table_rows(report))
    assert any("kv_cache_dtype int8" in k for k in rendered)
