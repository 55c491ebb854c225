"""`pagedcore bench serve` end to end: it launches each real front door (bentoml serve, tritonserver),
drives a tiny seeded Poisson workload through the real clients, writes the JSON report and stops
the servers. A tiny random-weight model keeps it quick; no timing thresholds, only consistency.
"""

from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("openai")
pytest.importorskip("bentoml")
pytest.importorskip("tritonclient.grpc.aio")
pytest.importorskip("pytriton")

from pagedcore.bench.workload import Workload  # noqa: E402

pytestmark = pytest.mark.slow

FRONTENDS = ["bentoml", "triton"]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, SEED = 4, (8, 24), (4, 8), 3
METRICS = ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"]


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory) -> dict:
    from pagedcore import cli

    out = tmp_path_factory.mktemp("bench-serve") / "serve.json"
    rc = cli.main(["bench", "serve", "--frontend", ",".join(FRONTENDS), "--model", str(tiny_model_dir("llama")),
                   "--num-prompts", str(NUM_PROMPTS), "--request-rate", "8", "--seed", str(SEED),
                   "--input-min", str(INPUT_LEN[0]), "--input-max", str(INPUT_LEN[1]),
                   "--output-min", str(OUTPUT_LEN[0]), "--output-max", str(OUTPUT_LEN[1]),
                   "--dtype", "float32", "--num-threads", "1", "--max-num-seqs", "8",
                   "--kv-cache-memory", str(16 << 20), "--max-model-len", "256", "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def output_lens(smollm2_tokenizer) -> list[int]:
    """The exact output lengths the command asked for (the workload is seeded)."""
    _, lens = Workload(NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, SEED).make(len(smollm2_tokenizer))
    return lens


def result(report: dict, frontend: str) -> dict:
    (r,) = [r for r in report["results"] if r["frontend"] == frontend]
    return r


def test_report_names_the_run(report):
    assert report["bench"] == "serve" and report["dtype"] == "float32"
    assert report["workload"]["num_prompts"] == NUM_PROMPTS and report["workload"]["request_rate"] == 8
    assert [r["frontend"] for r in report["results"]] == FRONTENDS


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_every_request_completes_with_its_exact_output_length(report, output_lens, frontend):
    r = result(report, frontend)
    assert r["num_requests"] == r["completed"] == NUM_PROMPTS and r["failed"] == 0, r["errors"]
    assert r["output_tokens"] == r["expected_output_tokens"] == sum(output_lens)
    assert r["length_mismatches"] == 0
    assert r["output_tok_s"] > 0 and r["requests_s"] > 0 and r["duration_s"] > 0


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_latency_percentiles_are_ordered(report, frontend):
    r = result(report, frontend)
    for name in METRICS:
        d = r[name]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (name, d)
        assert d["mean"] > 0, (name, d)


def test_both_doors_saw_the_same_prompts(report):
    assert len({result(report, f)["input_tokens"] for f in FRONTENDS}) == 1


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_the_launched_server_is_stopped_afterwards(report, frontend):
    host, port = result(report, frontend)["url"].removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        assert s.connect_ex((host, int(port))) != 0, f"{frontend} still listening on {host}:{port}"
