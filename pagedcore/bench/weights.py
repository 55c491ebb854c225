"""`pagedcore bench memory --weights`: what an engine's weights hold in memory per format (dense, packed,
oneDNN's copy, int4 / int8 codes and scales), and one stream's decode speed on each."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timezone

MIB = 1 << 20


@dataclass
class WeightBytes:
    source: str  # MODEL[@QUANTIZATION[:GROUP]] as asked
    linear: int  # bytes of linear layers: weights (dense, packed copies, or codes + scales) and biases
    other: int  # embeddings, norms; a tied LM head is the embedding, counted once
    linear_quantized: int  # of `linear`: the Int4Linear / Int8Linear layers
    num_quantized: int

    @property
    def total(self) -> int:
        return self.linear + self.other


def weight_bytes(source: str, model) -> WeightBytes:
    """Every parameter and buffer of the model, each storage counted once, plus the packed copies the
    CPU path keeps beside dense linears (packed_linear.py, onednn_linear.py): what the weights hold in memory."""
    from torch import nn

    from pagedcore import fused_projections
    from pagedcore.quantization import Int4Linear, Int8Linear

    seen: set[int] = set()
    counts = {"linear": 0, "other": 0, "quantized": 0}
    num_quantized = 0
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        packed = getattr(module, "_pagedcore_packed", None)
        tensors += [packed] if packed is not None else []
        quantized = isinstance(module, (Int4Linear, Int8Linear))
        num_quantized += quantized
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            kind = "linear" if quantized or isinstance(module, nn.Linear) else "other"
            counts[kind] += storage.nbytes()
            counts["quantized"] += storage.nbytes() if quantized else 0
        onednn = getattr(module, "_pagedcore_onednn", None)  # opaque (no storage): its elements' bytes
        counts["linear"] += onednn.numel() * onednn.element_size() if onednn is not None else 0
    for fused in fused_projections.installed(model):
        w = fused.onednn_weight
        counts["linear"] += w.numel() * w.element_size() if w is not None else 0
    return WeightBytes(source, counts["linear"], counts["other"], counts["quantized"], num_quantized)


def dense_bf16_bytes(model) -> int:
    """The model's parameters as one dense 16-bit copy (a tied table once): the base the formats' ratios
    use, since on AMX CPUs the bf16 engine itself keeps its linears twice (the pairs and oneDNN's copy)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(model.config)
    return 2 * sum(p.numel() for p in dense.parameters())


def run_weights(args) -> dict:
    """Resident weight bytes of an engine per `--weights` source; ratios to the first one."""
    import gc

    from pagedcore import LLMEngine

    from pagedcore.bench.latency import single_stream

    rows, tpots = [], []
    for source in args.weights:
        model, _, quantization = source.partition("@")
        quantization, _, group = quantization.partition(":")  # int4:64 -> quantization_group_size=64
        extra = {"quantization_group_size": int(group)} if group else {}
        engine = LLMEngine(model=model, dtype=args.dtype, quantization=quantization or None,
                           num_kv_blocks=64, num_threads=args.num_threads, **extra)
        rows.append(weight_bytes(source, engine.model))
        dense = dense_bf16_bytes(engine.model) if len(rows) == 1 else dense
        tpots.append(None)
        if args.stream_tokens:  # one stream, the format's decode speed (best of 2 after a warm-up)
            prompt = [100 + i % 1000 for i in range(64)]
            single_stream(engine, prompt, 4)
            tpots[-1] = min(single_stream(engine, prompt, args.stream_tokens)["tpot_s"] for _ in range(2))
        del engine
        gc.collect()
    base = rows[0]
    return {"bench": "memory-weights", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "dtype": args.dtype, "dense_bf16_bytes": dense,
            "weights": [dict(asdict(r), total=r.total, total_vs_first=round(r.total / base.total, 3),
                             total_vs_bf16=round(r.total / dense, 3),
                             linear_vs_first=round(r.linear / base.linear, 3),
                             tpot_ms=None if t is None else round(t * 1e3, 3),
                             tok_s=None if t is None else round(1 / t, 1)) for r, t in zip(rows, tpots)]}


def print_weights(report: dict) -> None:
    print(f"\nresident weight bytes ({report['dtype']} activations); ratios to the first row and to one dense bf16 "
          f"copy ({report['dense_bf16_bytes'] / MIB:.1f} MiB); one stream's decode")
    print(f"{'source':48s} {'total MiB':>10s} {'linears MiB':>12s} {'other MiB':>10s} {'quantized':>9s} "
          f"{'total x':>8s} {'linears x':>9s} {'x bf16':>7s} {'TPOT ms':>8s} {'tok/s':>7s}")
    for r in report["weights"]:
        speed = f"{r['tpot_ms']:8.2f} {r['tok_s']:7.1f}" if r.get("tpot_ms") is not None else f"{'-':>8s} {'-':>7s}"
        print(f"{r['source'][-48:]:48s} {r['total'] / MIB:10.1f} {r['linear'] / MIB:12.1f} {r['other'] / MIB:10.1f} "
              f"{r['num_quantized']:9d} {r['total_vs_first']:8.3f} {r['linear_vs_first']:9.3f} "
              f"{r.get('total_vs_bf16', float('nan')):7.3f} {speed}")
