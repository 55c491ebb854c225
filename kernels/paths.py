"""Where pagedcore keeps what it builds or converts once per machine.

`$PAGEDCORE_CACHE` (default ~/.cache/pagedcore) holds the C++ CPU ops (cpu_ops/), inductor's caches
(inductor/), models converted from GGUF, and Triton Inference Server's Python backend stub
(triton_backends/). It lives in the kernels package, the bottom layer, so that every layer can ask it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDCORE_CACHE", Path.home() / ".cache" / "pagedcore"))
