"""`pagedcore bench lora` runs end to end (tiny model, a few tokens) and writes its JSON report."""

from __future__ import annotations

import json

from pagedcore import cli


def test_bench_lora_writes_throughput_per_adapter_count(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "lora.json"
    rc = cli.main(["bench", "lora", "--model", str(tiny_model_dir("llama")), "--num-adapters", "1,3",
                   "--batch-size", "6", "--prompt-len", "8", "--max-tokens", "4", "--repeats", "1", "--rank", "4",
                   "--num-kv-blocks", "64", "--adapter-dir", str(tmp_path / "adapters"), "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["workload"] for r in report["results"]] == ["base", "lora engine, base requests", "1 adapters",
                                                         "3 adapters"]
    assert all(r["output_tokens"] == 6 * 4 and r["output_tok_s"] > 0 for r in report["results"])
    assert report["results"][0]["cost_vs_base"] == 0
    assert len(list((tmp_path / "adapters").iterdir())) == 3
    assert "cost vs base" in capsys.readouterr().out
