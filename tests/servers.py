"""Real `bentoml serve` processes for the tests, launched, awaited and stopped by the benchmark's own
launcher (pagedcore/bench/serve.py), so tests and benchmarks start servers one way."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pagedcore.bench.serve import Server, free_ports, spawn, stop, wait_ready  # noqa: F401 (re-exported)

SERVICE = "pagedcore.adapters.bentoml_service:PagedCore"


def bentoml_serve(home: Path, settings: dict, service: str = SERVICE) -> Server:
    """`bentoml serve SERVICE` on a free loopback port with PAGEDCORE_* settings, in its own session
    (stop() ends it and its worker); call wait_ready(server, timeout) before using it."""
    port, = free_ports(1)
    env = {**os.environ, "BENTOML_HOME": str(home), "BENTOML_DO_NOT_TRACK": "True", "TOKENIZERS_PARALLELISM": "false",
           **{f"PAGEDCORE_{k.upper()}": str(v) for k, v in settings.items()}}
    cmd = [sys.executable, "-m", "bentoml", "serve", service, "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    return Server(spawn(cmd, env, home), base, f"{base}/readyz", home / "server.log", f"{base}/metrics")
