"""The decoder stack at decode as one C++ call (kernels/csrc/cpu_decode_stack.cpp), on the CPU.

At a few rows a step is bound by reading the weights, yet layer by layer (lean_layers.py) a bf16 step
still spent about a third of its time outside the matmuls: ~10 Python-dispatched ops per layer, each
with its dispatch, an output allocation and a thread fork/join. The stack runs every layer's norms,
projections, RoPE, cache write and paged attention in one parallel region (a barrier between phases),
over the very weights the engine packed (packed_linear.py, quantization.py, fused by
fused_projections.py), so its results equal the layer-by-layer path's bit for bit.

It is built from what the engine installed and used only while all of it is still in place: anything
that replaces a projection or a layer's forward afterwards (a LoRA layer, a plugin) turns it off, as do
steps it does not run (prefill rows, a quantized KV cache, another attention backend): those go layer by
layer. `EngineConfig.decode_stack=False` turns it off altogether.

fp32 weights that are exactly 4-bit per group of 32 (each value fma(q, d, m), q in 0..15, d and m fp16: what
a GGUF Q4_1 checkpoint such as the bundled model de-quantizes to) are found when the stack is built
(kernels/csrc/cpu_exact_int4.cpp) and kept as int4 panels beside the fp32 ones: decode steps of up to 32 rows widen
them back to the same fp32 values in registers (6-row tiles to 12 rows, then tall tiles of 12-24 rows and one
panel; past 36, if raised, into a buffer the row tiles share) and run the same FMA chains, reading 5 bits a weight
instead of 32, with results bit for bit those of the fp32 panels (tests/test_exact_int4.py).

On CPUs with AMX tiles bf16 weights are in VNNI pairs (vnni_layout.py) and the stack runs them through AMX
tiles in its region, as it runs the panels. With the pairs off there, from onednn_linear.ROWS rows it runs each
linear through oneDNN's pre-packed matmul between parallel regions (oneDNN parallelises by itself), the same
weights the layers would run: a 64-row bf16 step 50 -> 40 ms against layer by layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedcore import fused_projections, lean_layers, onednn_linear, quantization, vnni_layout
from pagedcore.greedy_head import ArgmaxTokens, GreedyHead
from pagedcore.kernels import cpu_ext, kv_quant
from pagedcore.kernels.ext_decode_plan import ExtDecodePlan, _ext_plan, prompt_rows_of_one_token
from pagedcore.quantization import Int4Linear, Int8Linear

logger = logging.getLogger("pagedcore")

SUPPORTED_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Rotary embeddings whose cos/sin depend on the position alone (not on the sequence length, as "dynamic" and
# "longrope" do): looked up in a table made once by the model's own rotary module, not recomputed (~0.3 ms) per step.
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
ROPE_TABLE_MAX = 8192  # positions in the table; later ones are computed per step
QKV, GATE_UP = fused_projections.GROUPS[0][1], fused_projections.GROUPS[1][1]


@dataclass(frozen=True)
class _Installed:
    """A module the stack runs in its own way: still `parent.name`, still with the forward it had."""

    parent: nn.Module
    name: str
    module: nn.Module
    forward: object

    @classmethod
    def of(cls, parent: nn.Module, name: str) -> "_Installed":
        module = getattr(parent, name)
        return cls(parent, name, module, module.__dict__.get("forward"))

    def intact(self) -> bool:
        return getattr(self.parent, self.name) is self.module and self.module.__dict__.get("forward") is self.forward


class DecodeStack:
    def __init__(self, ext, model: nn.Module, kv_caches: list, head_dim: int):
        self.ext, self.model, self.base, self.kv_caches, self.head_dim = ext, model, model.model, kv_caches, head_dim
        c = model.config.get_text_config()
        self.stack = ext.DecodeStack(c.hidden_size, c.num_attention_heads, kv_caches[0][0].shape[2], head_dim,
                                     c.intermediate_size)
        self.installed: list[_Installed] = []
        self._again = None  # the plan of the last call that a multi-step decode may run again (decode_again)
        self._checks = None  # (dicts, keys, values): each installed module in its parent's modules, its forward
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        for layer, (k_cache, v_cache) in zip(self.base.layers, kv_caches):
            self._add_layer(layer, k_cache, v_cache)
        # From onednn_linear.ROWS rows the layers' matmuls run oneDNN (AMX CPUs), faster there than the panels:
        # the stack runs them itself where every layer has them, else it gives way to the layers.
        onednn = [_onednn_linears(layer) for layer in self.base.layers]
        packed = (getattr(m, "_pagedcore_packed", None) for m in self.base.layers.modules())
        rows = onednn_linear.min_rows(any(p is not None and vnni_layout.is_packed(p) for p in packed))
        self.onednn_rows = rows if all(onednn) and rows is not None else 0
        for i, linears in enumerate(onednn if self.onednn_rows else ()):
            self.stack.add_onednn(i, linears)
        partial = any(onednn) or any(getattr(i.module, "_pagedcore_onednn", None) is not None for i in self.installed)
        self.max_rows = rows - 1 if partial and not self.onednn_rows and rows else None
        self.greedy_head = GreedyHead.build(ext, model)
        self._io_checks = self._set_io()
        if self.stack.exact_int4_linears:
            logger.info("decode stack: %d of %d linears are exactly 4-bit per group (a GGUF Q4_1 checkpoint's "
                        "weights): decode rows read them as int4", self.stack.exact_int4_linears, 4 * len(self.base.layers))

    @classmethod
    def build(cls, model: nn.Module, kv_caches: list, backend, device: torch.device) -> "DecodeStack | None":
        """The stack over `model`'s installed layers, or None (with the reason logged) where it cannot run."""
        ext = cpu_ext.load() if device.type == "cpu" else None
        reason = _unsupported(ext, model, kv_caches, backend)
        if reason is None:
            try:
                return cls(ext, model, kv_caches, kv_caches[0][0].shape[3])
            except (RuntimeError, ValueError, TypeError) as e:  # a layout the kernel rejects
                reason = str(e).splitlines()[0]
        logger.info("decode stack off: %s", reason)
        return None

    def _add_layer(self, layer: nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = fused_projections.get(attn, QKV), fused_projections.get(mlp, GATE_UP)
        if qkv is None or gate_up is None:
            raise ValueError(f"layer {attn.layer_idx}: q/k/v or gate/up not fused")
        window = lean_layers.SUPPORTED_LAYERS[type(layer).__name__](attn) or 0
        norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
        self.stack.add_layer(norm_in.weight.detach(), norm_in.variance_epsilon, norm_post.weight.detach(),
                             norm_post.variance_epsilon, attn.scaling, window, k_cache, v_cache, qkv.spec,
                             _linear_spec(attn.o_proj), gate_up.spec, _linear_spec(mlp.down_proj))
        self.installed += [_Installed.of(layer.self_attn, n) for n in (*QKV, "o_proj")]
        self.installed += [_Installed.of(layer.mlp, n) for n in (*GATE_UP, "down_proj")]
        self.installed += [_Installed.of(self.base.layers, str(attn.layer_idx)),
                           _Installed.of(layer, "self_attn"), _Installed.of(layer, "mlp")]

    def plan(self, ctx, num_tokens: int) -> ExtDecodePlan | None:
        """This step's decode plan if the stack runs it: every row one sequence's only query, nothing replaced."""
        md = ctx.metadata.common if hasattr(ctx.metadata, "common") else None
        if md is None or ctx.lora_mapping is not None or ctx.kv_caches is not self.kv_caches:
            return None
        qsl = md.query_start_loc_cpu
        if self.max_rows is not None and num_tokens > self.max_rows:
            return None
        if not 0 < len(qsl) - 1 == qsl[-1] == num_tokens or not self._intact():
            return None
        if prompt_rows_of_one_token(self.ext, md, self.head_dim, ctx.metadata.decode_plans):
            return None  # a prompt's token: the prefill kernel's (cpu_paged_attention), so the layers run this step
        return _ext_plan(md, ctx.metadata.decode_plans)

    def _intact(self) -> bool:
        """Every module the stack stands in for is still in place, with the forward it had: plain dict lookups
        (nn.Module.__getattr__ would cost ~1 ms a step over ~270 modules), in the C++ ops, which ask for the dicts'
        memory ahead (a step starts with them evicted by the weights it streamed: ~0.25 -> ~0.07 ms, Zen 4)."""
        if self._checks is None:
            dicts, keys, values = [], [], []
            for i in self.installed:
                dicts += [i.parent._modules, i.module.__dict__]
                keys += [i.name, "forward"]
                values += [i.module, i.forward]
            self._checks = dicts, keys, values
        return self.ext.objects_in_place(*self._checks)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, ctx,
                 plan: ExtDecodePlan, argmax_only: bool = False) -> torch.Tensor | ArgmaxTokens | None:
        """Logits [len(logits_indices), vocab], as the model's forward gives them, or with `argmax_only` (the
        step's rows need nothing else) their argmax where the greedy head gives it; None if the step's rotary
        embedding is not over the whole head (the layers' own forward then runs it)."""
        md = ctx.metadata.common
        self._again = None
        if self._io_checks is not None and md.max_seq_len <= self._rope_table[0].shape[0] and self._io_intact():
            # The embedding, RoPE and final norm inside the stack's call (set_io): each was a torch op run with the
            # caches cold (after the weights streamed), ~0.25 ms of a one-row step.
            hidden = self.stack.forward_ids(input_ids, positions, md.slot_mapping, plan.rows, plan.block_table,
                                            plan.seq_lens, quantization.INT8_ACTIVATION_ROWS, self.onednn_rows)
        else:
            hidden = self.base.embed_tokens(input_ids)
            cos, sin = self._rotary(hidden, positions, md.max_seq_len)
            if cos.shape[-1] != self.head_dim or cos.dtype != hidden.dtype:
                return None
            hidden = self.base.norm(self.stack.forward(hidden, cos, sin, md.slot_mapping, plan.rows, plan.block_table,
                                                       plan.seq_lens, quantization.INT8_ACTIVATION_ROWS,
                                                       self.onednn_rows))
        # Every row one sequence's only query: all of them sample unless fewer are asked for (the norm is per row).
        if len(logits_indices) != len(hidden):
            hidden = hidden[logits_indices]
        tokens = self.greedy_head.argmax(hidden) if argmax_only and self.greedy_head is not None else None
        if tokens is not None and self._io_checks is not None and len(plan.rows) == len(input_ids) == len(tokens.token_ids):
            self._again = plan  # (set only where the ids path ran: the layered one returned from its branch above)
        return tokens if tokens is not None else self.model.lm_head(hidden)

    def decode_again(self, plan: ExtDecodePlan, input_ids: torch.Tensor, positions: torch.Tensor,
                     slot_mapping: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int) -> ArgmaxTokens | None:
        """A multi-step decode's next forward: the rows of this step's call (`plan`, one query each) one position
        on, with their new lengths, through the ids path and the greedy head as that call ran them; None where it
        did not. The modules are not checked again: only the stack ran since that call checked them."""
        if plan is None or self._again is not plan or max_seq_len > self._rope_table[0].shape[0]:
            return None
        hidden = self.stack.forward_ids(input_ids, positions, slot_mapping, plan.rows, plan.block_table, seq_lens,
                                        quantization.INT8_ACTIVATION_ROWS, self.onednn_rows)
        tokens = self.greedy_head.argmax(hidden)
        if tokens is None:
            self._again = None
        return tokens

    def _set_io(self) -> tuple | None:
        """Give the stack the embedding table, RoPE tables and final norm weight that the model's own modules use,
        where the stack computes exactly what they do: a plain embedding (or the tied one's lookup in the greedy
        head's rows, packed_linear._panel_lookup), a position-only rotary embedding, the fused RMSNorm. Returns
        what must stay in place for that ((dicts, keys, values) as _intact checks), or None."""
        embed, norm, head = self.base.embed_tokens, self.base.norm, getattr(self.model, "lm_head", None)
        forward = embed.__dict__.get("forward")
        if type(embed) is nn.Embedding and forward is None:
            table, source = embed.weight.detach(), (embed._parameters, "weight", embed.weight)
        elif "_panel_lookup" in getattr(forward, "__qualname__", "") and head is not None:
            rows = head.__dict__.get("_pagedcore_rows")
            if rows is None or rows[0] is not getattr(head, "_pagedcore_packed", None):
                return None
            table, source = rows[1], (head.__dict__, "_pagedcore_rows", rows)
        else:
            return None
        weight = getattr(norm, "weight", None)
        if "_fused_rmsnorm" not in getattr(norm.__dict__.get("forward"), "__qualname__", "") or weight is None \
                or getattr(self.base.rotary_emb, "rope_type", None) not in STATIC_ROPE_TYPES:
            return None
        dtype = weight.dtype
        cos, sin = self._rope_tables(dtype)
        if table.dtype != dtype or table.dim() != 2 or not table.is_contiguous() or cos.shape[-1] != self.head_dim:
            return None
        self.stack.set_io(table, cos, sin, weight.detach(), norm.variance_epsilon)
        self.installed += [_Installed.of(self.base, "embed_tokens"), _Installed.of(self.base, "norm")]
        self._checks = None
        return ([source[0], norm._parameters], [source[1], "weight"], [source[2], weight])

    def _io_intact(self) -> bool:
        """The embedding table and final norm weight given to set_io are still the ones the modules use."""
        return self.ext.objects_in_place(*self._io_checks)

    def _rope_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [ROPE_TABLE_MAX, head_dim] in `dtype`, made once by the model's rotary module."""
        if self._rope_table is None or self._rope_table[0].dtype != dtype:
            positions = torch.arange(ROPE_TABLE_MAX)[None]  # the rotary module reads only x's dtype and device
            self._rope_table = tuple(t[0].contiguous() for t in self.base.rotary_emb(torch.zeros(1, 1, dtype=dtype),
                                                                                     positions))
        return self._rope_table


    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] of the positions (each below max_seq_len), as the model's rotary module gives them."""
        rotary = self.base.rotary_emb
        if getattr(rotary, "rope_type", None) in STATIC_ROPE_TYPES:
            table = self._rope_tables(hidden.dtype)
            if max_seq_len <= table[0].shape[0]:
                return tuple(t.index_select(0, positions) for t in table)
        cos, sin = rotary(hidden[None], positions[None])
        return cos[0].contiguous(), sin[0].contiguous()


