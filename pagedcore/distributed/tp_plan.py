"""Shard a Hugging Face decoder by its own tensor-parallel plan: no per-model code.

transformers declares the plan on the config (`base_model_tp_plan`, e.g. Llama's
`{"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.self_attn.o_proj": "rowwise", ...}`) and on the
model class (`_tp_plan`, e.g. `{"lm_head": "colwise_gather_output"}`); `model.tp_plan` is the merged,
prefixed plan. Its own TP (`tp_plan="auto"`) turns parameters into DTensors and hooks forwards. Here each
rank keeps plain tensors, its slice only:

- colwise: rows of the weight (and bias): this rank's output features, e.g. its heads of q/k/v. The
  module stays a plain nn.Linear, so packed and int4 linears, the lean layers and plugins see it as before.
- rowwise: columns of the weight; the module becomes `RowParallelLinear`, which all-reduces the partial
  product over the ranks, then adds the bias once.
- colwise_gather_output (the LM head) and embedding_rowwise: vocabulary-parallel, when
  `tensor_parallel_vocab`; the logits are gathered on rank 0 only (it alone samples).
- packed_colwise: fused projections (gate_up_proj) shard each half.
- styles that change nothing at inference (replicate, replicated_with_grad_allreduce, keep_full_weight)
  are skipped; any other style is refused, naming it.

Head counts: transformers' attention reshapes with -1 heads (`view(*input_shape, -1, head_dim)`) and its
own TP leaves the modules' head counts alone, sizing the KV cache by `get_kv_heads_per_rank`; so do we,
and fix the head-count attributes older attention modules keep (`num_heads`, `num_key_value_heads`...).
The KV cache is sized from `model._pagedcore_tp_kv_heads` (this rank's KV heads).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

NO_OP_STYLES = {"replicate", "replicated_with_grad_allreduce", "keep_full_weight", "local_colwise",
                "local_rowwise", "local"}
SUPPORTED_STYLES = {"colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep",
                    "rowwise_split_input", "embedding_rowwise", "packed_colwise"} | NO_OP_STYLES
VOCAB_STYLES = {"embedding_rowwise"}
logger = logging.getLogger("pagedcore")
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


class TensorParallelError(ValueError):
    pass


def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's merged tensor-parallel plan (module path pattern -> style)."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    base = getattr(model.config.get_text_config(), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    return {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}


def check_divisible(hf_config, world_size: int) -> tuple[int, int]:
    """(attention heads, KV heads), or a TensorParallelError naming the numbers."""
    c = hf_config.get_text_config()
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    bad = [f"{what} ({n})" for what, n in (("attention heads", heads), ("KV heads", kv_heads)) if n % world_size]
    if bad:
        ok = [n for n in range(1, heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} must divide the model's {' and '.join(bad)}: it has "
            f"{heads} attention heads and {kv_heads} KV heads; sizes that work: {', '.join(map(str, ok))}")
    return heads, kv_heads


def check_plan(model: nn.Module, world_size: int) -> dict[str, str]:
    """The plan, checked: one exists, every style is one we can apply, the heads divide."""
    plan = model_plan(model)
    if not plan:
        raise TensorParallelError(
            f"{type(model).__name__} has no tensor-parallel plan (transformers' base_model_tp_plan on "
            f"{type(model.config).__name__}): run it with tensor_parallel_size=1")
    unknown = sorted({s for s in plan.values() if s not in SUPPORTED_STYLES})
    if unknown:
        raise TensorParallelError(
            f"{type(model).__name__}'s tensor-parallel plan uses style(s) {', '.join(unknown)}, which pagedcore "
            f"does not apply (supported: {', '.join(sorted(SUPPORTED_STYLES - NO_OP_STYLES))})")
    check_divisible(model.config, world_size)
    return plan


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def chunk(size: int, rank: int, world_size: int) -> slice:
    """This rank's part of `size` (ceil-sized chunks; the last may be shorter)."""
    step = -(-size // world_size)
    return slice(min(size, rank * step), min(size, (rank + 1) * step))


def shard_model(model: nn.Module, comm, vocab_parallel: bool = True) -> dict:
    """Apply the plan to `model` in place for `comm.rank` of `comm.world_size`; returns a summary."""
    rank, n = comm.rank, comm.world_size
    plan = check_plan(model, n)
    if not vocab_parallel:
        plan = {k: v for k, v in plan.items() if v not in VOCAB_STYLES and not _is_lm_head(model, k)}
    patterns = [(_pattern(k), style) for k, style in plan.items()]
    modules = dict(model.named_modules())
    lm_head = model.get_output_embeddings()
    done: dict[str, str] = {}
    sharded_parents: set[str] = set()
    shared: dict[int, nn.Parameter] = {}  # tied weights: one shard for both owners
    for name, module in modules.items():
        style = next((s for p, s in patterns if p.match(name)), None)
        if style is None or style in NO_OP_STYLES:
            continue
        _check_module(name, module, style)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if style in ("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"):
            weight_id = id(module.weight)
            rows = chunk(module.out_features, rank, n)
            if style == "packed_colwise":
                _shard_packed_rows(module, rank, n)
            else:
                _shard_rows(module, rows, shared)
            if style in ("colwise", "packed_colwise"):  # the output stays sharded: so are the parent's heads
                sharded_parents.add(parent_name)
            else:  # the output is needed whole: gather it
                wrapper = GatherOutput(module, comm, full=module._pagedcore_full_out, to_rank0=module is lm_head)
                setattr(parent, child, wrapper)
            shared.setdefault(weight_id, module.weight)
        elif style in ("rowwise", "rowwise_rep", "rowwise_split_input"):
            cols = chunk(module.in_features, rank, n)
            setattr(parent, child, RowParallelLinear(module, comm, cols, split_input=style != "rowwise"))
        elif style == "embedding_rowwise":
            setattr(parent, child, VocabParallelEmbedding(module, comm, shared))
        done[name] = style
    unused = [k for k, _ in plan.items() if not any(_pattern(k).match(m) for m in done)
              and plan[k] not in NO_OP_STYLES]
    if unused:
        logger.warning("tensor-parallel plan entries %s match no module of %s", unused, type(model).__name__)
    _fix_head_counts(model, sharded_parents, n)
    heads, kv_heads = check_divisible(model.config, n)
    kv_sharded = any(s in ("colwise", "packed_colwise") and k.rsplit(".", 1)[-1] in ("k_proj", "qkv_proj",
                                                                                    "query_key_value")
                     for k, s in plan.items())
    model._pagedcore_tp_kv_heads = kv_heads // n if kv_sharded else kv_heads
    model._pagedcore_tp = {"rank": rank, "world_size": n, "modules": len(done),
                           "kv_heads": model._pagedcore_tp_kv_heads, "heads": heads // n}
    return model._pagedcore_tp


def _is_lm_head(model: nn.Module, key: str) -> bool:
    lm_head = model.get_output_embeddings()
    return any(m is lm_head for name, m in model.named_modules() if _pattern(key).match(name))


def _check_module(name: str, module: nn.Module, style: str) -> None:
    want = nn.Embedding if style == "embedding_rowwise" else nn.Linear
    # A subclass whose forward is the base's, or an embedding that only scales (Gemma's), shards the same.
    plain = isinstance(module, want) and (type(module).forward is want.forward or hasattr(module, "embed_scale"))
    if not plain:
        raise TensorParallelError(
            f"{name} is a {type(module).__name__}, but tensor parallelism shards plain {want.__name__} modules "
            f"(style {style!r}); quantized checkpoints (compressed-tensors) run with tensor_parallel_size=1")


def _shard_rows(module: nn.Linear, rows: slice, shared: dict) -> None:
    module._pagedcore_full_out = module.out_features
    same = shared.get(id(module.weight))
    weight = same if same is not None else nn.Parameter(module.weight.data[rows].clone(), requires_grad=False)
    module.weight = weight
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.data[rows].clone(), requires_grad=False)
    module.out_features = weight.shape[0]


def _shard_packed_rows(module: nn.Linear, rank: int, n: int, parts: int = 2) -> None:
    module._pagedcore_full_out = module.out_features
    w = module.weight.data.view(parts, module.out_features // parts, -1)
    rows = chunk(w.shape[1], rank, n)
    module.weight = nn.Parameter(w[:, rows].reshape(-1, w.shape[-1]).clone(), requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.data.view(parts, -1)[:, rows].reshape(-1).clone(), requires_grad=False)
    module.out_features = module.weight.shape[0]


def _fix_head_counts(model: nn.Module, parents: set[str], n: int) -> None:
    """Attention modules whose projections were sharded: their own head counts become this rank's."""
    for name in parents:
        module = model.get_submodule(name) if name else model
        for attr in HEAD_COUNT_ATTRS:
            value = module.__dict__.get(attr)
            if isinstance(value, int) and not isinstance(value, bool) and value % n == 0:
                setattr(module, attr, value // n)


class RowParallelLinear(nn.Module):
    """A row-parallel nn.Linear: this rank's columns of the weight (a plain nn.Linear without bias,
    `self.linear`, so packed or int4 kernels take it), the partial products summed over the ranks,
    then the bias once."""

    def __init__(self, linear: nn.Linear, comm, cols: slice, split_input: bool = False):
        super().__init__()
        self.comm, self.cols, self.split_input = comm, cols, split_input
        self.in_features, self.out_features = linear.in_features, linear.out_features
        part = nn.Linear(cols.stop - cols.start, linear.out_features, bias=False, device="meta")
        part.weight = nn.Parameter(linear.weight.data[:, cols].clone(), requires_grad=False)
        self.linear = part
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:  # the input arrives whole: take this rank's columns
            x = x[..., self.cols]
        out = self.comm.all_reduce(self.linear(x))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"cols={self.cols.start}:{self.cols.stop}, world_size={self.comm.world_size}"


class GatherOutput(nn.Module):
    """A column-parallel module whose output is needed whole: the ranks' slices concatenated; for the
    LM head on rank 0 only (the other ranks' logits are never read)."""

    def __init__(self, linear: nn.Linear, comm, full: int, to_rank0: bool):
        super().__init__()
        self.linear, self.comm, self.full, self.to_rank0 = linear, comm, full, to_rank0
        self.width = -(-full // comm.world_size)
        self.in_features, self.out_features = linear.in_features, full

    @property
    def weight(self) -> torch.Tensor:  # get_output_embeddings().weight.shape etc.: this rank's rows
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        if out.shape[-1] < self.width:  # the last rank's shorter slice
            out = torch.nn.functional.pad(out, (0, self.width - out.shape[-1]))
        if self.to_rank0:
            gathered = self.comm.gather_last(out, self.full)
            return out if gathered is None else gathered
        return self.comm.all_gather_last(out, self.full)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary; ids outside them look up zeros; the ranks' lookups summed."""

    def __init__(self, embedding: nn.Embedding, comm, shared: dict):
        super().__init__()
        self.comm = comm
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.rows = chunk(embedding.num_embeddings, comm.rank, comm.world_size)
        same = shared.get(id(embedding.weight))
        self.weight = same if same is not None else nn.Parameter(
            embedding.weight.data[self.rows].clone(), requires_grad=False)
        shared.setdefault(id(embedding.weight), self.weight)
        self.padding_idx = embedding.padding_idx
        # Embeddings that scale (Gemma's) do it in their own forward: keep the scale.
        scale = getattr(embedding, "embed_scale", None)
        self.embed_scale = scale.clone() if isinstance(scale, torch.Tensor) else scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.rows.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0)
        out = self.comm.all_reduce(out)
        scale = self.embed_scale
        if scale is None:
            return out
        return out * (scale.to(out.dtype) if isinstance(scale, torch.Tensor) else scale)
