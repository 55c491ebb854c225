"""The engine under `python -O` (asserts stripped): same tokens, every block back in the pool.

No engine behaviour may hide in an assert statement; this runs a preempting, prefix-sharing,
n>1 workload in a child interpreter with and without -O and compares the results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
from pagedcore import LLM, SamplingParams
assert sys.flags.optimize == int(sys.argv[2])
llm = LLM(sys.argv[1], num_kv_blocks=24, block_size=4, max_num_seqs=8, preemption_mode=sys.argv[3],
          swap_min_tokens=8)
prompts = [[7 + (i * 13 + j) % 300 for j in range(10 + 3 * i)] for i in range(6)]
prompts.append(prompts[0] + [11, 12])  # prefix hit
params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)] * 6 + [
    SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6, ignore_eos=True)]
outs = llm.generate(prompts, params, use_tqdm=False)
kv = llm.engine.kv
print(json.dumps({"tokens": [[c.token_ids for c in o.outputs] for o in outs],
                  "preemptions": llm.engine.scheduler.num_preemptions,
                  "free": kv.num_free_blocks, "total": kv.num_blocks}))
"""


def _run(model_dir, optimize: bool, mode: str) -> dict:
    cmd = [sys.executable] + (["-O"] if optimize else []) + ["-c", SCRIPT, str(model_dir), str(int(optimize)), mode]
    # The torch paths (no C++ ops): this is about the engine's Python, and no child may wait on a build.
    env = dict(os.environ, PAGEDCORE_CPU_EXT="0", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_under_python_O_matches_and_frees_every_block(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    for mode in ("swap", "recompute"):
        plain, optimized = _run(model_dir, False, mode), _run(model_dir, True, mode)
        assert plain["preemptions"] > 0  # the workload does preempt
        assert optimized == plain
        assert optimized["free"] == optimized["total"]
