"""LLMEngine: add_request / step / abort. A step is schedule -> execute -> sample -> update -> output."""

from __future__ import annotations

import functools
import itertools
import logging
import time
import weakref
from typing import Callable

import torch

from pagedcore import huge_pages
from pagedcore.beam_search import BeamGroup
from pagedcore.config import EngineConfig
from pagedcore.detokenizer import IncrementalDetokenizer
from pagedcore.input_processor import InputProcessor, ProcessedPrompt
from pagedcore.intake_api import IntakeAPI
from pagedcore.kv_cache_manager import KVCacheManager
from pagedcore.limits import (ABORT_REASONS, REJECT_REASONS, OverloadedError, RequestCounts, RequestFailedError,
                              RequestTimeoutError)
from pagedcore.lora.engine_api import LoRAEngineAPI
from pagedcore.lora.registry import LoRARegistry
from pagedcore.metrics import EngineStats
from pagedcore.model_runner import ModelRunner
from pagedcore.output_processor import OutputProcessor, RequestState
from pagedcore.outputs import OutputKind, RequestOutput
from pagedcore.plugins import make_plugin_manager
from pagedcore.sample_step import SampleStep, eos_token_ids, seq_generator
from pagedcore.sampler import Sampler
from pagedcore.sampling_params import InvalidRequestError, SamplingParams
from pagedcore.scheduler import SampledOutput, Scheduler
from pagedcore.sequence import Sequence, SequenceStatus
from pagedcore.spec_decode import make_spec_decoder
from pagedcore.structured_output.manager import StructuredOutputManager, make_backend

logger = logging.getLogger("pagedcore")


