"""LLMEngine's request intake (vLLM's front-door checks): validate and tokenize a prompt, read a request's JSON
within its limits, admission control, and the count of every refusal by reason. The checks themselves live in
pagedcore/input_processor.py; these methods count what they refuse and tell the plugins."""

from __future__ import annotations

from pagedcore.input_processor import ProcessedPrompt
from pagedcore.limits import EngineDeadError, OverloadedError, reject_reason
from pagedcore.sampling_params import InvalidRequestError, SamplingParams


class IntakeAPI:
    """Mixed into LLMEngine, which sets `input_processor`, `rejected` (RequestCounts), `max_concurrent_requests`,
    `executor`, `consecutive_step_failures`, `_healthy`, `healthy` and `_event`."""

    def process_prompt(self, prompt: str | list[int], params: SamplingParams | dict | None) -> ProcessedPrompt:
        """Validate and tokenize; pure (touches no engine state), so callers may run it anywhere."""
        return self._counted(self.input_processor.process_prompt, prompt, params)

    def load_json(self, raw: str | bytes, field: str | None = None) -> object:
        """A request's JSON (an HTTP body, Triton's sampling_parameters) within payload_limit and
        max_json_depth; refusals are counted like the engine's own."""
        return self._counted(self.input_processor.load_json, raw, field)

    def check_payload(self, num_bytes: int, field: str | None = None) -> None:
        """Refuse (counted) a request of more than payload_limit bytes, e.g. by its Content-Length."""
        self._counted(self.input_processor.check_payload, num_bytes, field)

    def check_request_options(self, priority, cache_salt) -> None:
        """The per-request options beside the sampling parameters (vLLM's `priority`, `cache_salt`)."""
        self.input_processor.check_request_options(priority, cache_salt)

    def max_token_capacity(self) -> int:
        return self.input_processor.max_token_capacity()

    def _counted(self, check, *args):
        """Run an intake check; a refusal is counted (`reject`) and raised as is."""
        try:
            return check(*args)
        except InvalidRequestError as e:
            self.reject(e)
            raise

    def reject(self, e: InvalidRequestError | OverloadedError) -> None:
        """Count a refused request by reason and tell the plugins (from any thread)."""
        reason = reject_reason(e)
        self.rejected.add(reason)
        self._event("rejected", None, None, {"field": getattr(e, "field", None), "error": str(e), "reason": reason})

    def check_capacity(self, num_unfinished: int) -> None:
        """Admission control: OverloadedError (counted) when `num_unfinished` requests already fill
        max_concurrent_requests, or the engine is unhealthy. Pure: callers may run it anywhere."""
        if not self.healthy:
            why = (f"after {self.consecutive_step_failures} failed steps in a row" if not self._healthy else
                   f"({self.executor.failure or 'its tensor-parallel executor is shut down'})")
            e = EngineDeadError(f"the engine is unhealthy {why}")
        elif num_unfinished >= self.max_concurrent_requests:
            e = OverloadedError(f"the server is overloaded: {num_unfinished} requests in flight, "
                                f"max_concurrent_requests is {self.max_concurrent_requests}; retry later",
                                "max_concurrent_requests")
        else:
            return
        self.reject(e)
        raise e
