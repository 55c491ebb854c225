"""Smoke runs of `pagedcore bench step` and `pagedcore bench linears`: the commands, their parts and JSON.
No timing asserts: CI proves the benchmarks run and report what they measured."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pagedcore import LLMEngine, SamplingParams, fused_projections, onednn_linear
from pagedcore.bench import linears, step_profile
from pagedcore.cli import main


def test_step_profile_parts_add_up_and_instrumentation_is_removed(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir("llama")), num_kv_blocks=64, max_num_seqs=4)
    before = {id(m): m.__dict__.get("forward") for m in engine.model.modules()}
    fused = fused_projections.installed(engine.model)
    runs = [f.run for f in fused]
    assert len(fused) == 4  # q/k/v and gate/up of 2 layers: decode's matmuls, timed as GEMMs too
    with step_profile.instrument(engine, step_profile.StepTimers()):
        assert all(f.run is not r for f, r in zip(fused, runs))
    # 200 positions: the tiny model's attention phase then takes more than the 0.01 ms the rows are rounded to
    rows = step_profile.run(engine, batches=(1, 4), read_gbs=10.0, matmul_tflops=0.05, prompt_len=200, steps=3)
    for row in rows:
        # The decode stack's step, split by the stack's own phase timers, then the same batch layer by layer.
        assert row["decode_stack"] and row["gemm"] > 0 and row["attention"] > 0 and row["other_forward"] >= 0
        layered = row["layered"]
        assert not layered["decode_stack"] and layered["gemm"] > 0 and layered["attention"] > 0
        for r in (row, layered):
            parts = [r[p] for p in step_profile.PARTS]
            assert all(v >= 0 for v in parts if v is not None)
            assert sum(v for v in parts if v is not None) == pytest.approx(r["step_ms"], rel=0.05, abs=0.1)
        assert row["weight_read_ms"] > 0 and row["matmul_ms"] > 0
    assert rows[1]["matmul_ms"] == pytest.approx(4 * rows[0]["matmul_ms"], rel=0.05)
    # Nothing of the timers stays behind: same forwards, sampler and runner methods as before.
    assert {id(m): m.__dict__.get("forward") for m in engine.model.modules()} == before
    assert [f.run for f in fused] == runs
    assert "prepare" not in vars(engine.runner) and "sampler" in vars(engine) and callable(engine.sampler.plain_greedy)
    stack = engine.runner.decode_stack.stack  # its phase timers are off again: a plain step adds nothing
    engine.add_request(None, [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert stack.take_profile() == (0.0, 0.0, 0.0, 0)
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks



def test_the_stack_row_is_the_fastest_of_its_repeats(tiny_model_dir, monkeypatch):
    """Each repeat a fresh batch through _profile; the decode stack's row is the fastest, the layered one runs once."""
    engine = LLMEngine(model=str(tiny_model_dir("llama")), num_kv_blocks=64, max_num_seqs=4)
    real, seen = step_profile._profile, []

    def recorded(*args, **kwargs):
        row = real(*args, **kwargs)
        seen.append((kwargs["per_module"], row))
        return row

    monkeypatch.setattr(step_profile, "_profile", recorded)
    row = step_profile.profile_decode(engine, 2, prompt_len=12, steps=2, repeats=3)
    stack_rows = [r for per_module, r in seen if not per_module]
    assert len(stack_rows) == 3 and [per_module for per_module, _ in seen].count(True) == 1
    assert row["step_ms"] == min(r["step_ms"] for r in stack_rows) and row in stack_rows
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_each_batch_floors_use_the_reads_probed_around_its_profile(tiny_model_dir, monkeypatch):
    """With a read probe, each batch's weight and K/V floors come from the larger of the reads probed just before
    and just after its profile, not from one probe for the whole run."""
    engine = LLMEngine(model=str(tiny_model_dir("llama")), num_kv_blocks=64, max_num_seqs=4)
    events, probes = [], iter([10.0, 20.0, 40.0, 30.0])

    def probe():
        events.append("probe")
        return next(probes)

    def profiled(engine, batch, *args):
        events.append(f"profile {batch}")
        return {"batch": batch, "step_ms": 1.0, "forwards": 10, "forwards_per_step": 1.0}

    monkeypatch.setattr(step_profile, "profile_decode", profiled)
    rows = step_profile.run(engine, batches=(1, 4), read_gbs=5.0, matmul_tflops=0.05, read_probe=probe)
    assert events == ["probe", "profile 1", "probe", "probe", "profile 4", "probe"]
    assert [r["read_gbs"] for r in rows] == [20.0, 40.0]
    # Floors at those bandwidths: the weights take twice as long at 20 GB/s as at 40.
    assert rows[0]["weight_read_ms"] == pytest.approx(2 * rows[1]["weight_read_ms"], rel=0.02)
    fixed = step_profile.run(engine, batches=(1,), read_gbs=20.0, matmul_tflops=0.05)  # no probe: the given read
    assert fixed[0]["read_gbs"] == 20.0 and fixed[0]["weight_read_ms"] == rows[0]["weight_read_ms"]


