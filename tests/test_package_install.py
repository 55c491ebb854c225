"""pagedcore as a user installs it: the wheel built from this checkout's sdist, installed (not editable)
into a fresh virtualenv and run from a directory outside the checkout. Both front doors start with
`pagedcore serve-*` on loopback, answer one request from their real clients, and stop.

The fresh venv holds pagedcore alone (`--no-deps`); a .pth file lends it this environment's
site-packages, so torch stays the pinned build already here and nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
openai = pytest.importorskip("openai")
pytest.importorskip("pytriton")
pytest.importorskip("bentoml")
pytest.importorskip("setuptools")  # the build backend; --no-build-isolation keeps the build offline

from pagedcore.bench.serve import free_ports  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".hypothesis", "tmp")
STARTUP_TIMEOUT = 150
MAX_TOKENS = 4
# The tiny model's engine, the same at both doors: float32, one thread, a few KB of KV cache.
ENGINE = dict(dtype="float32", num_threads=1, num_kv_blocks=64, max_num_seqs=4, max_model_len=256)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


# ---- build, install ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """sdist from a copy of the checkout (MANIFEST.in decides what it holds), then the wheel from the sdist."""
    tmp = tmp_path_factory.mktemp("package")
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCES)
    sdist = run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                 "print(build_meta.build_sdist(sys.argv[1]))", dist], cwd=src).stdout.strip().splitlines()[-1]
    with tarfile.open(dist / sdist) as tar:
        tar.extractall(tmp / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (unpacked,) = (tmp / "unpacked").iterdir()
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", dist,
         unpacked])
    (whl,) = dist.glob("pagedcore-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # Lines of a .pth are appended to sys.path; .pth files inside them (this checkout's editable
    # install) are not run, so `import pagedcore` can only find the wheel's copy.
    here = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    (purelib / "zz_borrowed_site_packages.pth").write_text("\n".join(dict.fromkeys(here)) + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel])
    return venv


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """The working directory of every installed command: not the checkout, not below it."""
    d = tmp_path_factory.mktemp("user")
    assert ROOT not in d.resolve().parents
    return d


def user_env(venv: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET")}
    return {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **extra}


def test_wheel_ships_the_model_repository_kernel_sources_and_bench_scripts(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    repository = {f"pagedcore/model_repository/{p.relative_to(ROOT / 'model_repository')}"
                  for p in (ROOT / "model_repository").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    csrc = {f"pagedcore/kernels/csrc/{p.name}" for p in (ROOT / "kernels" / "csrc").iterdir() if p.is_file()}
    assert {"pagedcore/model_repository/pagedcore/config.pbtxt", "pagedcore/model_repository/pagedcore/1/model.py",
            "pagedcore/model_repository/pagedcore/1/model.json"} <= repository
    assert repository <= names, sorted(repository - names)
    assert csrc and csrc <= names, sorted(csrc - names)
    assert {"pagedcore/bench/setup_peers.sh", "pagedcore/bench/attention.py", "pagedcore/cli.py"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_installed_package_is_the_wheel_and_finds_its_data(venv, outside):
    code = ("import json, torch, pagedcore; from pagedcore.adapters import triton_launcher; "
            "from pagedcore.kernels import cpu_ext; "
            "print(json.dumps({'pagedcore': pagedcore.__file__, 'torch': torch.__version__, "
            "'repository': str(triton_launcher.DEFAULT_REPOSITORY), "
            "'config': (triton_launcher.DEFAULT_REPOSITORY / 'pagedcore' / 'config.pbtxt').is_file(), "
            "'sources': all(p.is_file() for p in cpu_ext.SOURCES)}))")
    info = json.loads(run([venv / "bin" / "python", "-c", code], cwd=outside, env=user_env(venv)).stdout)
    assert Path(info["pagedcore"]).is_relative_to(venv), info  # the wheel's copy, not the checkout
    assert Path(info["repository"]).is_relative_to(venv) and info["config"], info
    assert info["sources"], info
    assert info["torch"].startswith("2.13.0"), info  # the pinned torch, not a new download


# ---- the two doors, launched as a user would -----------------------------------------------------------
def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    tail = lambda: log.read_text(errors="replace")[-4000:]
    while True:
        assert proc.poll() is None, f"exited with code {proc.returncode}:\n{tail()}"
        assert time.monotonic() < deadline, f"not ready in {STARTUP_TIMEOUT} s:\n{tail()}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)


def stop(proc: subprocess.Popen, port: int) -> None:
    """SIGTERM to the command (each door shuts its workers down), then SIGKILL to whatever is left of
    its process group (its own session: only what this test started)."""
    try:
        proc.terminate()
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, f"still listening on {port} after stop"


def launch(venv: Path, outside: Path, args: list, log: Path, **env: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([str(venv / "bin" / "pagedcore"), *map(str, args)], cwd=outside,
                                env=user_env(venv, **env), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def test_serve_triton_answers_a_grpc_stream(venv, outside, tiny_model_dir):
    http, grpc, metrics = free_ports(3)
    settings = {"model": str(tiny_model_dir("llama")), **ENGINE}
    log = outside / "serve-triton.log"
    proc = launch(venv, outside, ["serve-triton", "--http-port", http, "--grpc-port", grpc, "--metrics-port", metrics,
                                  *(f"--set={k}={json.dumps(v)}" for k, v in settings.items())], log)
    try:
        wait_ready(proc, f"http://127.0.0.1:{http}/v2/health/ready", log)
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            inputs = []
            for name, value, dtype in [("text_input", b"Hello, Triton", "BYTES"), ("stream", True, "BOOL"),
                                       ("sampling_parameters", json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS,
                                                                           "ignore_eos": True}).encode(), "BYTES"),
                                       ("return_num_output_tokens", True, "BOOL")]:
                t = grpcclient.InferInput(name, [1], dtype)
                t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else bool))
                inputs.append(t)
            client.async_stream_infer("pagedcore", inputs, enable_empty_final_response=True)
            results = []
            while not results or not results[-1].get_response().parameters["triton_final_response"].bool_param:
                result, error = responses.get(timeout=60)
                assert error is None, error
                results.append(result)
        finally:
            client.stop_stream()
            client.close()
        tokens = sum(int(r.as_numpy("num_output_tokens").sum()) for r in results
                     if r.as_numpy("num_output_tokens") is not None)
        assert tokens == MAX_TOKENS
        assert results[-1].as_numpy("finish_reason")[0].decode() == "length"
    finally:
        stop(proc, http)


def test_serve_bentoml_answers_the_openai_client(venv, outside, tiny_model_dir):
    (port,) = free_ports(1)
    log = outside / "serve-bentoml.log"
    proc = launch(venv, outside, ["serve-bentoml", "--host", "127.0.0.1", "--port", port,
                                  "--model", tiny_model_dir("llama"), "--dtype", ENGINE["dtype"],
                                  "--max-num-seqs", ENGINE["max_num_seqs"], "--max-model-len", ENGINE["max_model_len"]],
                  log, BENTOML_HOME=str(outside / "bentoml"), BENTOML_DO_NOT_TRACK="True",
                  PAGEDCORE_NUM_THREADS=str(ENGINE["num_threads"]),  # no flags for these two
                  PAGEDCORE_NUM_KV_BLOCKS=str(ENGINE["num_kv_blocks"]))
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/readyz", log)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60) as c:
            (model,) = [m.id for m in c.models.list().data]
            r = c.completions.create(model=model, prompt="Hello, BentoML", max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.choices[0].finish_reason == "length"
    finally:
        stop(proc, port)


def test_bentoml_build_packs_the_wheel_and_the_bento_serves(wheel, venv, outside, tiny_model_dir):
    """The BentoML way (examples/bentoml): `bentoml build` with the example's bentofile.yaml and the
    wheel it names, then `bentoml serve pagedcore:latest` answers the openai client."""
    project = outside / "bento-project"
    shutil.copytree(ROOT / "examples" / "bentoml", project)
    (project / "wheels").mkdir()
    shutil.copy(wheel, project / "wheels")  # the name bentofile.yaml expects: a version bump must update it
    home = outside / "bentoml-home"
    env = user_env(venv, BENTOML_HOME=str(home), BENTOML_DO_NOT_TRACK="True")
    run([venv / "bin" / "python", "-m", "bentoml", "build"], cwd=project, env=env)
    (bento,) = [p for p in (home / "bentos" / "pagedcore").iterdir() if p.name != "latest"]
    assert (bento / "env" / "python" / "wheels" / wheel.name).is_file()
    assert (bento / "src" / "service.py").is_file()
    (port,) = free_ports(1)
    log = outside / "bento-serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([venv / "bin" / "python", "-m", "bentoml", "serve", "pagedcore:latest", "--host",
                                 "127.0.0.1", "--port", str(port)], cwd=outside, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**env, **{f"PAGEDCORE_{k.upper()}": str(v) for k, v in ENGINE.items()},
                                     "PAGEDCORE_MODEL": str(tiny_model_dir("llama"))})
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/readyz", log)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60) as c:
            (model,) = [m.id for m in c.models.list().data]
            r = c.completions.create(model=model, prompt="Hello, Bento", max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS
    finally:
        stop(proc, port)
