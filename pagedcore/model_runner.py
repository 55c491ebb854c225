"""ModelRunner: the KV cache tensors and one forward pass per step over a flattened, unpadded batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedcore import fused_norms, fused_projections, heap_tuning, huge_pages, lean_layers, packed_linear, vector_math
from pagedcore.attention import hf_glue
from pagedcore.attention.backend import AttentionMetadata
from pagedcore.config import EngineConfig
from pagedcore.decode_stack import DecodeStack
from pagedcore.greedy_head import ArgmaxTokens
from pagedcore.input_batch import InputBatch, StepInputs
from pagedcore.kernels import kv_quant
from pagedcore.scheduler import SchedulerOutput

logger = logging.getLogger("pagedcore")


@dataclass
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelShape":
        c = hf_config.get_text_config()
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(
            num_layers=c.num_hidden_layers,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            max_position_embeddings=getattr(c, "max_position_embeddings", 2048),
        )


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # which of the T tokens' logits are sampled
    sample_rows: list[int]  # which scheduled sequences those belong to


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read available memory from /proc/meminfo")


class ModelRunner:
    def __init__(self, config: EngineConfig, model, backend, device: torch.device, dtype: torch.dtype,
                 prefaulted: huge_pages.Prefault | None = None):
        vector_math.warm_up()  # before any forward or table (the RoPE one) calls into it on two threads at once
        self.config = config
        self.model = model
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.shape = ModelShape.from_hf_config(model.config)
        # Tensor parallelism (distributed/tp_plan.py): this rank holds only its share of the KV heads.
        self.shape.num_kv_heads = getattr(model, "_pagedcore_tp_kv_heads", self.shape.num_kv_heads)
        self.block_size = config.block_size
        self.kv_layout = self._kv_layout()
        self.num_blocks = self._num_blocks()
        self.kv_caches = self._allocate_kv_cache()
        self.num_cpu_blocks = self._num_cpu_blocks()
        self.cpu_kv_caches = self._allocate_kv_cache(self.num_cpu_blocks, torch.device("cpu"))
        hf_glue.install(model)
        if config.tune_heap and device.type == "cpu":
            heap_tuning.install()
        fused_norms.install(model, device)
        lean_layers.install(model, device)
        self.last_layer = lean_layers.last_layer(model, self.shape.num_layers)
        if config.pack_weights:
            logger.info("packed linears: %d", packed_linear.install(model, device))
            logger.info("fused projections: %d", fused_projections.install(model, device))
            if config.tensor_parallel_size == 1:  # (sharding re-slices dense weights)
                logger.info("dense weights released: %d", packed_linear.release_dense(model))
            huge_pages.install(model, device, prefaulted)  # before the decode stack takes the weights' addresses
        self.lora_manager = None
        if config.enable_lora:  # after the packed linears: the LoRA layers wrap whatever forward the base runs
            from pagedcore.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(model, config.max_loras, config.max_lora_rank, device, dtype)
        self.stack_plan = None  # the decode stack's plan of the last forward (None: the stack did not run it)
        self.captured = None
        if config.use_compile(device):
            from pagedcore.capture import CapturedForward

            self.captured = CapturedForward(model, device, config.max_num_seqs)
        self.decode_stack = None
        if config.decode_stack and config.pack_weights and self.lora_manager is None and self.captured is None \
                and config.tensor_parallel_size == 1:
            self.decode_stack = DecodeStack.build(model, self.kv_caches, backend, device)
        self.reset_input_batch()

    def reset_input_batch(self) -> None:
        """Fresh persistent rows: after a failed step, whose diff may be half applied (every live
        sequence is copied in again when next scheduled)."""
        max_len = min(self.config.max_model_len or self.shape.max_position_embeddings, self.num_blocks * self.block_size)
        self.input_batch = InputBatch(self.config.max_num_seqs, max_len, self.block_size)

    def _kv_layout(self) -> kv_quant.KVCacheLayout | None:
        """The quantized cache's layout (None: K/V in the model dtype), checked against the device and backend."""
        name = self.config.kv_cache_dtype
        if name == "auto":
            return None
        kv_quant.check_kv_cache_dtype(name, self.device)
        supported = getattr(self.backend, "kv_cache_dtypes", ("auto",))
        if name not in supported:
            raise ValueError(f"attention backend {self.backend.name!r} supports kv_cache_dtype {', '.join(supported)}; "
                             f"got {name!r}")
        return kv_quant.KVCacheLayout(name, self.block_size, self.shape.num_kv_heads, self.shape.head_dim)

    def bytes_per_block(self) -> int:
        """K and V of every layer; a quantized block counts its data and its scales."""
        s = self.shape
        if self.kv_layout is not None:
            return 2 * s.num_layers * self.kv_layout.block_bytes
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elem

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory
        if budget is None:
            budget = int(available_memory(self.device) * self.config.kv_cache_fraction)
        return budget // self.bytes_per_block()

    def _num_cpu_blocks(self) -> int:
        if self.config.num_cpu_blocks is not None:
            return self.config.num_cpu_blocks
        return self.config.swap_space // self.bytes_per_block()

    def _allocate_kv_cache(self, num_blocks: int | None = None, device: torch.device | None = None):
        s = self.shape
        main = num_blocks is None
        num_blocks = self.num_blocks if main else num_blocks
        if main and num_blocks < 1:
            raise ValueError(f"KV cache budget too small for one block of {self.bytes_per_block()} bytes")
        shape = (num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        device = device or self.device
        # torch.empty: pages are touched only as blocks are used, so start-up does not pay for the
        # whole budget. Backends must never let unwritten slots (possibly NaN) reach an output.
        if self.kv_layout is not None:  # uint8 [num_blocks, block_bytes], scales inside each block
            caches = [(kv_quant.allocate(self.kv_layout, num_blocks, device),
                       kv_quant.allocate(self.kv_layout, num_blocks, device)) for _ in range(s.num_layers)]
        else:
            caches = [(torch.empty(shape, dtype=self.dtype, device=device),
                       torch.empty(shape, dtype=self.dtype, device=device)) for _ in range(s.num_layers)]
        logger.info("%s: %d blocks = %d tokens (%.1f MiB, block_size %d)", "KV cache" if main else "CPU swap space",
                    num_blocks, num_blocks * self.block_size, num_blocks * self.bytes_per_block() / 2**20,
                    self.block_size)
        return caches

    def swap(self, src_caches, dst_caches, mapping: list[tuple[int, int]]) -> None:
        src = torch.tensor([a for a, _ in mapping])
        dst = torch.tensor([b for _, b in mapping])
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
            dk[dst.to(dk.device)] = sk[src.to(sk.device)].to(dk.device)
            dv[dst.to(dv.device)] = sv[src.to(sv.device)].to(dv.device)

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        """Build input ids, positions, the attention metadata, and which rows' logits to keep."""
        self.step_inputs = self.input_batch.apply(sched)  # persistent rows: only this step's changes are copied
        return self._model_input(self.step_inputs)

    def _model_input(self, b: StepInputs) -> ModelInput:
        # On the CPU the tensors are used as they are: a .to() per tensor is an op each (~20 us with the caches cold).
        to = (lambda t: t) if self.device.type == "cpu" else (lambda t: t.to(self.device))
        metadata = AttentionMetadata(
            num_tokens=b.num_tokens,
            query_start_loc=to(b.query_start_loc),
            seq_lens=to(b.seq_lens),
            block_table=to(b.block_table),
            slot_mapping=to(b.slot_mapping),
            max_query_len=b.max_query_len,
            max_seq_len=b.max_seq_len,
            query_start_loc_cpu=b.query_start_loc_cpu,
            seq_lens_cpu=b.seq_lens_cpu,
            block_size=self.block_size,
            num_prompt_tokens_cpu=b.num_prompt_tokens_cpu,
        )
        return ModelInput(to(b.input_ids), to(b.positions), metadata, to(b.logits_indices), b.sample_rows)

    def _lora_mapping(self, sched: SchedulerOutput):
        """Each token's adapter slot for this step; None when no scheduled sequence uses an adapter."""
        if self.lora_manager is None:
            return None
        return self.lora_manager.prepare([seq.lora for seq, _ in sched.scheduled], [n for _, n in sched.scheduled],
                                         self.device)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, argmax_only: bool = False, num_steps: int = 1,
                stop_early=None) -> tuple[list[int], torch.Tensor | ArgmaxTokens]:
        """Run one step; return the scheduled rows that sample and their logits [rows, vocab], or (`argmax_only`:
        the rows need nothing else) their tokens where the decode stack's greedy head gives them.
        `num_steps` > 1 (a decode-only batch whose slots the scheduler reserved that far ahead): where the stack
        gives tokens, each row's token is fed back for up to num_steps - 1 more forwards, stopping early when
        `stop_early()` says so; the tokens then come as ArgmaxTokens [rows, steps run]."""
        rows, out = self._execute(sched, argmax_only)
        if num_steps > 1 and isinstance(out, ArgmaxTokens):
            out = self._decode_more(out, num_steps, stop_early)
        return rows, out

    def _decode_more(self, first: ArgmaxTokens, num_steps: int, stop_early) -> ArgmaxTokens:
        """Multi-step decode (vLLM v0's num_scheduler_steps): the engine's per-step Python (schedule, the input
        batch's diff, sampling, outputs) once per num_steps tokens. The batch advances by its own tensors: each
        row one position on, its slot from the block table the scheduler filled ahead."""
        tokens = [first.token_ids.numpy()]
        b, plan = self.step_inputs, self.stack_plan  # this step's own arrays, advanced in place
        while len(tokens) < num_steps and not (stop_early is not None and stop_early()):
            b.advance(tokens[-1], self.block_size)
            out = self.decode_stack.decode_again(plan, b.input_ids, b.positions, b.slot_mapping, b.seq_lens,
                                                 b.max_seq_len)
            if out is None:  # not the stack's ids path: the K/V written past here is rewritten by later steps
                break
            tokens.append(out.token_ids.numpy())
        return ArgmaxTokens(torch.from_numpy(np.stack(tokens, axis=1)))

    def _execute(self, sched: SchedulerOutput, argmax_only: bool) -> tuple[list[int], torch.Tensor | ArgmaxTokens]:
        # Order matters: swap-outs read blocks that this step may hand to others.
        if sched.blocks_to_swap_out:
            self.swap(self.kv_caches, self.cpu_kv_caches, sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self.swap(self.cpu_kv_caches, self.kv_caches, sched.blocks_to_swap_in)
        if sched.blocks_to_copy:
            src, dst = zip(*sched.blocks_to_copy)
            self.backend.copy_blocks(self.kv_caches, torch.tensor(src, device=self.device),
                                     torch.tensor(dst, device=self.device))
        inp = self.prepare(sched)
        return inp.sample_rows, self._forward(inp, self._lora_mapping(sched), argmax_only)

    def _forward(self, inp: ModelInput, lora_mapping, argmax_only: bool) -> torch.Tensor | ArgmaxTokens:
        """The step's logits, or (argmax_only) the greedy head's tokens where the decode stack gives them."""
        ctx = hf_glue.ForwardContext(self.backend, self.backend.build_metadata(inp.metadata), self.kv_caches,
                                     lora_mapping)
        with hf_glue.forward_context(ctx):
            if self.captured is not None:
                return self.captured(inp.input_ids, inp.positions, inp.logits_indices)
            plan = self.decode_stack.plan(ctx, len(inp.input_ids)) if self.decode_stack is not None else None
            self.stack_plan = plan
            logits = self.decode_stack(inp.input_ids, inp.positions, inp.logits_indices, ctx, plan,
                                       argmax_only) if plan else None
            if logits is not None:
                return logits
            keep = self._keep_rows(inp, lora_mapping)
            if keep is not None:
                ctx.keep_rows, ctx.keep_rows_layer = keep, self.shape.num_layers - 1
            out = self.model(input_ids=inp.input_ids[None], position_ids=inp.positions[None], use_cache=False,
                             logits_to_keep=inp.logits_indices if keep is None else 0)
        return out.logits[0]

    def _keep_rows(self, inp: ModelInput, lora_mapping) -> torch.Tensor | None:
        """The sampled rows, where the last layer can run its o_proj and MLP on them alone: a step with tokens that
        are not sampled (prompt chunks), no adapter (its mapping is per token), the layer still the lean one."""
        n = len(inp.logits_indices)
        if not 0 < n < len(inp.input_ids) or lora_mapping is not None or self.last_layer is None \
                or not lean_layers.keeps_rows(self.last_layer):
            return None
        return inp.logits_indices
