"""`pagedcore bench spec` runs end to end (tiny model, a few tokens) and writes its JSON report."""

from __future__ import annotations

import json

from pagedcore import cli


def test_bench_spec_writes_speedups_acceptance_and_the_threshold(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "spec.json"
    rc = cli.main(["bench", "spec", "--model", str(tiny_model_dir("llama")), "--batch-sizes", "1,2",
                   "--max-tokens", "6", "--repeats", "1", "--num-kv-blocks", "128", "--prompts", "grounded", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["bench"] == "spec" and report["speculative_config"]["method"] == "ngram"
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["identical_tokens"] and r["off"]["output_tok_s"] > 0 and r["speedup"] > 0
    costs = report["step_costs"]
    assert costs["batch_sizes"] == [1, 2] and len(costs["ratio"]) == 2
    assert isinstance(report["auto_off_max_batch_size"], int)
    assert "auto-off threshold" in capsys.readouterr().out
