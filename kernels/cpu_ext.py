"""The C++ CPU ops (csrc/: paged decode attention, decoder-layer elementwise ops, sampler
reductions, linears over pre-packed weights), one extension module built on first use.

Compiled once per machine with torch's cpp_extension (about a minute on 2 cores) into
`$PAGEDCORE_CACHE/cpu_ops/<name>` (default ~/.cache/pagedcore), the name carrying a hash of the
sources, flags and torch version: checkouts with different sources never rebuild over each other,
and a built module is imported directly (no cpp_extension import, no ninja run: ~10 ms). If it cannot be built (no compiler, no ninja), or
`PAGEDCORE_CPU_EXT=0`, every caller keeps its pure-torch path, which computes the same thing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from pagedcore.kernels.paths import cache_root

logger = logging.getLogger("pagedcore")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("bindings.cpp", "cpu_decode_attention.cpp", "cpu_layer_ops.cpp", "cpu_sampling.cpp",
                                       "cpu_gemm.cpp", "cpu_gemm_int4.cpp", "cpu_gemm_int8.cpp", "cpu_gemm_vnni.cpp",
                                       "cpu_linear_ops.cpp", "cpu_decode_stack.cpp", "cpu_prefill_attention.cpp",
                                       "huge_pages.cpp", "cpu_greedy_head.cpp", "cpu_greedy_head_avx2.cpp",
                                       "cpu_exact_int4.cpp", "objects_in_place.cpp")]
# -ffast-math lets the compiler vectorise the fp32 reductions; the kernel never reads padding, so
# no inf/NaN from unwritten cache slots can reach it.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]

_module = None
_tried = False
_load_lock = threading.Lock()


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; an un-activated venv (`.venv/bin/python ...`) does not have it there."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _name() -> str:
    import torch

    digest = hashlib.sha256()
    for path in [*SOURCES, *sorted(CSRC.glob("*.h"))]:
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS).encode() + torch.__version__.encode() + _cpu_identity())
    return f"pagedcore_cpu_ops_{digest.hexdigest()[:12]}"


def _cpu_identity() -> bytes:
    """What -march=native compiles for: a cache shared by machines with other CPUs (a home directory on
    several hosts) must not hand one CPU's build to another (an AVX512-BF16 build dies of SIGILL elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor().encode()
    first = text.split("\n\n", 1)[0]
    keep = ("vendor_id", "cpu family", "model\t", "flags")
    return "\n".join(line for line in first.splitlines() if line.startswith(keep)).encode()


def _build_dir(name: str) -> Path:
    return cache_root() / "cpu_ops" / name


def _import_built(name: str, build_dir: Path):
    """The module from an earlier build of these exact sources, or None."""
    so = build_dir / f"{name}.so"
    if not so.exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:  # half-written by a concurrent build: let the build (and its lock) decide
        return None
    return module


def _build(name: str, build_dir: Path):
    from torch.utils.cpp_extension import load as build

    _put_ninja_on_path()
    build_dir.mkdir(parents=True, exist_ok=True)
    return build(name, [str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                 build_directory=str(build_dir))


def load():
    """The compiled module, or None when unavailable (logged once)."""
    global _module, _tried
    if _tried:
        return _module
    with _load_lock:  # a second engine starting in another thread waits for the build, not None
        if _tried:
            return _module
        if os.environ.get("PAGEDCORE_CPU_EXT", "1") != "0":
            _module = _load_or_build()
        _tried = True
    return _module


def _load_or_build():
    try:
        name = _name()
        module = _import_built(name, _build_dir(name))
        if module is None:
            # Printed, not logged at INFO: a first run otherwise sits silent for minutes.
            print(f"[pagedcore] building the C++ CPU kernels into {_build_dir(name)} "
                  "(once per machine and source version; 1-3 min on 2 cores)...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            module = _build(name, _build_dir(name))
            print(f"[pagedcore] C++ CPU kernels built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return module
    except Exception as e:  # noqa: BLE001 -- any build failure means: use the torch path
        logger.warning("pagedcore: C++ CPU ops unavailable (%s); using the torch paths", e)
        return None
