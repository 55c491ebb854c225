"""A lean CPU forward for Llama-family decoder layers, installed on the engine's model.

transformers' decoder layer spends, per layer and step, ~25 aten ops and several Python frames
outside its seven matmuls (views and transposes, rotate_half's slices/cat/neg, separate residual
adds, silu then mul, the attention-interface indirection). On a 2-core CPU at a decode batch of 64
that is ~30% of the step. This forward keeps the layer's own Linear modules (so int4 weights and
any plugin-replaced projection still run) and replaces the rest with the C++ ops of
`pagedcore.kernels.cpu_ext`, which round where transformers rounds: bf16 results match
transformers' layer bit for bit except where silu's fp32 exp differs by an ulp before rounding.

Only exact classes whose forward is known are patched; anything else keeps transformers' forward
(and still runs paged attention through `hf_glue`).
"""

from __future__ import annotations

from typing import Callable

import torch

from pagedcore import fused_projections
from pagedcore.attention import hf_glue
from pagedcore.fused_norms import LLAMA_STYLE_RMSNORMS, patch_forwards

# Decoder layer class -> how its attention module says which sliding window it uses.
SUPPORTED_LAYERS: dict[str, Callable[[torch.nn.Module], int | None]] = {
    "LlamaDecoderLayer": lambda attn: None,
    "MistralDecoderLayer": lambda attn: getattr(attn.config, "sliding_window", None),
    "Qwen2DecoderLayer": lambda attn: attn.sliding_window,
}

# transformers' ACT2FN["silu"] (SiLUActivation) and torch's own.
SILU_ACTIVATIONS = {"SiLUActivation", "SiLU"}


def install(model: torch.nn.Module, device: torch.device) -> int:
    """Patch every supported decoder layer's forward in place; returns how many."""
    def make(ext, module):
        window_of = SUPPORTED_LAYERS.get(type(module).__name__)
        if window_of is not None and _is_plain_llama_layer(module):
            return _lean_forward(ext, module, window_of(module.self_attn))
        return None

    return patch_forwards(model, device, make)


def _is_plain_llama_layer(layer) -> bool:
    """The parts this forward assumes: q/k/v/o and gate/up/down projections, SiLU, Llama RMSNorms,
    no per-head q/k norms, rotate_half RoPE over the whole head."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    has_parts = all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")) \
        and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    return has_parts and type(mlp.act_fn).__name__ in SILU_ACTIVATIONS \
        and all(type(n).__name__ in LLAMA_STYLE_RMSNORMS and hasattr(n, "variance_epsilon") for n in norms) \
        and not hasattr(attn, "q_norm") and not hasattr(attn, "k_norm")


def _own(layer, attn, mlp) -> bool:
    """The layer still holds the attention and MLP this forward inlines, with their class's forward (a module or a
    forward replaced after start-up runs as the model says: the layer's own forward)."""
    modules = layer._modules
    return modules.get("self_attn") is attn and modules.get("mlp") is mlp \
        and "forward" not in attn.__dict__ and "forward" not in mlp.__dict__


def _lean_forward(ext, layer, sliding_window: int | None):
    attn, mlp = layer.self_attn, layer.mlp
    in_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
    original = type(layer).forward
    head_dim, scale = attn.head_dim, attn.scaling
    # q/k/v (and gate/up) as one matmul only for a few rows (fused_projections.py): fused at every
    # batch, each matmul alone ran 10-15% faster, yet batch-64 steps ran ~5% slower (strided q/k/v
    # downstream); at a few rows the calls' fixed cost is what counts.
    qkv_names, gate_up_names = fused_projections.GROUPS[0][1], fused_projections.GROUPS[1][1]
    layer_idx = attn.layer_idx

    def forward(hidden_states: torch.Tensor, position_embeddings=None, **kwargs) -> torch.Tensor:
        ctx = hf_glue.current()
        keep = ctx.keep_rows if ctx is not None and ctx.keep_rows_layer == layer_idx else None
        if ctx is None or position_embeddings is None or hidden_states.dtype != in_norm.weight.dtype \
                or hidden_states.shape[0] != 1 or position_embeddings[0].shape[-1] != head_dim \
                or not _own(layer, attn, mlp):
            out = original(layer, hidden_states, position_embeddings=position_embeddings, **kwargs)
            return out if keep is None else out[:, keep]
        cos, sin = position_embeddings
        T = hidden_states.shape[1]
        h = ext.rms_norm(hidden_states, in_norm.weight, in_norm.variance_epsilon)
        qkv = fused_projections.get(attn, qkv_names)
        qkv = qkv if qkv is not None and qkv.fuses(T) else None
        q, k, v = qkv(h) if qkv is not None else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
        q, k, v = q.view(T, -1, head_dim), k.view(T, -1, head_dim), v.view(T, -1, head_dim)
        ext.rotary_embedding_(q, k, cos.view(T, head_dim), sin.view(T, head_dim))
        k_cache, v_cache = ctx.kv_caches[attn.layer_idx]
        o = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.metadata, scale=scale, sliding_window=sliding_window)
        o = o.reshape(1, T, -1)
        if keep is not None:  # K/V are written: only these rows' outputs are read, so the rest runs on them alone
            o, hidden_states, T = o[:, keep], hidden_states[:, keep], keep.numel()
        o = attn.o_proj(o)
        hidden_states, h = ext.add_rms_norm(hidden_states, o, post_norm.weight, post_norm.variance_epsilon)
        gate_up = fused_projections.get(mlp, gate_up_names)
        if gate_up is not None and gate_up.silu_mul is not None:
            return hidden_states + mlp.down_proj(gate_up.silu_mul(h))
        gate_up = gate_up if gate_up is not None and gate_up.fuses(T) else None
        gate, up = gate_up(h) if gate_up is not None else (mlp.gate_proj(h), mlp.up_proj(h))
        return hidden_states + mlp.down_proj(ext.silu_and_mul(gate, up))

    forward.keeps_rows = True
    return forward


def last_layer(model: torch.nn.Module, num_layers: int) -> torch.nn.Module | None:
    """The model's last decoder layer where it runs this module's forward, which honours the forward context's
    `keep_rows` (a prompt step then runs that layer's o_proj and MLP on the sampled rows only: ~3% of a 30-layer
    model's prompt FLOPs); None otherwise."""
    for module in model.modules():
        attn = getattr(module, "self_attn", None)
        if getattr(attn, "layer_idx", None) == num_layers - 1 and keeps_rows(module):
            return module
    return None


def keeps_rows(layer: torch.nn.Module) -> bool:
    """Whether the layer's forward is (still) the lean one."""
    return getattr(layer.__dict__.get("forward"), "keeps_rows", False)
