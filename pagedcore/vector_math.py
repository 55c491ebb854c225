"""One serial call into torch's vector math library (MKL's VML: cos, sin, exp, ...) before the engine's first.

torch computes float cos, sin, exp and the like through MKL's VML, each thread of a parallel op over its share. Where
a process's first VML calls ran on both threads at once, the main thread's share sometimes came back at ~12 bits of
accuracy (RoPE's cos over 8192 positions: errors up to 1.5e-4 on the first half, the worker's half and every later
call exact to 1 ulp; MKL 2024.2 in torch 2.13, an AMX Xeon, about one run in two of a pytest process). The decode
stack keeps the RoPE table it makes once (decode_stack.py), so such an engine ran its whole life with cos one bf16
ulp off in ~1% of entries, and its logprobs parted from every later engine's. One call small enough to run inline
settles the library first; none of the 16 runs after it went wrong.
"""

from __future__ import annotations

import torch

_done = False


def warm_up() -> None:
    """Settle the vector math library with a one-element call on this thread, once per process."""
    global _done
    if not _done:
        x = torch.ones(1)
        x.cos(), x.sin(), x.exp()
        _done = True
