"""Engine replicas behind each framework's own scaling (README "Replicas"): Triton's instance_group
count and BentoML's workers each run one engine per replica, and each replica exports the gateway's
load signals as its own series."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import requests

from pagedcore.distributed.launch import free_port

pytestmark = pytest.mark.slow

GATEWAY = ("pagedcore:num_requests_waiting", "pagedcore:num_requests_running", "pagedcore:kv_cache_usage_perc")
SETTINGS = dict(dtype="float32", num_kv_blocks=32, max_num_seqs=4, num_threads=1)


def series(text: str, name: str) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} \S+$", text, re.M)]


def test_triton_instance_group_count_2_exports_each_replica(tiny_model_dir, tmp_path):
    pytest.importorskip("pytriton")
    from pagedcore.adapters.triton_launcher import DEFAULT_REPOSITORY, TritonServer

    repo = tmp_path / "repo"
    shutil.copytree(DEFAULT_REPOSITORY, repo, symlinks=False)
    config = repo / "pagedcore" / "config.pbtxt"
    text = config.read_text()
    assert "{ count: 1, kind: KIND_CPU }" in text
    config.write_text(text.replace("{ count: 1, kind: KIND_CPU }", "{ count: 2, kind: KIND_CPU }"))
    http, grpc, metrics = free_port(), free_port(), free_port()
    server = TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, log_path=tmp_path / "triton.log",
                          engine_settings=dict(SETTINGS, model=str(tiny_model_dir("llama"))))
    server.start()
    try:
        server.wait_ready(timeout=240)
        deadline = time.monotonic() + 30
        while True:
            text = requests.get(server.metrics_url, timeout=10).text
            found = {name: series(text, name) for name in GATEWAY}
            if all(len(v) == 2 for v in found.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for name, labels in found.items():
            assert sorted(re.search(r'model_instance="([^"]+)"', lab).group(1) for lab in labels) == \
                ["pagedcore_0_0", "pagedcore_0_1"], (name, labels)
    finally:
        server.stop(timeout=60)


def test_bentoml_workers_2_exports_each_replica(tiny_model_dir, tmp_path):
    pytest.importorskip("bentoml")
    port = free_port()
    env = {**os.environ, "BENTOML_HOME": str(tmp_path), "BENTOML_DO_NOT_TRACK": "True",
           "BENTOML_CONFIG_OPTIONS": "services.pagedcore.workers=2", "PAGEDCORE_MODEL": str(tiny_model_dir("llama")),
           **{f"PAGEDCORE_{k.upper()}": str(v) for k, v in SETTINGS.items()}}
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "bentoml", "serve", "pagedcore.adapters.bentoml_service:PagedCore",
                             "--host", "127.0.0.1", "--port", str(port)], cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        found = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, open(tmp_path / "server.log").read()[-4000:]
            try:
                text = requests.get(f"{base}/metrics", timeout=5).text
                found = {name: series(text, name) for name in GATEWAY}
                if all(len(v) == 2 for v in found.values()):
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        for name, labels in found.items():
            pids = {re.search(r'pid="(\d+)"', lab).group(1) for lab in labels}
            assert len(pids) == 2, (name, labels)
        assert len(found) == len(GATEWAY)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        log.close()
