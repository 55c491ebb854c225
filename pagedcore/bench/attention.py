"""`pagedcore bench attention`: micro-benchmark of one decode step of one attention layer.

    pagedcore bench attention [--json PATH] [--repeats N] [--shapes smollm2,long]

Rows, per device and dtype:
  naive-sdpa     gather every sequence's context through its block table in a Python loop into a
                 padded [B, Hkv, L, D] batch, then one masked SDPA call (what you write first);
  cpu-paged      `cpu_paged_attention` as the CPU backend runs it: decode rows through the C++
                 kernel (reads K/V in place through the block table; kernels/cpu_ext.py);
  cpu-paged-torch its pure-torch path (one block-granular index_select, native-dtype matmuls,
                 fp32 softmax), used when the C++ kernel cannot be built;
  cpu-paged-sdpa the same gather with masked SDPA for the math (the alternative measured);
  triton-decode  (CUDA only) the split-K Triton decode kernel, with achieved GB/s of K/V traffic
                 against the device's copy bandwidth (a big `copy_`, bytes read + written).

Default shape: SmolLM2-135M attention (9 query heads, 3 KV heads, head_dim 64, block 16),
64 sequences x 512 tokens. On CUDA also a long-context shape (4 x 16384) where split-K matters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pagedcore.kernels.cpu_attention import cpu_paged_attention
from pagedcore.kernels.reference import gather_context, ref_paged_attention
from pagedcore.kernels.testing import make_paged_batch, rel_err


@dataclass
class Shape:
    name: str
    num_seqs: int
    seq_len: int
    num_q_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16


SHAPES = {
    "smollm2": Shape("smollm2-64x512", 64, 512),
    "smollm2-140": Shape("smollm2-64x140", 64, 140),  # the bundled model's decode step (~140-token chats)
    "long": Shape("smollm2-4x16384", 4, 16384),
}


@dataclass
class Row:
    device: str
    dtype: str
    shape: str
    impl: str
    ms: float
    ms_min: float
    kv_gbps: float | None  # K/V bytes read per step / time
    rel_err: float  # vs the loop-per-sequence fp32 reference (or vs cpu-paged on large shapes)
    note: str = ""


def naive_sdpa_decode(query, k_cache, v_cache, md, scale):
    """Python-loop gather into a padded batch + one masked SDPA (the baseline)."""
    num_seqs = len(md.seq_lens_cpu)
    max_len = max(md.seq_lens_cpu)
    _, _, hkv, d = k_cache.shape
    k = torch.zeros(num_seqs, max_len, hkv, d, dtype=k_cache.dtype, device=k_cache.device)
    v = torch.zeros_like(k)
    for i, n in enumerate(md.seq_lens_cpu):
        k[i, :n] = gather_context(k_cache, md.block_table[i], n)
        v[i, :n] = gather_context(v_cache, md.block_table[i], n)
    mask = torch.arange(max_len, device=query.device)[None, :] < md.seq_lens.long()[:, None]
    o = F.scaled_dot_product_attention(
        query.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return o.squeeze(2)


def _time_cpu(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm-up (allocator, lazy init)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def _time_cuda(fn, repeats: int) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), min(times)


def copy_bandwidth_gbps(device: str, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device memory bandwidth from a big copy_: (bytes read + bytes written) / time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timer = _time_cuda if device.startswith("cuda") else _time_cpu
    _, best = timer(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / (best * 1e-3) / 1e9


def run(shapes: list[str], repeats: int, dtypes=(torch.float32, torch.bfloat16)) -> dict:
    load_before = os.getloadavg()[0]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows: list[Row] = []
    copy_bw = {}
    for device in devices:
        copy_bw[device] = copy_bandwidth_gbps(device, nbytes=(1 << 30) if device == "cuda" else (1 << 28), repeats=5 if device == "cpu" else 20)
        timer = _time_cuda if device == "cuda" else _time_cpu
        for shape_key in shapes:
            sh = SHAPES[shape_key]
            if device == "cpu" and not shape_key.startswith("smollm2"):
                continue  # CPU: the SmolLM2 steps only (the long shape is a GPU split-K case)
            for dtype in dtypes:
                b = make_paged_batch(
                    [1] * sh.num_seqs, [sh.seq_len] * sh.num_seqs, sh.num_q_heads, sh.num_kv_heads, sh.head_dim,
                    sh.block_size, dtype, device, seed=0, poison=False,
                )
                b.write_new_tokens()
                md = b.metadata
                scale = sh.head_dim**-0.5
                q, kc, vc = b.query, b.k_cache, b.v_cache
                kv_bytes = 2 * sum(md.seq_lens_cpu) * sh.num_kv_heads * sh.head_dim * kc.element_size()
                small = sh.num_seqs * sh.seq_len <= 64 * 512
                ref = ref_paged_attention(q, kc, vc, md, scale) if small else cpu_paged_attention(q, kc, vc, md, scale)

                impls = {
                    "naive-sdpa": lambda: naive_sdpa_decode(q, kc, vc, md, scale),
                    "cpu-paged": lambda: cpu_paged_attention(q, kc, vc, md, scale),
                    "cpu-paged-torch": lambda: cpu_paged_attention(q, kc, vc, md, scale, use_ext=False),
                    "cpu-paged-sdpa": lambda: cpu_paged_attention(q, kc, vc, md, scale, use_sdpa=True),
                }
                if device == "cuda":
                    from pagedcore.kernels.triton_attention_backend import TritonAttentionBackend

                    backend = TritonAttentionBackend()
                    tmd = backend.build_metadata(md)
                    from pagedcore.kernels.decode_attention import paged_decode_attention

                    out = torch.empty_like(q)

                    def triton_decode():
                        return paged_decode_attention(
                            q, kc, vc, md.block_table, md.seq_lens, scale, query_start_loc=md.query_start_loc,
                            seq_indices=tmd.decode_seq_idx, max_seq_len=tmd.max_decode_seq_len, out=out,
                            plan=tmd.decode_plan(sh.num_kv_heads, None), workspace=tmd.workspace,
                        )

                    impls["triton-decode"] = triton_decode
                    impls["triton-decode-nosplit"] = lambda: paged_decode_attention(
                        q, kc, vc, md.block_table, md.seq_lens, scale, query_start_loc=md.query_start_loc,
                        max_seq_len=md.max_seq_len, out=out, num_splits=1,
                    )
                for name, fn in impls.items():
                    if name == "naive-sdpa" and not small:
                        continue
                    err = rel_err(fn(), ref)
                    ms, ms_min = timer(fn, repeats)
                    note = ""
                    if name == "triton-decode":
                        note = f"splits={tmd.decode_plan(sh.num_kv_heads, None).num_splits}"
                    rows.append(Row(device, str(dtype).replace("torch.", ""), sh.name, name, ms, ms_min,
                                    kv_bytes / (ms_min * 1e-3) / 1e9, err, note))
    return {
        "rows": [asdict(r) for r in rows],
        "copy_bandwidth_gbps": copy_bw,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        # Wall-clock CPU timings are only as good as the machine is quiet: record how busy it was.
        "loadavg_1min": [load_before, os.getloadavg()[0]],
        "torch": torch.__version__,
    }


def print_table(result: dict) -> None:
    load = result["loadavg_1min"]
    print(f"torch {result['torch']}, {result['torch_threads']} threads on {result['cpu_count']} CPUs, "
          f"1-min load average {load[0]:.2f} -> {load[1]:.2f}")
    for dev, bw in result["copy_bandwidth_gbps"].items():
        print(f"{dev} copy_ bandwidth (read+write): {bw:.1f} GB/s")
    hdr = f"{'device':6} {'dtype':9} {'shape':16} {'impl':22} {'median ms':>10} {'min ms':>8} {'KV GB/s':>8} {'%copy':>6} {'rel err':>9}  note"
    print(hdr)
    print("-" * len(hdr))
    for r in result["rows"]:
        pct = 100 * r["kv_gbps"] / result["copy_bandwidth_gbps"][r["device"]]
        print(
            f"{r['device']:6} {r['dtype']:9} {r['shape']:16} {r['impl']:22} {r['ms']:10.2f} {r['ms_min']:8.2f} "
            f"{r['kv_gbps']:8.1f} {pct:5.0f}% {r['rel_err']:9.1e}  {r['note']}"
        )


def main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run([s for s in args.shapes.split(",") if s], args.repeats)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--shapes", default="smollm2,long", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=main)


def add_parser(bsub) -> None:
    p = bsub.add_parser("attention", help="one attention layer's decode step: naive gather+SDPA, the CPU paths, "
                                          "the Triton kernel (CUDA)",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args()
    raise SystemExit(args.func(args))