class LLMEngine(IntakeAPI, LoRAEngineAPI):
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
        prefaulted = huge_pages.prefault(self.config, self.device, self.dtype)  # faulted while the model loads
        self.model, self.tokenizer = hook.pagedcore_load_model(config=self.config)
        self.vocab_size = self.model.get_output_embeddings().out_features  # quantized heads keep no .weight
        self.executor = None  # tensor parallelism (pagedcore/distributed/): rank 0's side
        if self.config.tensor_parallel_size > 1:
            from pagedcore.distributed.executor import TPExecutor

            self.executor = TPExecutor(self.config, self.model, self.device)  # workers up, this rank's shard
            # A dropped engine (one whose start failed below included) leaves no worker behind.
            weakref.finalize(self, self.executor.shutdown)
        if self.config.quantization == "int4":
            from pagedcore.quantization import quantize_int4

            logger.info("int4 weights: %d linear layers",
                        quantize_int4(self.model, self.device, self.config.quantization_group_size))
        backend = hook.pagedcore_attention_backend(name=self.config.attention_backend, device=self.device)
        if backend is None:
            raise ValueError(f"no attention backend {self.config.attention_backend!r} for {self.device}")
        if self.executor is None:
            self.runner = ModelRunner(self.config, self.model, backend, self.device, self.model.dtype, prefaulted)
        else:  # rank 0's runner: it broadcasts each step to the workers (distributed/executor.py)
            self.runner = self.executor.make_runner(backend, self.model.dtype)
        self.kv = KVCacheManager(self.runner.num_blocks, self.config.block_size,
                                 enable_prefix_caching=self.config.enable_prefix_caching,
                                 num_cpu_blocks=self.runner.num_cpu_blocks)
        policy = hook.pagedcore_scheduling_policy(name=self.config.scheduling_policy)
        if policy is None:
            raise ValueError(f"unknown scheduling policy {self.config.scheduling_policy!r}")
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self.scheduler = Scheduler(self.config, self.kv, policy, on_event=_weak_method(self._on_scheduler_event),
                                   eos_token_ids=self.eos_token_ids)
        self.sampler = Sampler()
        self.logits_processors = [p for ps in hook.pagedcore_logits_processors(config=self.config) for p in ps]
        self.max_model_len = self.config.max_model_len or self.runner.shape.max_position_embeddings
        self.input_processor = InputProcessor(self.config, self.tokenizer, self.vocab_size, self.max_model_len,
                                              self.kv.num_blocks * self.config.block_size, self.scheduler.policy)
        self.requests: dict[str, RequestState] = {}
        self._with_deadline: set[str] = set()  # requests with a deadline (may hold ended ones: _expire_requests)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()
        self.total_generated_tokens = 0
        self.spec = make_spec_decoder(self.config, self.logits_processors, self)
        # Made on the first constrained request, in a compile thread. A partial, not a bound method:
        # the manager must not hold the engine.
        self.structured_output = StructuredOutputManager(functools.partial(
            make_backend, hook, self.config.structured_outputs_backend, self.tokenizer, self.vocab_size,
            sorted(self.eos_token_ids)), self.vocab_size)
        self.sample_step = SampleStep(self.logits_processors, self.structured_output, self.eos_token_ids,
                                      self.output_processor.make_logprobs, self.spec, self._seq_counter)
        self.max_concurrent_requests = self.config.max_concurrent_requests or max(self.config.max_num_seqs,
                                                                                  self.kv.num_blocks)
        self.rejected = RequestCounts(REJECT_REASONS)  # by reason: pagedcore:requests_rejected_total
        self.aborted = RequestCounts(ABORT_REASONS)  # by reason: pagedcore:requests_aborted_total
        self.num_step_failures = 0
        self.consecutive_step_failures = 0
        self._healthy = True  # False after max_consecutive_step_failures failed steps in a row
        # Asked between a multi-step decode's forwards: True ends the step there (the async engine's: a command
        # is queued, so an arrival or an abort waits one forward, not num_scheduler_steps).
        self.stop_multi_step: Callable[[], bool] | None = None
        self.loras = LoRARegistry(self.runner.lora_manager)
        self.loras.load_modules(self.config.lora_modules)
        logger.info("pagedcore engine ready: %s, %s, %s backend; KV cache %d blocks = %d tokens",
                    self.device, self.dtype, backend.name, self.kv.num_blocks, self.kv.num_blocks * self.config.block_size)

    @property
    def healthy(self) -> bool:
        """False after max_consecutive_step_failures failed steps in a row, or once a tensor-parallel
        worker died or hung (the executor cannot go on)."""
        return self._healthy and (self.executor is None or self.executor.healthy)

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self._healthy = value

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done when the engine is dropped
        and at interpreter exit)."""
        if self.executor is not None:
            self.executor.shutdown()

    def add_request(self, request_id: str | None, prompt: str | list[int] | ProcessedPrompt,
                    params: SamplingParams | dict | None = None, *, output_kind: OutputKind = OutputKind.CUMULATIVE,
                    priority: int = 0, cache_salt: str | None = None, timeout: float | None = None,
                    lora_request=None) -> str:
        """Queue a request. `priority` orders admission under the "priority" scheduling policy (lower
        first, vLLM's convention); `cache_salt` keeps its prompt's cached blocks apart from those of
        requests with another salt (prefix reuse only within one tenant); `timeout`: seconds from now to
        the request's deadline (request_timeout, if shorter, wins); `lora_request` (a LoRARequest, or
        the LoRAModel `resolve_lora` returned): the adapter it runs under (None: the base model)."""
        p = prompt if isinstance(prompt, ProcessedPrompt) else self.process_prompt(prompt, params)
        request_id = str(next(self._request_counter)) if request_id is None else request_id
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self.check_request_options(priority, cache_salt)
        lora = self.resolve_lora(lora_request)
        self.check_capacity(len(self.requests))
        params = p.params
        # The adapter changes every layer's K/V: its identity goes into the block hashes, like a salt.
        salt = cache_salt if lora is None else (cache_salt, lora.cache_key)
        if (params.best_of or params.n) > params.n or params.use_beam_search:
            output_kind = OutputKind.FINAL_ONLY  # the best n are known only at the end
        state = RequestState(request_id, p.prompt, p.prompt_token_ids, params, output_kind)
        timeouts = [t for t in (timeout, self.config.request_timeout) if t is not None]
        state.deadline = state.metrics.arrival_time + min(timeouts) if timeouts else None
        if state.deadline is not None:
            self._with_deadline.add(request_id)
        num_seqs = 1 if params.use_beam_search else params.best_of or params.n
        max_total_tokens = self.input_processor.max_total_tokens()
        for i in range(num_seqs):
            seq = Sequence(next(self._seq_counter), request_id, i, p.prompt_token_ids, params, max_total_tokens,
                           arrival_time=state.metrics.arrival_time, priority=priority,
                           generator=seq_generator(params, i, self.device), cache_salt=salt, lora=lora)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, p.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            state.seqs.append(seq)
        # Only the first sample prefills; the others fork its blocks when its prompt is done.
        self.scheduler.add(state.seqs[0])
        state.pending_forks = state.seqs[1:]
        if params.use_beam_search:
            state.beam = BeamGroup.for_request(params, state.seqs[0], self.eos_token_ids)
        self.requests[request_id] = state
        if params.structured_outputs is not None:
            self.structured_output.add_request(request_id, self.compile_grammar(params))
            for seq in state.seqs:
                seq.waiting_for_grammar = True
        self._event("added", request_id, None, {"num_prompt_tokens": len(p.prompt_token_ids)})
        return request_id

    def abort_request(self, request_ids: str | list[str], reason: str = "client") -> None:
        """End requests now and free their blocks; `reason` (limits.ABORT_REASONS) is counted."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            if self.spec is not None:
                self.spec.release_finished()
            self.aborted.add(reason)
            self._event("aborted", rid, None, {"reason": reason})

    def _end_with_error(self, rid: str, error: Exception, reason: str) -> RequestOutput:
        """Abort a request and say why: its last output, finished, with `error` set."""
        state = self.requests.get(rid)
        self.abort_request(rid, reason)
        if state is None:  # already gone (e.g. a step failed after finishing it): still tell its caller
            return RequestOutput(rid, None, [], [], True, error=error)
        return RequestOutput(rid, state.prompt, state.prompt_token_ids, [], True, state.metrics, error=error)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. Requests past their deadline or max_waiting_time end first; if the step itself
        raises, only its requests fail (outputs with `error` set) and the engine goes on."""
        t0 = time.perf_counter()
        outputs = self._expire_requests() + self._attach_grammars()
        sched = None
        try:
            if self.spec is not None:
                self.spec.propose(self.scheduler.running, self._can_speculate)
            sched = self.scheduler.schedule()
            if sched.is_empty:
                self.structured_output.wait_for_compiles()
                return outputs
            argmax_only = self.sample_step.argmax_only([seq for seq, _ in sched.scheduled])
            rows, logits = self.runner.execute(sched, argmax_only, self._num_decode_steps(sched, argmax_only),
                                               self.stop_multi_step)
            sampled = self.sample_step([sched.scheduled[i][0] for i in rows], logits, self.requests, self.sampler)
            self.scheduler.update_from_output(sched, sampled)
            if self.spec is not None:
                self.spec.release_finished()
            outputs += self._collect_outputs(sampled)
        except Exception as e:  # a kernel error, out of memory, a plugin that raised
            return outputs + self._fail_step(sched, e)
        self.consecutive_step_failures = 0
        generated = sum(max(len(s.token_ids), 1) for s in sampled.samples)  # beams append their own one
        self.total_generated_tokens += generated
        computed = sched.num_tokens + sum(s.num_fed_back for s in sampled.samples)  # a multi-step's forwards too
        self.pm.hook.pagedcore_step_end(stats=self.stats(computed, generated, time.perf_counter() - t0))
        return outputs

    def _num_decode_steps(self, sched, argmax_only: bool) -> int:
        """Forwards this step may run (config.num_scheduler_steps): more than one only for a batch of decoding,
        argmax-only rows through the decode stack while nothing waits for admission (an arrival is not held back
        by the lookahead), no further than any row's max_tokens and context reach, and with the free blocks for
        every row's lookahead slots."""
        k = self.config.num_scheduler_steps
        s = self.scheduler
        if k <= 1 or not argmax_only or self.runner.decode_stack is None or s.waiting or s.swapped:
            return 1
        for seq, n in sched.scheduled:
            if n != 1 or seq.num_computed_tokens != seq.num_tokens - 1 or not seq.num_output_tokens:
                return 1
            left = seq.max_total_tokens - seq.num_tokens
            if seq.params.max_tokens is not None:
                left = min(left, seq.params.max_tokens - seq.num_output_tokens)
            if left < k:
                k = left
                if k <= 1:
                    return 1
        return s.reserve_lookahead(sched, k)

    def _can_speculate(self, seq: Sequence) -> bool:
        # Beam search scores every beam's next-token distribution: it disables speculation for its request.
        # Constrained sequences too: drafts would need the grammar's mask per draft position.
        state = self.requests.get(seq.request_id)
        return state is not None and state.beam is None and seq.grammar is None and not seq.waiting_for_grammar

    def _expire_requests(self) -> list[RequestOutput]:
        max_wait = self.config.max_waiting_time
        if max_wait is None and not self._with_deadline:  # nothing can expire: no loop over every request a step
            return []
        self._with_deadline &= self.requests.keys()  # forget requests that ended
        now = time.monotonic()
        outputs = []
        for rid in [r for r in self.requests if max_wait is not None or r in self._with_deadline]:
            state = self.requests[rid]
            m = state.metrics
            if state.deadline is not None and now >= state.deadline:
                outputs.append(self._end_with_error(rid, RequestTimeoutError(
                    f"request timeout: {now - m.arrival_time:.1f} s since it arrived"), "timeout"))
            elif max_wait is not None and m.first_scheduled_time is None and now - m.arrival_time > max_wait:
                e = OverloadedError(f"the server is overloaded: the request waited {now - m.arrival_time:.1f} s "
                                    f"without being scheduled, max_waiting_time is {max_wait} s; retry later",
                                    "max_waiting_time")
                outputs.append(self._refuse(rid, e))
        return outputs

    def _refuse(self, rid: str, error: Exception) -> RequestOutput:
        """End a request that never ran (refused, not aborted): its only output, finished, with `error`;
        a refusal for a bad input or overload is counted."""
        state = self.requests.pop(rid)
        for seq in state.seqs:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if isinstance(error, (InvalidRequestError, OverloadedError)):
            self.reject(error)
        return RequestOutput(rid, state.prompt, state.prompt_token_ids, [], True, state.metrics, error=error)

    def _fail_step(self, sched, e: Exception) -> list[RequestOutput]:
        """Fail the requests of a step that raised: those it scheduled or swapped (all of them if
        scheduling itself raised), log once, reset what the step may have left half done."""
        self.num_step_failures += 1
        self.consecutive_step_failures += 1
        if self.consecutive_step_failures >= self.config.max_consecutive_step_failures:
            self.healthy = False
        if sched is None:
            rids = list(self.requests)
        else:
            seqs = [seq for seq, _ in sched.scheduled] + [s for s in sched.preempted if sched.blocks_to_swap_out]
            rids = list(dict.fromkeys(seq.request_id for seq in seqs))
        logger.error("engine step failed (%d in a row%s): %s: %s; failing its %d request(s)",
                     self.consecutive_step_failures, "; engine marked unhealthy" if not self.healthy else "",
                     type(e).__name__, e, len(rids), exc_info=e)
        self.runner.reset_input_batch()  # its rows may be half updated
        self.kv.take_pending_copies()
        error = RequestFailedError(f"generation failed: {type(e).__name__}: {e}")
        return [self._end_with_error(rid, error, "error") for rid in rids]

    # ---- structured output (pagedcore/structured_output/) ------------------------------------------
    def compile_grammar(self, params: SamplingParams):
        """Start compiling (or find cached) the grammar of `params.structured_outputs`: a
        concurrent.futures.Future whose exception is an InvalidRequestError naming the problem; None for
        an unconstrained request. A door awaits it to refuse a bad schema before queueing the request."""
        if params.structured_outputs is None:
            return None
        return self.structured_output.compile(params.structured_outputs)

    def _attach_grammars(self) -> list[RequestOutput]:
        """Give each request whose grammar is compiled one matcher per sequence and let it be
        scheduled; a grammar that failed refuses its request (counted like any bad input)."""
        outputs = []
        for rid, future in self.structured_output.pop_done():
            state = self.requests.get(rid)
            if state is None:  # aborted meanwhile
                continue
            error = future.exception()
            if error is not None:
                outputs.append(self._refuse(rid, error))
                continue
            for seq in state.seqs:
                seq.grammar = self.structured_output.matcher(future.result())
                seq.waiting_for_grammar = False
        return outputs

    def _collect_outputs(self, sampled: SampledOutput) -> list[RequestOutput]:
        outputs = []
        for rid in dict.fromkeys(s.seq.request_id for s in sampled.samples):
            state = self.requests[rid]
            finished = state.finished
            out = self.output_processor.make_output(state, finished)
            if out is not None:
                outputs.append(out)
            if finished:
                del self.requests[rid]
        return outputs

    # ---- helpers --------------------------------------------------------------------------
    def stats(self, scheduled_tokens: int = 0, generated: int = 0, step_time: float = 0.0) -> EngineStats:
        return EngineStats.from_engine(self, scheduled_tokens, generated, step_time)

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
