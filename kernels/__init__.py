"""pagedcore.kernels: Triton GPU kernels (and their torch references / CPU paths) for paged attention.

Without a CUDA device Triton cannot compile anything, so the kernels fall back to Triton's CPU
interpreter (TRITON_INTERPRET=1), which runs them on CPU tensors -- slowly, but exactly as
written. This must happen before any `@triton.jit` function is defined, hence here.
"""

import os as _os

if "TRITON_INTERPRET" not in _os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"