def _onednn_linears(layer: nn.Module) -> tuple | None:
    """((weight, bias) x 4: q/k/v, o, gate/up, down) in oneDNN's layout, as the layer by layer path runs them
    (fused_projections.py, packed_linear.py), or None where one is missing."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = fused_projections.get(attn, QKV), fused_projections.get(mlp, GATE_UP)
    if qkv is None or gate_up is None or not (qkv.onednn and gate_up.onednn):
        return None
    singles = [getattr(m, "_pagedcore_onednn", None) for m in (attn.o_proj, mlp.down_proj)]
    if any(w is None for w in singles):
        return None
    o, down = ((w, None if m.bias is None else m.bias.detach()) for w, m in zip(singles, (attn.o_proj, mlp.down_proj)))
    return (qkv.onednn_weight, qkv.spec[2]), o, (gate_up.onednn_weight, gate_up.spec[2]), down


def _linear_spec(module: nn.Module) -> tuple:
    """(packed, scale_min, bias, out_features, group_size, int8_rows, zero_point) of a packed or int4 linear."""
    bias = None if module.bias is None else module.bias.detach()
    if type(module) is nn.Linear and getattr(module, "_pagedcore_packed", None) is not None:
        return module._pagedcore_packed, None, bias, module.out_features, 0, 0, False
    if type(module) is Int4Linear and module.ext is not None and module.input_perm is None:
        return (module.packed, module.scales_and_zeros, bias, module.out_features, module.group_size,
                -1 if module.int8_activations else 0, module.zero_point)
    if type(module) is Int8Linear and module.ext is not None:
        return (module.qweight, module.scale, bias, module.out_features, module.group_size or module.in_features,
                -1 if module.int8_activations else 0, False)
    raise ValueError(f"{type(module).__name__} is neither a packed, an int4 nor an int8 linear")


def _unsupported(ext, model: nn.Module, kv_caches: list, backend) -> str | None:
    """Why the stack cannot run this model, or None."""
    if ext is None or not hasattr(ext, "DecodeStack"):
        return "no C++ CPU ops"
    if type(model).__name__ not in SUPPORTED_MODELS:
        return f"{type(model).__name__} is not one of {', '.join(SUPPORTED_MODELS)}"
    if getattr(backend, "name", None) != "torch":
        return f"attention backend {getattr(backend, 'name', backend)!r} (the stack runs the C++ paged attention)"
    if not kv_caches or any(kv_quant.layout_of(k) is not None for k, _ in kv_caches):
        return "quantized KV cache"
    hooked = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked or nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return f"forward hooks on {type(hooked[0]).__name__ if hooked else 'every module'} (the stack would skip them)"
    dtype = model.model.embed_tokens.weight.dtype if model.model.embed_tokens.weight.numel() else None
    layers = getattr(model.model, "layers", [])
    if len(layers) != len(kv_caches) or not all(
            "_lean_forward" in getattr(layer.__dict__.get("forward"), "__qualname__", "") for layer in layers):
        return "not every decoder layer runs the lean forward"
    dtypes = {k.dtype for k, _ in kv_caches} | {layer.input_layernorm.weight.dtype for layer in layers}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.bfloat16) or dtype not in (None, *dtypes):
        return f"dtypes {sorted(map(str, dtypes))} (one of float32 / bfloat16 for weights and KV cache)"
    return None
