"""pagedcore.kernels: the attention kernels and the CPU ops, below the engine.

Two families, imported separately so that neither drags the other in:
  - the C++ CPU ops (cpu_ext.py, csrc/) and their torch fallbacks (cpu_attention.py, torch_ops.py),
    used by the engine's CPU paths (attention, packed linears, the sampler);
  - the Triton kernels (triton_attention_backend.py and the kernel modules it imports). Whether they run in
    Triton's CPU interpreter is decided in triton_utils.py, when they are first imported: importing
    this package, or the CPU ops, changes nothing in the process's environment.
"""