def test_bench_step_cli(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "step.json"
    rc = main(["bench", "step", "--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--batches", "1,2",
               "--prompt-len", "12", "--steps", "2", "--num-threads", "1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 2]
    assert "other_forward" in capsys.readouterr().out


def test_bench_step_stack_ab_cli(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "ab.json"
    rc = main(["bench", "step", "--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--batches", "1,2",
               "--prompt-len", "12", "--steps", "2", "--num-threads", "1", "--stack-ab", "2", "--json", str(out)])
    assert rc == 0
    ab = json.loads(out.read_text())["stack_ab"]
    assert list(ab) == ["decode stack", "layer by layer"]
    for path, rows in ab.items():
        assert [r["batch"] for r in rows] == [1, 2] and all(r["step_ms"] > 0 for r in rows)
        assert all(r["decode_stack"] == (path == "decode stack") for r in rows)
    assert "layer by layer: best of 2" in capsys.readouterr().out


def test_bench_linears_cli(tmp_path, capsys):
    out = tmp_path / "lin.json"
    rc = main(["bench", "linears", "--dtype", "bfloat16", "--m", "1,8", "--shapes", "k_proj/v_proj",
               "--seconds", "0.05", "--num-threads", "1", "--copies-mib", "4", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    impls = {(r["impl"], r["m"]) for r in report["rows"]}
    assert ("packed", 1) in impls and ("packed", 8) in impls and ("int4", 1) in impls
    assert (("onednn", 8) in impls) == onednn_linear.available()  # AVX2-only CPUs: oneDNN packs no bf16
    assert ("stack", 1) in impls and ("stack", 8) in impls
    assert all(r["us"] > 0 and math.isfinite(r["us"]) for r in report["rows"])
    assert report["read_gbs"] > 0 and report["matmul_tflops"] > 0
    assert [t["name"] for t in report["targets"]] == ["k_proj/v_proj M=1 fraction of read bandwidth"]
    stack_row = next(r for r in report["rows"] if (r["impl"], r["m"]) == ("stack", 1))
    assert report["targets"][0]["value"] == round(stack_row["bw_frac"], 3)  # the row the engine's decode runs
    assert all(r["read_gbs"] > 0 and r["bw_frac"] == r["gbs"] / r["read_gbs"] for r in report["rows"])


def test_bench_linears_fractions_against_the_reads_probed_beside_each_m():
    """Each M's rows against the larger of the read probes just before and after them, not the run's first probe."""
    probes = iter([10.0, 30.0, 50.0, 20.0])
    rows = linears.bench_shape("k", 192, 576, [1, 8], torch.bfloat16, ["packed"], 999.0, 1.0, 0.02, copies_mib=2,
                               read_probe=lambda: next(probes))
    assert [(r.m, r.read_gbs) for r in rows] == [(1, 30.0), (8, 50.0)]
    assert all(r.bw_frac == r.gbs / r.read_gbs for r in rows)


def test_bench_linears_weights_where_the_engine_keeps_them(monkeypatch):
    """The packed copies (and int4's) move into huge pages as the engine's weights do (huge_pages.install)."""
    from pagedcore import huge_pages

    moved = []
    monkeypatch.setattr(huge_pages, "adopt", lambda ts: moved.append(list(ts)) or 0)
    linears.bench_shape("k", 192, 576, [1], torch.bfloat16, ["packed", "int4"], 50.0, 1.0, 0.02, copies_mib=2)
    assert len(moved) == 2 and all(len(ts) >= 2 for ts in moved)


def test_read_probe_reads_one_huge_page_buffer():
    """The read ceiling is read through 2 MiB pages where the C++ ops give them (4 KiB pages read slower here), one
    buffer a process."""
    from pagedcore.bench import roofline
    from pagedcore.kernels import cpu_ext

    x = roofline.read_buffer(4)
    assert x is roofline.read_buffer(4) and x.dtype == torch.float32 and x.nbytes == 4 << 20
    assert bool((x == 1).all())
    if cpu_ext.load() is not None:
        assert x.data_ptr() % (2 << 20) == 0
    assert roofline.read_bandwidth_gbs(0.01, mib=4) > 0


def test_linear_shapes_of_smollm2(smollm2_dir):
    from transformers import AutoConfig

    shapes = linears.model_shapes(AutoConfig.from_pretrained(str(smollm2_dir)))
    assert shapes["q_proj"] == (576, 576) and shapes["k_proj/v_proj"] == (192, 576)
    assert shapes["gate_proj/up_proj"] == (1536, 576) and shapes["down_proj"] == (576, 1536)
    assert shapes["lm_head"] == (49152, 576)
    assert shapes["qkv (fused)"] == (960, 576) and shapes["gate_up (fused)"] == (3072, 576)


def test_linear_targets():
    row = lambda m, impl, bw, peak: linears.Row("q", 1, 1, m, impl, 1.0, 1.0, 1.0, bw, peak)
    got = linears.targets([row(1, "packed", 0.85, 0.0), row(512, "packed", 0.0, 0.5), row(1, "F.linear", 0.1, 0),
                           row(64, "packed", 0.1, 0.1)])
    assert [(t["name"], t["met"]) for t in got] == [("q M=1 fraction of read bandwidth", True),
                                                    ("q M=512 fraction of matmul peak", False)]
    # Where the engine runs oneDNN from 3 rows (bf16, AMX CPUs): the M=512 target is oneDNN's row.
    rows = [row(1, "packed", 0.85, 0.0), row(512, "packed", 0.0, 0.5), row(512, "onednn", 0.0, 0.9)]
    got = linears.targets(rows, torch.bfloat16, onednn_rows=3)
    assert [(t["name"], t["value"], t["met"]) for t in got] == [("q M=1 fraction of read bandwidth", 0.85, True),
                                                                ("q M=512 fraction of matmul peak", 0.9, True)]
    assert [t["value"] for t in linears.targets(rows, torch.float32, onednn_rows=3)] == [0.85, 0.5]
    # Where the stack's row was timed, decode's M=1 target is that row (the prompt's M=512 stays the panels').
    rows = [row(1, "packed", 0.7, 0.0), row(1, "stack", 0.82, 0.0), row(512, "packed", 0.0, 0.9)]
    assert [(t["value"], t["met"]) for t in linears.targets(rows)] == [(0.82, True), (0.9, True)]
