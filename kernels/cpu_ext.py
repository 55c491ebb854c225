"""The C++ CPU ops (csrc/: paged decode attention, decoder-layer elementwise ops, sampler
reductions), one extension module built on first use.

Compiled once per machine with torch's cpp_extension (about a minute on 2 cores; cached in torch's
extensions directory, ~10 ms to load afterwards). If it cannot be built (no compiler, no ninja), or
`PAGEDCORE_CPU_EXT=0`, every caller keeps its pure-torch path, which computes the same thing.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger("pagedcore")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("bindings.cpp", "cpu_decode_attention.cpp", "cpu_layer_ops.cpp", "cpu_sampling.cpp")]
# -ffast-math lets the compiler vectorise the fp32 reductions; the kernel never reads padding, so
# no inf/NaN from unwritten cache slots can reach it.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]

_module = None
_tried = False


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; an un-activated venv (`.venv/bin/python ...`) does not have it there."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load():
    """The compiled module, or None when unavailable (logged once)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("PAGEDCORE_CPU_EXT", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        _put_ninja_on_path()

        _module = build("pagedcore_cpu_ops", [str(s) for s in SOURCES], extra_cflags=CFLAGS,
                        extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 -- any build failure means: use the torch path
        logger.warning("pagedcore: C++ CPU ops unavailable (%s); using the torch paths", e)
    return _module
