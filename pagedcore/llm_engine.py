"""LLMEngine: add_request / step / abort. A step is schedule -> run -> sample -> postprocess."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from pagedcore.beam_search import BeamGroup
from pagedcore.config import EngineConfig
from pagedcore.detokenizer import IncrementalDetokenizer
from pagedcore.kv_cache_manager import KVCacheManager
from pagedcore.model_runner import ModelRunner
from pagedcore.output_processor import OutputProcessor, RequestState
from pagedcore.outputs import OutputKind, RequestOutput
from pagedcore.plugins import make_plugin_manager
from pagedcore.sampler import Sampler, SamplingBatch
from pagedcore.sampling_params import InvalidRequestError, SamplingParams
from pagedcore.scheduler import Scheduler
from pagedcore.sequence import Sequence, SequenceStatus

logger = logging.getLogger("pagedcore")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_scheduled_tokens: int  # this step
    num_generated_tokens: int  # this step
    total_generated_tokens: int
    step_time: float  # seconds, this step

    @property
    def kv_usage(self) -> float:
        return 1 - self.num_free_blocks / self.num_total_blocks


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, plugins=(), **kwargs):
        self.config = config or EngineConfig(**kwargs)
        if config is not None and kwargs:
            raise TypeError("pass either an EngineConfig or keyword settings, not both")
        self.pm = make_plugin_manager(plugins)
        hook = self.pm.hook
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.device = self.config.torch_device()
        self.dtype = self.config.torch_dtype(self.device)
        self.model, self.tokenizer = hook.pagedcore_load_model(config=self.config)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        if self.config.quantization == "int4":
            from pagedcore.quantization import quantize_int4

            logger.info("int4 weights: %d linear layers", quantize_int4(self.model, self.device))
        backend = hook.pagedcore_attention_backend(name=self.config.attention_backend, device=self.device)
        if backend is None:
            raise ValueError(f"no attention backend {self.config.attention_backend!r} for {self.device}")
        self.runner = ModelRunner(self.config, self.model, backend, self.device, self.model.dtype)
        self.kv = KVCacheManager(self.runner.num_blocks, self.config.block_size,
                                 enable_prefix_caching=self.config.enable_prefix_caching,
                                 num_cpu_blocks=self.runner.num_cpu_blocks)
        policy = hook.pagedcore_scheduling_policy(name=self.config.scheduling_policy)
        if policy is None:
            raise ValueError(f"unknown scheduling policy {self.config.scheduling_policy!r}")
        self.scheduler = Scheduler(self.config, self.kv, policy, on_event=self._on_scheduler_event)
        self.sampler = Sampler()
        self.logits_processors = [p for ps in hook.pagedcore_logits_processors(config=self.config) for p in ps]
        self.max_model_len = self.config.max_model_len or self.runner.shape.max_position_embeddings
        self.eos_token_ids = self._eos_token_ids()
        self.requests: dict[str, RequestState] = {}
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()
        self.total_generated_tokens = 0
        logger.info("pagedcore engine ready: %s, %s, %s backend; KV cache %d blocks = %d tokens",
                    self.device, self.dtype, backend.name, self.kv.num_blocks, self.kv.num_blocks * self.config.block_size)

    # ---- requests -------------------------------------------------------------------------
    def process_prompt(self, prompt: str | list[int], params: SamplingParams | dict | None) -> ProcessedPrompt:
        """Validate and tokenize; pure (touches no engine state), so callers may run it anywhere."""
        try:
            return self._process_prompt(prompt, params)
        except InvalidRequestError as e:
            self._event("rejected", None, None, {"field": e.field, "error": str(e)})
            raise

    def _process_prompt(self, prompt, params) -> ProcessedPrompt:
        params = self._check_params(params)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token ids {bad[:5]} outside the vocabulary ({self.vocab_size})", "prompt")
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        limit = self.max_token_capacity()
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens, but at most {limit - 1} fit (max_model_len {self.max_model_len}, "
                f"KV cache {self.kv.num_blocks * self.config.block_size} tokens"
                + ("" if self.config.enable_chunked_prefill else
                   f", max_num_batched_tokens {self.config.max_num_batched_tokens} without chunked prefill")
                + ") leaving room for one new token",
                "prompt")
        return ProcessedPrompt(text, ids, params)

    def add_request(self, request_id: str | None, prompt: str | list[int] | ProcessedPrompt,
                    params: SamplingParams | dict | None = None, *, output_kind: OutputKind = OutputKind.CUMULATIVE,
                    priority: int = 0) -> str:
        p = prompt if isinstance(prompt, ProcessedPrompt) else self.process_prompt(prompt, params)
        request_id = str(next(self._request_counter)) if request_id is None else request_id
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        params = p.params
        if (params.best_of or params.n) > params.n or params.use_beam_search:
            output_kind = OutputKind.FINAL_ONLY  # the best n are known only at the end
        state = RequestState(request_id, p.prompt, p.prompt_token_ids, params, output_kind)
        num_seqs = 1 if params.use_beam_search else params.best_of or params.n
        for i in range(num_seqs):
            seq = Sequence(next(self._seq_counter), request_id, i, p.prompt_token_ids, params,
                           self.max_token_capacity(), arrival_time=state.metrics.arrival_time, priority=priority,
                           generator=self._generator(params, i))
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, p.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            state.seqs.append(seq)
        # Only the first sample prefills; the others fork its blocks when its prompt is done.
        self.scheduler.add(state.seqs[0])
        state.pending_forks = state.seqs[1:]
        if params.use_beam_search:
            state.beam = self._beam_group(params, state.seqs[0])
        self.requests[request_id] = state
        self._event("added", request_id, None, {"num_prompt_tokens": len(p.prompt_token_ids)})
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._event("aborted", rid, None, {})

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def max_token_capacity(self) -> int:
        cap = min(self.max_model_len, self.kv.num_blocks * self.config.block_size)
        if not self.config.enable_chunked_prefill:
            # A (re)prefill must fit one step's budget, or the sequence would wait forever.
            cap = min(cap, self.config.max_num_batched_tokens)
        return cap

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        rows, logits = self.runner.execute(sched)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)
        sampled = [sched.scheduled[i][0] for i in rows]
        sampled, logits, beam_rows = self._split_beams(sampled, logits)
        sampled, logits = self._fork_samples(sampled, logits)
        if sampled:
            self._sample_and_append(sampled, logits)
        beam_seqs = self._step_beams(beam_rows)
        outputs = self._collect_outputs(sampled + beam_seqs)
        self.pm.hook.pagedcore_step_end(stats=self.stats(sched.num_tokens, len(sampled), time.perf_counter() - t0))
        return outputs

    # ---- beam search ---------------------------------------------------------------------------
    def _beam_group(self, params: SamplingParams, first: Sequence) -> BeamGroup:
        max_tokens = first.max_total_tokens - first.num_prompt_tokens
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids) + list(params.stop_token_ids)
        width = params.best_of or params.n
        return BeamGroup(width, params.n, eos, max_tokens, params.length_penalty, params.early_stopping,
                         beams=[first], scores=[0.0])

    def _split_beams(self, sampled, logits):
        """Beam-search sequences leave the sampler's batch; their logits go to their group."""
        beam_rows = [(seq, i) for i, seq in enumerate(sampled) if self.requests[seq.request_id].beam is not None]
        if not beam_rows:
            return sampled, logits, []
        keep = [i for i, seq in enumerate(sampled) if self.requests[seq.request_id].beam is None]
        beams = [(seq, logits[i]) for seq, i in beam_rows]
        return [sampled[i] for i in keep], logits[torch.tensor(keep, dtype=torch.long, device=logits.device)], beams

    def _step_beams(self, beam_rows) -> list[Sequence]:
        ready = []
        for seq, row in beam_rows:
            group = self.requests[seq.request_id].beam
            if group.add_logits(seq, row) and group not in ready:
                ready.append(group)
        touched = []
        for group in ready:
            state = self.requests[group.beams[0].request_id]
            group.step(fork=lambda parent, st=state: self._fork_beam(st, parent),
                       drop=lambda seq: self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED))
            self.total_generated_tokens += len(group.beams)
            if group.done:
                for seq in group.beams:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            state.seqs = list(group.beams)
            touched.append(group.beams[0])
        return touched

    def _fork_beam(self, state: RequestState, parent: Sequence) -> Sequence:
        child = Sequence(next(self._seq_counter), parent.request_id, parent.index, parent.prompt_token_ids,
                         parent.params, parent.max_total_tokens, arrival_time=parent.arrival_time,
                         token_ids=list(parent.token_ids))
        self.kv.fork(parent, child)
        self.scheduler.add_running(child)
        return child

    def _fork_samples(self, sampled: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """When a request's prompt is done, its other samples fork the prompt's blocks (ref counts;
        only the shared partial block is copied, on write) and sample from the same logits."""
        forks = []
        for row, seq in enumerate(sampled):
            state = self.requests[seq.request_id]
            if state.pending_forks and seq.num_output_tokens == 0:
                for child in state.pending_forks:
                    self.kv.fork(seq, child)
                    self.scheduler.add_running(child)
                    forks.append((row, child))
                state.pending_forks = []
        if not forks:
            return sampled, logits
        rows = list(range(len(sampled))) + [row for row, _ in forks]
        return sampled + [child for _, child in forks], logits[torch.tensor(rows, device=logits.device)]

    @torch.inference_mode()  # logits are inference tensors; processors may edit them in place
    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        for proc in self.logits_processors:
            logits = proc(logits, seqs)
        batch = SamplingBatch.build(
            [s.params for s in seqs], [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
            [s.generator for s in seqs], self.eos_token_ids, logits.shape[-1], logits.device)
        out = self.sampler(logits, batch)
        token_ids = out.sampled_token_ids.tolist()
        token_logprobs = out.sampled_logprobs.tolist()
        top_ids = out.topk_token_ids.tolist() if out.topk_token_ids is not None else None
        top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
        self.total_generated_tokens += len(seqs)
        for i, seq in enumerate(seqs):
            seq.append_token(token_ids[i], token_logprobs[i])
            if seq.logprobs is not None:
                k = seq.params.logprobs
                seq.logprobs.append(self.output_processor.make_logprobs(
                    token_ids[i], token_logprobs[i], top_ids[i][:k], top_lps[i][:k]))
            self._check_stop(seq)

    def _check_stop(self, seq: Sequence) -> None:
        p = seq.params
        token = seq.token_ids[-1]
        can_stop = seq.num_output_tokens >= p.min_tokens
        det = seq.detokenizer
        if can_stop:
            stop_str = det.update([token])
        else:
            # As in vLLM, stop strings count only once min_tokens are out: a match now must not
            # cut the text (the detokenizer would also ignore every later token). The stop list
            # stays set for streaming, which withholds a tail that may still become one.
            stop, det.stop = det.stop, []
            try:
                stop_str = det.update([token])
            finally:
                det.stop = stop
        status = None
        if stop_str is not None and can_stop:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_str
        elif can_stop and not p.ignore_eos and token in self.eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        elif can_stop and token in p.stop_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) \
                or seq.num_tokens >= seq.max_total_tokens:
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            seq.finished_time = time.monotonic()
            self.scheduler.finish(seq, status)
            self._event("finished", seq.request_id, seq.index,
                        {"finish_reason": status.value, "num_output_tokens": seq.num_output_tokens,
                         "num_preemptions": seq.num_preemptions})

    def _collect_outputs(self, sampled: list[Sequence]) -> list[RequestOutput]:
        outputs = []
        for rid in dict.fromkeys(s.request_id for s in sampled):
            state = self.requests[rid]
            out = self.output_processor.make_output(state)
            if out is not None:
                outputs.append(out)
            if state.finished:
                del self.requests[rid]
        return outputs

    # ---- helpers --------------------------------------------------------------------------
    def stats(self, scheduled_tokens: int = 0, generated: int = 0, step_time: float = 0.0) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), len(s.swapped), self.kv.num_free_blocks,
                           self.kv.num_blocks, s.num_preemptions, scheduled_tokens, generated,
                           self.total_generated_tokens, step_time)

    def _check_params(self, params) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be SamplingParams or a dict", "sampling_params")
        params.validate_vocab(self.vocab_size)
        return params

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        # Each sample of a seeded request gets its own stream, reproducible whatever the batch.
        return torch.Generator(device=self.device).manual_seed(params.seed + index * 1_000_003)

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _on_scheduler_event(self, kind: str, seq: Sequence, mode: str | None = None) -> None:
        if kind == "scheduled":
            state = self.requests.get(seq.request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = time.monotonic()
        info = {"num_preemptions": seq.num_preemptions}
        if mode is not None:
            info["mode"] = mode
        self._event(kind, seq.request_id, seq.index, info)

    def _event(self, event: str, request_id: str, seq_index: int | None, info: dict) -> None:
        self.pm.hook.pagedcore_request_event(event=event, request_id=request_id, seq_index=seq_index, info=info)
