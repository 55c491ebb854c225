"""Compile every Triton kernel for a real GPU target without a GPU (ahead of time, through ptxas).

    TRITON_INTERPRET=0 python -m pagedcore.kernels.aot_check [--arch 90] [--quick]

The CPU interpreter happily runs code the GPU compiler rejects (non-constexpr globals, illegal dot
shapes, type mismatches), and says nothing about registers. This builds each kernel with the
launch configurations the wrappers use and prints registers / spilled stack bytes per kernel, so
GPU-only breakage is caught on a CPU-only machine. Needs TRITON_INTERPRET=0 *before* the kernel
modules are imported (otherwise they are interpreter functions); run it as a separate process.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch


def _usage(kernel) -> dict:
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"regs": int(m.group(1)), "spill_stack_bytes": int(m.group(2))} if m else {}


def compile_all(arch: int = 90, quick: bool = False) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("run with TRITON_INTERPRET=0 (the kernels must be real JIT functions)")
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedcore.kernels import block_copy, cache_write, decode_attention, prefill_attention
    from pagedcore.kernels.prefill_attention import prefill_block_shape, prefill_config
    from pagedcore.kernels.triton_utils import dot_precision

    target = GPUTarget("cuda", arch, 32)
    results = []

    def build(name, fn, types, consts, num_warps):
        sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        kernel = triton.compile(src, target=target, options={"num_warps": num_warps})
        results.append({"kernel": name, **_usage(kernel)})

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if quick:
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    head_dims = [80, 128] if quick else [64, 80, 96, 128]
    # Quantized caches (kv_cache_dtype int8 / fp8_e4m3): values of these types, fp16 scales.
    kv_types = {"": None, "int8": "*i8", "fp8_e4m3": "*fp8e4nv"}
    group = 3
    for tname, dtype in dtypes.items():
        ptr = "*" + tname
        for kv_name, kv_ptr in kv_types.items():
            quant = kv_ptr is not None
            tag = f"{tname} kv={kv_name}" if quant else tname
            attn_ptrs = dict(q_ptr=ptr, k_cache_ptr=kv_ptr or ptr, v_cache_ptr=kv_ptr or ptr, out_ptr=ptr,
                             k_scale_ptr="*fp16", v_scale_ptr="*fp16", block_table_ptr="*i32",
                             seq_lens_ptr="*i32", query_start_loc_ptr="*i32", seq_idx_ptr="*i32",
                             part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", scale="fp32", softcap="fp32")
            for d in head_dims if not (quick and quant) else [128]:  # quick: the largest tile only
                bd = triton.next_power_of_2(d)
                for direct in (True, False):
                    build(f"decode_partition {tag} d={d} direct={direct}", decode_attention._decode_partition_kernel,
                          attn_ptrs,
                          dict(GROUP=group, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_D=bd, BLOCK_N=decode_attention.DECODE_BLOCK_N,
                               USE_WINDOW=True, USE_SOFTCAP=True, DIRECT=direct, DOT_PREC=dot_precision(dtype),
                               UPCAST_DOT=False, KV_QUANT=quant),
                          decode_attention.DECODE_NUM_WARPS)
                if not quant:
                    build(f"decode_reduce {tname} d={d}", decode_attention._decode_reduce_kernel, attn_ptrs,
                          dict(USE_WINDOW=True, BLOCK_SPLITS=16, BLOCK_D=bd), 4)
                block_m, block_n, warps = prefill_config(dtype)
                block_m, block_q = prefill_block_shape(group, block_m)
                build(f"prefill {tag} d={d}", prefill_attention._prefill_kernel, attn_ptrs,
                      dict(GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=bd, BLOCK_SIZE=16,
                           USE_WINDOW=True, USE_SOFTCAP=True, DOT_PREC=dot_precision(dtype), UPCAST_DOT=False,
                           KV_QUANT=quant), warps)
            build(f"reshape_and_cache {tag}", cache_write._reshape_and_cache_kernel,
                  dict(key_ptr=ptr, value_ptr=ptr, k_cache_ptr=kv_ptr or ptr, v_cache_ptr=kv_ptr or ptr,
                       k_scale_ptr="*fp16", v_scale_ptr="*fp16", slot_mapping_ptr="*i64"),
                  dict(BLOCK_SIZE=16, BLOCK_H=4, BLOCK_D=128, QUANT={"": 0, "int8": 1, "fp8_e4m3": 2}[kv_name]), 4)
        build(f"copy_blocks {tname}", block_copy._copy_blocks_kernel, dict(cache_ptrs="*i64", pairs_ptr="*i64"),
              dict(DTYPE={"fp32": tl.float32, "fp16": tl.float16, "bf16": tl.bfloat16}[tname], CHUNK=block_copy.COPY_CHUNK), 4)
    from pagedcore.kernels import lora_bgmv

    for tname in dtypes:
        ptr = "*" + tname
        for rank in (8, 64, 128):  # max_lora_rank: small, large, the largest tile
            build(f"bgmv_shrink {tname} r={rank}", lora_bgmv._bgmv_shrink_kernel,
                  dict(x_ptr=ptr, a_ptr=ptr, slots_ptr="*i64", h_ptr="*fp32"),
                  dict(RANK=rank, BLOCK_R=rank, BLOCK_K=lora_bgmv.shrink_block_k(rank)), 4)
            build(f"bgmv_expand {tname} r={rank}", lora_bgmv._bgmv_expand_kernel,
                  dict(h_ptr="*fp32", b_ptr=ptr, slots_ptr="*i64", y_ptr=ptr),
                  dict(RANK=rank, BLOCK_R=rank, BLOCK_N=lora_bgmv.expand_block_n(rank)), 4)
    build("copy_blocks uint8 (quantized KV blocks)", block_copy._copy_blocks_kernel,
          dict(cache_ptrs="*i64", pairs_ptr="*i64"), dict(DTYPE=tl.uint8, CHUNK=block_copy.COPY_CHUNK), 4)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (80 = A100, 90 = H100)")
    ap.add_argument("--quick", action="store_true", help="fewer dtype / head_dim combinations")
    args = ap.parse_args(argv)
    results = compile_all(args.arch, args.quick)
    for r in results:
        print(f"{r['kernel']:45} regs={r.get('regs', '?'):>4} spill_stack_bytes={r.get('spill_stack_bytes', '?')}")
    spilled = [r["kernel"] for r in results if r.get("spill_stack_bytes")]
    print(f"{len(results)} kernels compiled for sm_{args.arch}; spilling: {spilled or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
