"""The short soak campaign the CI runs (the full one is `pagedcore bench soak`, README "Limits and
failure behaviour"): both front doors, hostile traffic past their limits, then idle and still serving."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("bentoml")
pytest.importorskip("tritonclient.grpc")

pytestmark = pytest.mark.slow


def test_short_soak_of_both_doors_completes_refuses_and_leaks_nothing(tmp_path, tiny_model_dir):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "-m", "pagedcore.cli", "bench", "soak", "--frontend", "bentoml,triton",
                        "--requests", "100", "--concurrency", "16", "--burst-every", "50", "--burst-size", "24",
                        "--cancel-rate", "0.2", "--max-concurrent-requests", "20", "--max-input-tokens", "64",
                        "--max-output", "64", "--model", str(tiny_model_dir("llama")), "--num-threads", "1",
                        "--num-kv-blocks", "256", "--max-model-len", "256", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [x["frontend"] for x in report["results"]] == ["bentoml", "triton"]
    for res in report["results"]:
        assert res["requests"] == 100 + 2 * 24  # two bursts
        assert res["failed"] == 0 and not res["leaks"] and res["still_serving"], res
        assert res["completed"] > 0 and res["cancelled"] > 0, res
        assert res["rejected"].get("invalid", 0) > 0, "over-long prompts must be refused"
        assert res["rejected"].get("overload", 0) > 0, "bursts past max_concurrent_requests must be refused"
        assert res["rejected_metrics"], "the door's metrics count rejections by reason"
