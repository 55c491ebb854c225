"""Small pieces shared by the Triton attention kernels, and the choice of Triton's CPU interpreter.

Every Triton kernel module imports this one before it defines a kernel (cache_write.py is imported
after block_copy.py by the backend), so the interpreter is chosen here, for the Triton kernels only.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def use_interpreter_without_cuda() -> None:
    """Without a CUDA device Triton compiles nothing: run the kernels in its CPU interpreter
    (TRITON_INTERPRET=1), on CPU tensors -- slowly, but exactly as written. `@triton.jit` reads the
    variable when a kernel is defined, so this runs before the first one; a value already set wins
    (aot_check.py needs TRITON_INTERPRET=0 on a CPU-only machine)."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


use_interpreter_without_cuda()

# log2(e): the kernels use exp2 (one native instruction on GPUs) on scores pre-multiplied by
# log2(e), so exp(s - m) == exp2(s * log2e - m * log2e).
LOG2E = tl.constexpr(1.4426950408889634)

# Running-max initial value. Finite on purpose: with -inf, a row whose first tiles are entirely
# masked (sliding window, padding rows) would compute exp2(-inf - (-inf)) = NaN.
# (Globals read inside @triton.jit code must be tl.constexpr.)
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def apply_softcap(s, softcap):
    """softcap * tanh(s / softcap), with tanh written through exp so it runs on every backend
    (GPU and the CPU interpreter) without libdevice: tanh(x) = 1 - 2 / (exp(2x) + 1), which
    saturates correctly to +-1 when exp overflows to inf or underflows to 0."""
    x = s / softcap
    t = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    return softcap * t


@triton.jit
def mma(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST works around the Triton CPU interpreter, whose dot
    multiplies bf16 operands as their raw uint16 bit patterns (triton 3.x `create_dot`): there the
    operands are widened to fp32 first (exact for bf16). On GPUs UPCAST is False and the dot runs
    on bf16 tensor cores."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def needs_dot_upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: force true-fp32 dots (the default tf32 on Ampere+ loses ~3 decimal digits)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def torch_dtype_to_tl(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.uint8: tl.uint8}[dtype]


QUANTIZED_CACHE_DTYPES = (torch.int8, torch.float8_e4m3fn)


def check_scales(k_cache, v_cache, k_scales, v_scales) -> bool:
    """Whether the attention kernels read a quantized cache (int8 / e4m3 values, fp16 scales per
    (token, head), kv_quant.split's views), checking that scales come exactly with one."""
    quant = k_cache.dtype in QUANTIZED_CACHE_DTYPES
    assert quant == (k_scales is not None and v_scales is not None), "scales come with an int8 / fp8 cache, only"
    if quant:
        assert k_scales.dtype == v_scales.dtype == torch.float16 and k_scales.stride() == v_scales.stride()
        assert k_scales.stride(2) == 1 and k_scales.shape == k_cache.shape[:3]
    return quant
