"""Smoke run of `pagedcore bench throughput` with its peers: the command, the peer subprocesses and the
JSON it writes. No timing asserts: CI only proves the benchmark still runs and reports what it measured."""

from __future__ import annotations

import json

import pytest

from pagedcore.bench.peers import PEERS, find_python, parse_peers
from pagedcore.cli import main


@pytest.fixture
def no_peer_venvs(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCORE_PEERS_DIR", str(tmp_path / "no-peers"))


def test_throughput_smoke_with_peers(tiny_model_dir, tmp_path, no_peer_venvs, capsys):
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", str(tiny_model_dir("llama")), "--dtype", "float32",
               "--num-prompts", "4", "--input-min", "8", "--input-max", "24", "--output-min", "3",
               "--output-max", "6", "--num-threads", "1", "--peers", "all", "--stream-input", "8",
               "--stream-output", "4", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = {r["peer"]: r for r in report["results"]}
    assert list(rows) == ["pagedcore", "hf-static", "hf-cb", "vllm", "llama-cpp"]
    ours = rows["pagedcore"]
    assert ours["num_requests"] == 4
    assert ours["output_tokens"] == sum(requested_output_lens(report, tiny_model_dir("llama")))  # exact, EOS ignored
    for peer in ("hf-static", "hf-cb"):  # transformers is installed with pagedcore: they run
        assert "skipped" not in rows[peer], rows[peer]
        assert rows[peer]["output_tokens"] == ours["output_tokens"]
        assert report["ratios"][peer] == pytest.approx(ours["output_tok_s"] / rows[peer]["output_tok_s"], rel=1e-2)
    assert "setup_peers.sh vllm" in rows["vllm"]["skipped"]  # says how to install it
    assert "skipped" in rows["llama-cpp"]
    single = {r["peer"]: r for r in report["single_stream"]}
    assert single["pagedcore"]["output_tokens"] == 4 and single["pagedcore"]["tpot_s"] > 0
    assert 0 <= report["kv_waste_pct"] < 100
    assert report["roofline"]["matmul_tflops"] > 0 and 0 < report["roofline"]["fraction"]
    assert report["cold_start_s"] > 0 and report["cold_start_s"] == min(report["cold_start_samples_s"])
    assert len(report["cold_start_samples_s"]) == 3
    names = {t["name"]: t for t in report["targets"]}
    assert names["output tok/s vs vllm"]["met"] is None  # not measured, not claimed
    assert names["output tok/s vs hf-static"]["met"] in (True, False)
    printed = capsys.readouterr().out
    assert "skipped: not installed" in printed and "pagedcore x" in printed


def requested_output_lens(report, model_dir) -> list[int]:
    from transformers import AutoConfig

    from pagedcore.bench.workload import Workload

    w = report["workload"]
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    return Workload(w["num_prompts"], tuple(w["input_len"]), tuple(w["output_len"]), w["seed"]).make(vocab)[1]


def test_unknown_peer_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown peer"):
        parse_peers("hf-static,nope")
    assert [p.name for p in parse_peers("all")] == list(PEERS)


def test_missing_peer_names_the_setup_command(no_peer_venvs):
    python, why = find_python(PEERS["llama-cpp"])
    assert python is None and "benchmarks/setup_peers.sh llama-cpp" in why


def test_prefix_bench_smoke(tiny_model_dir, tmp_path):
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--model", str(tiny_model_dir("llama")), "--system-tokens", "64",
                 "--num-requests", "2", "--num-kv-blocks", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ttft_off_s"] > 0 and report["ttft_on_s"] > 0 and report["speedup"] > 0
