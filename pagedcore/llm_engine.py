"""LLMEngine: add_request / step / abort. A step is schedule -> execute -> sample -> update -> output."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
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
from pagedcore.scheduler import SampledOutput, Scheduler, SequenceSample
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
    # speculative decoding (zero when off): see SpecDecodeStats
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_max_batch_size: int | None = None  # speculation runs below this batch size now (None: off)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verified sequence emits per step: 1 + its accepted drafts."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

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
        self.eos_token_ids = self._eos_token_ids()
        self.scheduler = Scheduler(self.config, self.kv, policy, on_event=_weak_method(self._on_scheduler_event),
                                   eos_token_ids=self.eos_token_ids)
        self.sampler = Sampler()
        self.logits_processors = [p for ps in hook.pagedcore_logits_processors(config=self.config) for p in ps]
        self.max_model_len = self.config.max_model_len or self.runner.shape.max_position_embeddings
        self.requests: dict[str, RequestState] = {}
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()
        self.total_generated_tokens = 0
        self.spec = self._spec_decoder()
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
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Queue a request. `priority` orders admission under the "priority" scheduling policy (lower
        first, vLLM's convention); `cache_salt` keeps its prompt's cached blocks apart from those of
        requests with another salt (prefix reuse only within one tenant)."""
        p = prompt if isinstance(prompt, ProcessedPrompt) else self.process_prompt(prompt, params)
        request_id = str(next(self._request_counter)) if request_id is None else request_id
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self._check_priority(priority)
        params = p.params
        if (params.best_of or params.n) > params.n or params.use_beam_search:
            output_kind = OutputKind.FINAL_ONLY  # the best n are known only at the end
        state = RequestState(request_id, p.prompt, p.prompt_token_ids, params, output_kind)
        num_seqs = 1 if params.use_beam_search else params.best_of or params.n
        for i in range(num_seqs):
            seq = Sequence(next(self._seq_counter), request_id, i, p.prompt_token_ids, params,
                           self.max_token_capacity(), arrival_time=state.metrics.arrival_time, priority=priority,
                           generator=self._generator(params, i), cache_salt=cache_salt)
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
            if self.spec is not None:
                self.spec.release_finished()
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
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self._can_speculate)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        rows, logits = self.runner.execute(sched)
        sampled = self._sample([sched.scheduled[i][0] for i in rows], logits)
        self.scheduler.update_from_output(sched, sampled)
        if self.spec is not None:
            self.spec.release_finished()
        outputs = self._collect_outputs(sampled)
        generated = sum(max(len(s.token_ids), 1) for s in sampled.samples)  # beams append their own one
        self.total_generated_tokens += generated
        self.pm.hook.pagedcore_step_end(
            stats=self.stats(sched.num_tokens, generated, time.perf_counter() - t0))
        return outputs

    # ---- speculative decoding ------------------------------------------------------------------
    def _spec_decoder(self):
        if self.config.speculative_config is None:
            return None
        from pagedcore.spec_decode.config import SpeculativeConfig
        from pagedcore.spec_decode.spec_decoder import SpecDecoder

        if self.logits_processors:
            # Processors see one row per sequence and its tokens; verification rows are not that.
            logger.warning("speculative decoding off: logits processor plugins are registered")
            return None
        return SpecDecoder(SpeculativeConfig.from_dict(self.config.speculative_config), self)

    def _can_speculate(self, seq: Sequence) -> bool:
        # Beam search scores every beam's next-token distribution: it disables speculation for its request.
        state = self.requests.get(seq.request_id)
        return state is not None and state.beam is None

    def _verify(self, seqs: list[Sequence], logits: torch.Tensor, out: SampledOutput):
        """Hand the sequences with drafts (1 + k logits rows each) to the rejection sampler; return the
        others with their one row each."""
        counts = [1 + s.num_draft_tokens for s in seqs]
        starts = list(itertools.accumulate(counts, initial=0))
        drafted = [i for i, s in enumerate(seqs) if s.num_draft_tokens]
        plain = [i for i, s in enumerate(seqs) if not s.num_draft_tokens]
        dev = logits.device
        rows = [r for i in drafted for r in range(starts[i], starts[i + 1])]
        out.samples += self.spec.verify([seqs[i] for i in drafted], logits[torch.tensor(rows, device=dev)],
                                        self.eos_token_ids, self.output_processor.make_logprobs)
        return [seqs[i] for i in plain], logits[torch.tensor([starts[i] for i in plain], dtype=torch.long, device=dev)]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SampledOutput:
        """The next token of every sequence that reached its end: the sampler's for most, the
        request's beam group's for beam search. Only decides; the scheduler applies it."""
        out = SampledOutput()
        if self.spec is not None and any(seq.num_draft_tokens for seq in seqs):
            seqs, logits = self._verify(seqs, logits, out)
        is_beam = [self.requests[seq.request_id].beam is not None for seq in seqs]
        beam_rows = [(seq, logits[i]) for i, seq in enumerate(seqs) if is_beam[i]]
        if beam_rows:  # beams leave the sampler's batch
            keep = [i for i, beam in enumerate(is_beam) if not beam]
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
            seqs = [seqs[i] for i in keep]
        if seqs:
            out.samples += self._sample_tokens(*self._with_forks(seqs, logits))
        for group in self._ready_beam_groups(beam_rows):
            self._step_beams(group, out)
        return out

    def _with_forks(self, seqs: list[Sequence], logits: torch.Tensor):
        """When a request's prompt is done, its other samples join it: they sample from the same
        logits, and the scheduler forks the prompt's blocks to them (ref counts; only the shared
        partial block is copied, on write)."""
        forks = []
        for row, seq in enumerate(seqs):
            state = self.requests[seq.request_id]
            if state.pending_forks and seq.num_output_tokens == 0:
                forks += [(row, seq, child) for child in state.pending_forks]
                state.pending_forks = []
        parents = [None] * len(seqs) + [parent for _, parent, _ in forks]
        if forks:
            rows = list(range(len(seqs))) + [row for row, _, _ in forks]
            logits = logits[torch.tensor(rows, device=logits.device)]
        return seqs + [child for _, _, child in forks], logits, parents

    @torch.inference_mode()  # logits are inference tensors; processors may edit them in place
    def _sample_tokens(self, seqs: list[Sequence], logits: torch.Tensor, parents: list) -> list[SequenceSample]:
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
        samples = []
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            top = None if seq.logprobs is None else [
                self.output_processor.make_logprobs(token_ids[i], token_logprobs[i], top_ids[i][:k], top_lps[i][:k])]
            samples.append(SequenceSample(seq, [token_ids[i]], [token_logprobs[i]], top, fork_of=parents[i]))
        return samples

    # ---- beam search ---------------------------------------------------------------------------
    def _beam_group(self, params: SamplingParams, first: Sequence) -> BeamGroup:
        max_tokens = first.max_total_tokens - first.num_prompt_tokens
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids) + list(params.stop_token_ids)
        width = params.best_of or params.n
        return BeamGroup(width, params.n, eos, max_tokens, params.length_penalty, params.early_stopping,
                         beams=[first], scores=[0.0])

    def _ready_beam_groups(self, beam_rows) -> list[BeamGroup]:
        """Beams hand their logits to their group; a group steps once every live beam has them."""
        ready = {}
        for seq, row in beam_rows:
            group = self.requests[seq.request_id].beam
            if group.add_logits(seq, row):
                ready[seq.request_id] = group
        return list(ready.values())

    def _step_beams(self, group: BeamGroup, out: SampledOutput) -> None:
        """BeamGroup.step appends its tokens itself; the beams it forks and drops are left to the
        scheduler, through `out`."""
        state = self.requests[group.beams[0].request_id]
        parents = {}

        def fork(parent: Sequence) -> Sequence:
            child = Sequence(next(self._seq_counter), parent.request_id, parent.index, parent.prompt_token_ids,
                             parent.params, parent.max_total_tokens, arrival_time=parent.arrival_time,
                             priority=parent.priority, cache_salt=parent.cache_salt, token_ids=list(parent.token_ids))
            parents[child.seq_id] = parent
            return child

        group.step(fork=fork, drop=lambda seq: out.finished.append((seq, SequenceStatus.FINISHED_ABORTED)))
        out.samples += [SequenceSample(seq, [], [], fork_of=parents.get(seq.seq_id)) for seq in group.beams]
        if group.done:
            out.finished += [(seq, SequenceStatus.FINISHED_STOPPED) for seq in group.beams]
        state.seqs = list(group.beams)

    def _collect_outputs(self, sampled: SampledOutput) -> list[RequestOutput]:
        outputs = []
        for rid in dict.fromkeys(s.seq.request_id for s in sampled.samples):
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
        stats = EngineStats(len(s.running), len(s.waiting), len(s.swapped), self.kv.num_free_blocks,
                            self.kv.num_blocks, s.num_preemptions, scheduled_tokens, generated,
                            self.total_generated_tokens, step_time)
        if self.spec is not None:
            st = self.spec.stats
            stats.spec_num_drafts, stats.spec_num_draft_tokens = st.num_drafts, st.num_draft_tokens
            stats.spec_num_accepted_tokens, stats.spec_max_batch_size = st.num_accepted_tokens, self.spec.max_batch_size
        return stats

    def _check_params(self, params) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be SamplingParams or a dict", "sampling_params")
        params.validate_vocab(self.vocab_size)
        return params

    def _check_priority(self, priority) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        if priority and not getattr(self.scheduler.policy, "uses_priority", False):
            raise InvalidRequestError(
                f"priority {priority} given, but the scheduling policy {self.config.scheduling_policy!r} ignores "
                "priorities (start the engine with scheduling_policy='priority')", "priority")

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
        if kind == "finished":
            info = {"finish_reason": seq.status.value, "num_output_tokens": seq.num_output_tokens, **info}
        if mode is not None:
            info["mode"] = mode
        self._event(kind, seq.request_id, seq.index, info)

    def _event(self, event: str, request_id: str, seq_index: int | None, info: dict) -> None:
        self.pm.hook.pagedcore_request_event(event=event, request_id=request_id, seq_index=seq_index, info=info)


def _weak_method(method):
    """A callback that does not keep its object alive (no engine <-> scheduler reference cycle:
    a dropped engine frees its KV cache at once, not at the next full garbage collection)."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        m = ref()
        if m is not None:
            m(*args, **kwargs)
    return call
