"""Start the real NVIDIA Triton Inference Server (from the nvidia-pytriton wheel) on our model repository.

The wheel ships `tritonserver` 2.51, the Python backend and one backend stub per Python version, but
no backend directory laid out the way the server wants it. `TritonServer` builds that directory
(a cached copy of three files), the environment the stub needs to run inside this interpreter's
venv, and the command line; it binds 127.0.0.1 only and stops the server on SIGTERM.

    with TritonServer(http_port=8000, grpc_port=8001, metrics_port=8002) as server:
        server.wait_ready()
        ...

Engine settings come from `model_repository/pagedcore/1/model.json`; the JSON object in the
environment variable PAGEDCORE_TRITON_SETTINGS (or `engine_settings=`) overrides keys of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

from pagedcore.kernels.paths import cache_root
from pagedcore.settings import add_engine_arguments, settings_from_args

SETTINGS_ENV = "PAGEDCORE_TRITON_SETTINGS"
# The repository's top-level model_repository/ in a checkout; pagedcore/model_repository/ (package
# data, the same files) in an installed wheel. Both sit beside this file's parent directory.
DEFAULT_REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
BACKEND_CACHE = cache_root() / "triton_backends"


def pytriton_dir() -> Path:
    from pagedcore.extras import require

    require("triton-server", "Triton Inference Server (its binary ships in nvidia-pytriton)")
    import pytriton

    return Path(pytriton.__file__).resolve().parent / "tritonserver"


def backend_directory() -> Path:
    """A backend directory holding python/{libtriton_python.so, triton_python_backend_utils.py,
    triton_python_backend_stub} for this interpreter's Python version (copied once, then cached)."""
    src = pytriton_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    files = [src / "backends/python/libtriton_python.so", src / "backends/python/triton_python_backend_utils.py",
             src / "python_backend_stubs" / version / "triton_python_backend_stub"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"nvidia-pytriton lacks {missing} (no backend stub for Python {version}?)")
    dest = BACKEND_CACHE / version / "python"
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        target = dest / f.name
        if not target.is_file() or target.stat().st_size != f.stat().st_size:
            tmp = target.with_suffix(".tmp")
            shutil.copy2(f, tmp)
            os.replace(tmp, target)  # atomic: two launchers at once never see half a file
    return dest.parent


def server_environment(engine_settings: dict | None = None) -> dict[str, str]:
    """The stub ignores PYTHONPATH and takes its prefix from the first `python3` on PATH, so this
    venv's bin goes first; its libpython and the wheel's bundled libraries go first on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libs = [sysconfig.get_config_var("LIBDIR"), str(pytriton_dir().parent.parent / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*filter(None, libs), env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    if engine_settings:
        merged = {**json.loads(env.get(SETTINGS_ENV) or "{}"), **engine_settings}
        env[SETTINGS_ENV] = json.dumps(merged)
    return env


class TritonServer:
    def __init__(self, model_repository: str | Path = DEFAULT_REPOSITORY, http_port: int = 8000,
                 grpc_port: int = 8001, metrics_port: int = 8002, host: str = "127.0.0.1",
                 engine_settings: dict | None = None, log_path: str | Path | None = None,
                 extra_args: list[str] = ()):
        self.model_repository = Path(model_repository).resolve()
        self.http_port, self.grpc_port, self.metrics_port, self.host = http_port, grpc_port, metrics_port, host
        self.engine_settings = engine_settings
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        tritonserver = pytriton_dir()
        return [
            str(tritonserver / "bin/tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_directory()}",
            f"--cache-directory={tritonserver / 'caches'}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            *self.extra_args,
        ]

    def start(self) -> "TritonServer":
        if not self.model_repository.is_dir():
            raise FileNotFoundError(f"model repository {self.model_repository} does not exist")
        out = open(self.log_path, "ab") if self.log_path else None
        try:
            self.process = subprocess.Popen(self.command(), env=server_environment(self.engine_settings),
                                            stdout=out, stderr=subprocess.STDOUT if out else None)
        finally:
            if out:
                out.close()  # the child holds its own descriptor
        return self

    def is_ready(self) -> bool:
        """Models ready and every endpoint serving: Triton starts its metrics service ~40 ms after the HTTP
        one (its log), and a scrape in between is refused. Metrics switched off (extra_args): HTTP alone."""
        urls = [f"http://{self.http_url}/v2/health/ready"]
        if "--allow-metrics=false" not in self.extra_args:
            urls.append(self.metrics_url)
        try:
            for url in urls:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status != 200:
                        return False
            return True
        except OSError:
            return False

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready"
                                   + (f"; log: {self.log_path}" if self.log_path else ""))
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (Triton unloads models and exits cleanly), then SIGKILL if it hangs."""
        p, self.process = self.process, None
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return p.returncode

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- `pagedcore serve-triton` -------------------------------------------------------------------
def _setting(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string, e.g. --set model=/models/qwen


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.add_argument("--set", dest="settings", type=_setting, action="append", default=[], metavar="KEY=VALUE",
                   help="override an engine setting of model.json (an EngineConfig field; VALUE is JSON), "
                        "e.g. --set num_kv_blocks=256 --set dtype=float32")
    add_engine_arguments(p)  # the same engine flags as generate / serve-bentoml, over model.json too


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def serve(args) -> int:
    server = TritonServer(args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
                          engine_settings={**dict(args.settings), **settings_from_args(args)} or None)
    # SIGTERM unwinds like Ctrl-C: out of wait(), into stop() (never stop() inside the handler: it
    # would wait on the process that the interrupted wait() is already waiting on).
    signal.signal(signal.SIGTERM, _interrupt)
    server.start()
    try:
        server.wait_ready()
        print(f"[pagedcore] Triton serving model 'pagedcore': HTTP http://{server.http_url} "
              f"(generate_stream), gRPC {server.grpc_url}, metrics {server.metrics_url}", file=sys.stderr)
        return server.process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


def add_command_arguments(p: argparse.ArgumentParser) -> None:
    """`pagedcore serve-triton` (pagedcore/cli.py imports this module only for that subcommand)."""
    add_arguments(p)
    p.set_defaults(func=serve)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedcore.adapters.triton_launcher", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
