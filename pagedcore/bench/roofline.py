"""The machine's matmul ceiling, measured in the same run, and the model's FLOPs per token.

The ceiling is the best of a few large matmuls through torch, in the benchmark's dtype or in fp32,
whichever is faster on this CPU (with bf16 units, bf16; on AVX2-only CPUs, fp32). Model FLOPs count the weight matmuls only (2 per parameter per
token; the LM head only for tokens whose logits are computed); attention's own FLOPs are left
out, so the achieved fraction is a lower bound.

For single-stream decode the ceiling is memory, not compute: every step reads all the weights once,
so the time to read them at the machine's read bandwidth (measured here too) bounds TPOT from below.
"""

from __future__ import annotations

import time

import torch

SHAPES = [(2048, 576, 1536), (2048, 1536, 576), (4096, 1024, 1024), (2048, 2048, 2048)]


def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX); without, bf16 models compute in fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def matmul_tflops(dtype: torch.dtype, shapes=SHAPES, seconds: float = 0.5) -> float:
    """The machine's matmul ceiling for a model in `dtype`: the best of torch's matmul in `dtype` and in
    fp32 (on CPUs without bf16 units a bf16 model computes in fp32, as pagedcore's packed linears do,
    and torch's own bf16 matmul is a scalar loop that would take minutes on these shapes)."""
    best = _best_matmul(torch.float32, shapes, seconds)
    if dtype != torch.float32 and _probe(dtype) > 0.25 * _probe(torch.float32):
        best = max(best, _best_matmul(dtype, shapes, seconds))
    return best


def _probe(dtype: torch.dtype, n: int = 256, tries: int = 5) -> float:
    """FLOP/s of one small matmul, the best of `tries` (a single timing on a shared host once fell in a slow spell:
    bf16 judged to have no units, and the run's peak taken from fp32, 0.14 against 0.42 TFLOP/s)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)
    best = 0.0
    for _ in range(tries):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def _best_matmul(dtype: torch.dtype, shapes, seconds: float) -> float:
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.matmul(a, b)  # warm-up (first call picks and prepares the kernel)
        reps, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < seconds:
            torch.matmul(a, b)
            reps += 1
        best = max(best, 2 * m * k * n * reps / dt / 1e12)
    return best


_READ_BUFFERS: dict[int, torch.Tensor] = {}


def read_buffer(mib: int) -> torch.Tensor:
    """fp32 ones over `mib` MiB in 2 MiB huge pages where the C++ ops give them, else torch's memory; made once a
    process. Huge pages because the engine's weights live in them (huge_pages.py) and they read faster: the
    hardware's stream prefetch stops at every 4 KiB page, and each is a TLB miss (Zen 4 KVM, alternating: 28-41 GB/s
    over 4 KiB pages against 33-65 over huge pages); a ceiling read through small pages would flatter every ratio
    taken against it."""
    if mib not in _READ_BUFFERS:
        from pagedcore.kernels import cpu_ext

        ext = cpu_ext.load()
        n = mib * 2**20
        if ext is not None and hasattr(ext, "huge_page_buffer"):
            x = ext.huge_page_buffer(n).view(torch.float32).fill_(1.0)
        else:
            x = torch.ones(n // 4, dtype=torch.float32)
        _READ_BUFFERS[mib] = x
    return _READ_BUFFERS[mib]


def read_bandwidth_gbs(seconds: float = 0.5, mib: int = 512) -> float:
    """The machine's memory read bandwidth through torch, GB/s: the best of repeated reductions over a
    `mib` MiB buffer (far larger than any cache; huge pages, read_buffer), bytes read / time. fp32 view: the
    sum is vectorised well enough to be bound by memory, not by the adds."""
    x = read_buffer(mib)
    x.sum()  # warm-up: kernel chosen
    best = 0.0
    t_end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        x.sum()
        dt = time.perf_counter() - t0
        best = max(best, x.nbytes / dt / 1e9)
        if time.perf_counter() >= t_end:
            return best


ADJACENT_READ_S = 0.3  # each read probe beside a timed stream or step profile (the best of its repeated reads)


def adjacent_read_gbs() -> float:
    """A short read probe, taken just before and after a measurement whose floor it sets."""
    return read_bandwidth_gbs(ADJACENT_READ_S)


def between_probes(measure, read_probe=None):
    """(measure(), the larger of read_probe() just before and just after it): the read bandwidth of the
    measurement's own minutes (this host's moves 30 -> 57 GB/s within a run); None for it without a probe."""
    if read_probe is None:
        return measure(), None
    before = read_probe()
    result = measure()
    return result, max(before, read_probe())


def weight_bytes(model) -> int:
    """Bytes of the model's weights, each storage once (a tied embedding/LM head counts once); a linear
    whose dense weight was released (packed_linear.release_dense) counts its packed copy."""
    seen: dict[tuple[int, int], int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[(p.data_ptr(), p.nbytes)] = p.nbytes
    for m in model.modules():
        packed = getattr(m, "_pagedcore_packed", None)
        if packed is not None and m.weight.numel() == 0:
            seen[(packed.data_ptr(), packed.nbytes)] = packed.nbytes
    return sum(seen.values())


def model_flops(model) -> tuple[float, float]:
    """(FLOPs per token through the decoder's linears, FLOPs per token of the LM head), from the layers'
    shapes (their weights may be packed, quantized or released)."""
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if m is not head and hasattr(m, "in_features") and hasattr(m, "out_features")]
    decoder = sum(m.in_features * m.out_features for m in linears)
    return 2.0 * decoder, 2.0 * head.in_features * head.out_features


def achieved(model, input_tokens: int, output_tokens: int, seconds: float) -> tuple[float, float]:
    """(total GFLOP, achieved TFLOP/s) for a run: every token through the decoder, the head per output token."""
    per_token, head = model_flops(model)
    total = per_token * (input_tokens + output_tokens) + head * output_tokens
    return total / 1e9, total / seconds / 1e12


def workload_seconds(model, input_tokens: int, out_lens: list[int], max_num_seqs: int, tflops: float,
                     read_gbs: float) -> dict:
    """The run's roofline: no engine finishes faster than its FLOPs at the matmul peak, nor than its forward
    passes each reading every weight once at the read bandwidth. A request's output tokens take one pass each,
    so there are at least max(longest output, outputs / max_num_seqs) passes (KV reads would add more: this is
    a lower bound). Compute-bound machines get the matmul term; AMX ones, where bf16 matmul outruns memory,
    the read term."""
    gflop, _ = achieved(model, input_tokens, sum(out_lens), 1.0)
    passes = max(max(out_lens), -(-sum(out_lens) // max_num_seqs))
    compute_s = gflop / (tflops * 1e3)
    memory_s = passes * weight_bytes(model) / (read_gbs * 1e9)
    return {"compute_s": compute_s, "memory_s": memory_s, "min_passes": passes, "roofline_s": max(compute_s, memory_s)}
