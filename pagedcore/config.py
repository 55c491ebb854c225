"""EngineConfig: every engine setting in one dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

# KV cache element types: "auto" stores K/V in the model dtype; the others quantize them (kernels/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")

if TYPE_CHECKING:  # torch is imported on use: `import pagedcore` alone stays light
    import torch


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the bundled SmolLM2
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    block_size: int = 16
    # "auto" (the model dtype) | "int8" | "fp8_e4m3": K/V quantized on write with a scale per token and KV
    # head, de-quantized by the attention kernels; about half the bytes of bf16, so the budget holds ~1.9x the blocks
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: kv_cache_fraction of free memory
    kv_cache_fraction: float = 0.2
    num_kv_blocks: int | None = None  # overrides both of the above (tests, tight budgets)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's context length
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"  # "auto" (swap long contexts, recompute short) | "swap" | "recompute"
    swap_space: int = 1 << 28  # bytes of CPU memory for swapped-out blocks
    num_cpu_blocks: int | None = None  # overrides swap_space
    swap_min_tokens: int = 256  # "auto" swaps a victim with at least this many computed tokens
    attention_backend: str | None = None  # None: picked from the device through the hook
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (requests' priority: lower runs first) | a plugin's
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default
    # None | "int4": weight-only int4 linears (CPU; single-stream speed) | "gguf": a GGUF's Q4_0/Q4_1/Q8_0
    # linears kept quantized as the file stores them. Pre-quantized HF checkpoints need none (config.json says)
    quantization: str | None = None
    # int4's groups (inputs sharing one fp16 scale and min): 32 as GGUF's Q4_1 (the bundled file's own grid,
    # recovered exactly), 64 or 128 for fewer scale bytes (linears whose width they do not divide stay 16-bit)
    quantization_group_size: int = 32
    pack_weights: bool = True  # CPU: linears run over weights packed once at load (pagedcore/packed_linear.py)
    # CPU: freed step activations stay in the C heap, not faulted in again each step (glibc; pagedcore/heap_tuning.py)
    tune_heap: bool = True
    # CPU: decode steps of Llama-family models run the whole decoder stack as one C++ call (pagedcore/decode_stack.py)
    decode_stack: bool = True
    # Multi-step decode (vLLM v0's name): a step whose rows are all decoding greedily without logprobs, through
    # the decode stack, with nothing waiting to be admitted, runs up to this many forwards, each row's token fed
    # back to the next, before the engine's per-step Python (scheduling, outputs) runs again; tokens then stream
    # in groups of up to this many. 1: one forward a step
    num_scheduler_steps: int = 8
    # Capture the model forward with torch.compile (pagedcore/capture.py); eager if it fails.
    # None: on for CUDA (CUDA graphs), off for CPU, where the captured step measured no faster than
    # the eager C++ lean layers (README, "Captured forward") and the first compile takes minutes.
    compile: bool | None = None
    # Speculative decoding, vLLM's keys (README, "Speculative decoding"): {"method": "ngram" | "draft_model" |
    # "layer_skip", "num_speculative_tokens": k, ...}; JSON on the command line. None: off.
    speculative_config: dict | None = None
    # Constrained decoding (SamplingParams.structured_outputs): "xgrammar" | "llguidance" | a plugin's
    structured_outputs_backend: str = "xgrammar"
    # ---- LoRA adapters (README "LoRA adapters"; pagedcore/lora/; vLLM's names) ----

    # Serve PEFT LoRA adapters per request over the base model; requests of different adapters and of the
    # base model share one batch. Off: no layer is wrapped and requests naming an adapter are refused
    enable_lora: bool = False
    max_loras: int = 4  # adapters in one batch at most (their device slots); requests of others wait
    max_lora_rank: int = 16  # the largest adapter rank served (slot buffers are padded to it)
    # Adapters loaded at start, name -> PEFT directory (JSON on the command line: '{"sql": "/adapters/sql"}');
    # their lora_int_id is their position, from 1
    lora_modules: dict | None = None
    # ---- tensor parallelism (README "Tensor parallelism"; pagedcore/distributed/) ----

    # Ranks the model is sharded over by its Hugging Face tensor-parallel plan (column-parallel q/k/v/gate/up,
    # row-parallel o/down with an all-reduce); each rank holds its share of the heads and of the KV cache
    tensor_parallel_size: int = 1
    # How the ranks start: None spawns tensor_parallel_size - 1 worker processes on this host (rendezvous on a
    # free loopback port); "external_launcher": every rank runs the same script under torchrun (env://
    # rendezvous, ranks may live on several hosts) and rank 0's LLM returns the outputs
    distributed_executor_backend: str | None = None
    # Seconds a rank waits for the others in one collective; a worker that died or hangs fails the step
    # within this time and marks the engine unhealthy
    distributed_timeout: float = 60.0
    # With tensor_parallel_size > 1: shard the embedding and the LM head over the vocabulary where the
    # model's plan does (logits gathered on rank 0); off keeps both whole on every rank
    tensor_parallel_vocab: bool = True
    # ---- limits (README "Limits and failure behaviour"; TGI's names where TGI has the setting) ----

    # Requests admitted and unfinished at once; past it a request is refused at once (HTTP 429 with
    # Retry-After, Triton UNAVAILABLE). None: the KV cache's size in blocks (every admitted request can
    # hold at least one), and at least max_num_seqs.
    max_concurrent_requests: int | None = None
    max_input_tokens: int | None = None  # prompt tokens at most; None: the context (max_model_len, KV cache) less one
    # Prompt plus max_tokens at most (a larger max_tokens is refused, no max_tokens is capped to it);
    # None: the context (max_model_len and the KV cache)
    max_total_tokens: int | None = None
    # Seconds a request may wait for its first step; past it it is refused as overload (429 / UNAVAILABLE).
    # None: no limit (the queue is bounded by max_concurrent_requests)
    max_waiting_time: float | None = None
    # Seconds from arrival to finish for a request that sets no timeout of its own (a shorter one of its
    # own wins); past it the request is aborted and its blocks freed. None: no default deadline
    request_timeout: float | None = None
    max_best_of: int = 16  # n, best_of and beam width at most (sequences one request may fork into)
    max_stop_sequences: int = 16  # stop strings at most, and stop_token_ids at most
    payload_limit: int = 2_000_000  # bytes of one request: HTTP body, Triton input, prompt text
    max_json_depth: int = 32  # nesting of a request's JSON (body, sampling_parameters)
    # This many failed steps in a row mark the engine unhealthy (readiness false, requests refused)
    max_consecutive_step_failures: int = 3
    shutdown_grace_period: float = 30.0  # seconds in-flight requests get to finish at shutdown; then aborted

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "int4", "gguf"):
            raise ValueError(f"quantization must be None, 'int4' or 'gguf', got {self.quantization!r}")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError(f"quantization_group_size must be 32, 64 or 128, got {self.quantization_group_size}")
        for name in ("max_concurrent_requests", "max_input_tokens", "max_total_tokens", "max_best_of",
                     "max_stop_sequences", "payload_limit", "max_json_depth", "max_consecutive_step_failures"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_waiting_time", "request_timeout"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in (None, "mp", "external_launcher"):
            raise ValueError("distributed_executor_backend must be None (spawn workers), 'mp' (the same) or "
                             f"'external_launcher' (torchrun), got {self.distributed_executor_backend!r}")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        if self.tensor_parallel_size > 1 and self.speculative_config is not None:
            raise ValueError("speculative decoding does not run with tensor_parallel_size > 1 (its proposers and "
                             "verification run one model in one process): set one of them off")
        if self.tensor_parallel_size > 1 and self.compile:
            raise ValueError("compile=True does not run with tensor_parallel_size > 1 (the captured forward has no "
                             "collectives): leave compile unset or False")
        if self.enable_lora:
            self._check_lora()
        elif self.lora_modules:
            raise ValueError("lora_modules needs enable_lora=True")
        if self.speculative_config is not None:
            from pagedcore.spec_decode.config import SpeculativeConfig

            SpeculativeConfig.from_dict(self.speculative_config)  # a bad one fails here, with its reason

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}")
        if self.tensor_parallel_size > 1:
            raise ValueError("enable_lora does not run with tensor_parallel_size > 1 (adapter weights are not sharded)")
        if self.compile:
            raise ValueError("enable_lora does not run with compile=True (the captured forward holds no adapter "
                             "products): leave compile unset or False")
        if self.lora_modules is not None and not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in self.lora_modules.items()):
            raise ValueError("lora_modules must map adapter names to PEFT directories (strings)")

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def use_compile(self, device: torch.device) -> bool:
        if self.tensor_parallel_size > 1:
            return False  # the captured graph would hold no all-reduce (README "Tensor parallelism")
        if self.enable_lora:
            return False  # adapters run eagerly (README "LoRA adapters")
        return device.type == "cuda" if self.compile is None else self.compile

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            # fp32 on CPU keeps results equal to transformers' defaults; bf16 is opt-in there.
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
