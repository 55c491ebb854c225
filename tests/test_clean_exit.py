"""Issue 15.5: the README's AsyncLLMEngine snippet, left early under asyncio.run, exits with code 0.

Before the engine shut down deterministically (atexit hook, joined thread) its daemon step thread
could still be inside torch while the interpreter tore down: `terminate called without an active
exception`, exit code 134, in about 1 run in 10 with this tiny model (3 in 6 with SmolLM2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RUNS = 20


def test_readme_async_snippet_left_early_exits_0_in_20_fresh_processes(tiny_model_dir):
    script = Path(__file__).with_name("readme_async_snippet.py")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, str(script), str(tiny_model_dir("llama")), str(RUNS), "4"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    codes = r.stdout.rsplit("EXIT CODES", 1)[-1].split()
    assert len(codes) == RUNS, r.stdout[-2000:]
    assert codes == ["0"] * RUNS, f"exit codes {codes}\n{r.stderr[-3000:]}"
