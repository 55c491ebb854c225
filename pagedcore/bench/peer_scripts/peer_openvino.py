"""Peer: OpenVINO GenAI's ContinuousBatchingPipeline (paged attention, continuous batching) on the same
HF directory, converted once to OpenVINO IR with optimum-cli (fp16 weights; conversion is not timed).

Compute precision is set explicitly (INFERENCE_PRECISION_HINT bf16 for a bfloat16 run, f32 otherwise), and
so is the KV cache's (its CPU default is u8, which would not be the same computation as the other engines').
On a CPU without bf16 support (OPTIMIZATION_CAPABILITIES lacks BF16, e.g. AVX2-only) OpenVINO computes in
f32 whatever the hint, and its paged attention then refuses a bf16 KV cache: both are set to f32 there, and
the result says so ("precision_fallback").
"""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _peer_common import load_spec, now, stream_timings, throughput_result, write

MIN_BLOCK_SIZE = 16  # OpenVINO's KV block is 16 or 32 tokens: sizing by 16 is enough for either


def ir_cache_root() -> Path:
    # pagedcore.kernels.paths.cache_root(), repeated: this script runs in the peer's venv, without pagedcore.
    return Path(os.environ.get("PAGEDCORE_CACHE", Path.home() / ".cache" / "pagedcore")) / "openvino"


def ir_dir_for(model_dir: str) -> Path:
    """Converted IR for this model directory: keyed by its path, its files (name, size, mtime) and openvino's
    version, so a changed model or converter converts again."""
    import openvino

    src = Path(model_dir).resolve()
    h = hashlib.sha256(f"{src}\0{openvino.__version__}".encode())
    for f in sorted(src.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return ir_cache_root() / f"{src.name}-{h.hexdigest()[:16]}"


def convert(model_dir: str) -> tuple[Path, float]:
    """(IR directory, seconds spent converting: 0 when it was already cached)."""
    out = ir_dir_for(model_dir)
    if (out / "openvino_model.xml").exists():
        return out, 0.0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    cli = Path(sys.executable).parent / "optimum-cli"
    cmd = [str(cli) if cli.exists() else "optimum-cli", "export", "openvino", "--model", model_dir,
           "--task", "text-generation-with-past", "--weight-format", "fp16", str(tmp)]
    print(f"[openvino] converting {model_dir} -> {out}", file=sys.stderr, flush=True)
    t0 = now()
    proc = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True)
    seconds = now() - t0
    if proc.returncode != 0 or not (tmp / "openvino_model.xml").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        sys.exit(f"optimum-cli export failed (exit {proc.returncode})")
    try:
        tmp.rename(out)  # atomic: a concurrent run's finished conversion wins, ours is dropped
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, seconds


def kv_bytes_per_token(model_dir: str, elem_bytes: int) -> int:
    with open(Path(model_dir) / "config.json") as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * elem_bytes


def main() -> None:
    spec, out = load_spec()
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    opts = spec.get("options", {})
    threads = spec.get("threads") or os.cpu_count()
    prompts, out_lens = spec["prompts"], spec["output_lens"]
    ir_dir, convert_s = convert(spec["model_dir"])

    requested = "bf16" if spec["dtype"] == "bfloat16" else "f32"
    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    precision = requested if requested == "f32" or "BF16" in capabilities else "f32"
    sched = ov_genai.SchedulerConfig()
    sched.max_num_seqs = int(opts.get("max_num_seqs", 128))
    sched.max_num_batched_tokens = int(opts.get("max_num_batched_tokens", 2048))
    sched.dynamic_split_fuse = True  # chunked prefill mixed with decode, as pagedcore schedules
    sched.enable_prefix_caching = False
    if opts.get("kv_cache_gb"):
        sched.cache_size = int(math.ceil(opts["kv_cache_gb"]))
    else:  # room for every request at full length at once: the workload never waits for KV blocks
        blocks = sum(math.ceil((len(p) + n) / MIN_BLOCK_SIZE) + 1 for p, n in zip(prompts, out_lens))
        sched.num_kv_blocks = blocks + 2  # + the warm-up's
    config = {"INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision,
              "KEY_CACHE_PRECISION": precision, "VALUE_CACHE_PRECISION": precision,
              "INFERENCE_NUM_THREADS": int(threads)}
    t0 = now()
    pipe = ov_genai.ContinuousBatchingPipeline(str(ir_dir), sched, "CPU", config)
    load_s = now() - t0

    def tensor(ids):
        return ov.Tensor(np.asarray([ids], dtype=np.int64))

    def gen_config(n):
        c = ov_genai.GenerationConfig()
        c.max_new_tokens, c.min_new_tokens, c.ignore_eos, c.do_sample = n, n, True, False
        return c

    warm = prompts[:2]
    pipe.generate([tensor(p) for p in warm], [gen_config(2)] * len(warm))  # warm-up
    extra = dict(threads=threads, ir_dir=str(ir_dir), convert_s=round(convert_s, 2), load_s=round(load_s, 2),
                 inference_precision=precision, kv_cache_precision=precision,
                 **({"precision_fallback": f"{requested} requested; this CPU has no bf16 "
                                           f"({', '.join(capabilities)}): f32"} if precision != requested else {}),
                 max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                 num_kv_blocks=sched.num_kv_blocks, cache_size_gb=sched.cache_size)
    if spec["mode"] == "single_stream":
        times: list[float] = []
        t0 = now()
        handle = pipe.add_request(0, tensor(prompts[0]), gen_config(out_lens[0]))
        while pipe.has_non_finished_requests():
            pipe.step()
            if handle.can_read():
                for output in handle.read().values():
                    times.extend([now()] * len(output.generated_ids))
        write(out, stream_timings("openvino", times, t0, **extra))
        return
    inputs, configs = [tensor(p) for p in prompts], [gen_config(n) for n in out_lens]
    t0 = now()
    results = pipe.generate(inputs, configs)
    dt = now() - t0
    n_out = sum(len(r.m_generation_ids[0]) for r in results)
    try:
        extra["kv_cache_bytes"] = pipe.get_metrics().kv_cache_size_in_bytes
        extra["kv_bytes_per_token_expected"] = kv_bytes_per_token(spec["model_dir"], 2 if precision == "bf16" else 4)
    except (AttributeError, OSError, KeyError):
        pass
    write(out, throughput_result("openvino", dt, prompts, n_out, **extra))


if __name__ == "__main__":
    main()
