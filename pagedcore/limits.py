"""What the engine refuses or ends, and why: the errors every door translates, and their counts.

A request is refused before it runs (`LimitExceededError`, an `InvalidRequestError`: HTTP 400 /
Triton INVALID_ARG; `OverloadedError`: 429 or 503 with Retry-After / UNAVAILABLE), or ended after it
started (`RequestTimeoutError`: its deadline passed; `RequestFailedError`: a step it was part of
failed). `RequestCounts` counts both by reason for the metrics (`pagedcore:requests_rejected_total`,
`pagedcore:requests_aborted_total`). Stays light: no torch.
"""

from __future__ import annotations

import json
import re
import threading
from itertools import accumulate

from pagedcore.sampling_params import InvalidRequestError

# Why a request was refused: the setting it hit, "invalid" (any other bad input) or "unavailable"
# (the engine is shutting down or unhealthy).
REJECT_REASONS = ("max_concurrent_requests", "max_waiting_time", "max_input_tokens", "max_total_tokens",
                  "max_best_of", "max_stop_sequences", "payload_limit", "max_json_depth", "invalid", "unavailable")
# Why a started request was ended early: the caller aborted (disconnect, cancel, leaving a stream),
# its deadline passed, a step failed, or the engine shut down.
ABORT_REASONS = ("client", "timeout", "error", "shutdown")


class LimitExceededError(InvalidRequestError):
    """A request over one of the engine's limits; `setting` names the EngineConfig field."""

    def __init__(self, message: str, field: str | None, setting: str):
        super().__init__(message, field)
        self.setting = setting


class OverloadedError(RuntimeError):
    """Refused for now: try again after `retry_after` seconds (429, or 503 when the engine is going
    away: `reason` "unavailable")."""

    def __init__(self, message: str, reason: str, retry_after: float = 1.0):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class EngineDeadError(OverloadedError):
    """The engine is shut down, shutting down, or unhealthy: 503 / UNAVAILABLE."""

    def __init__(self, message: str = "the engine is shut down", retry_after: float = 5.0):
        super().__init__(message, "unavailable", retry_after)


class RequestTimeoutError(RuntimeError):
    """The request's deadline passed; it was aborted and its blocks freed."""


class RequestFailedError(RuntimeError):
    """A step this request was part of failed (kernel error, out of memory, a plugin that raised)."""


def reject_reason(e: BaseException) -> str:
    if isinstance(e, LimitExceededError):
        return e.setting
    if isinstance(e, OverloadedError):
        return e.reason
    return "invalid"


class RequestCounts:
    """Counts by reason, written from any thread (callers validate in their own)."""

    def __init__(self, reasons: tuple[str, ...]):
        self.reasons = reasons
        self._counts = dict.fromkeys(reasons, 0)
        self._lock = threading.Lock()

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._counts[r] for r in self.reasons)


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON text (strings skipped), at C speed: checked
    before json.loads, which would recurse through a hostile body first."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def load_json(raw: str | bytes, field: str | None, payload_limit: int, max_json_depth: int) -> object:
    """Parse a request's JSON within the payload and nesting limits; InvalidRequestError otherwise."""
    if len(raw) > payload_limit:
        raise LimitExceededError(f"{field or 'the request body'} has {len(raw)} bytes, over payload_limit "
                                 f"({payload_limit})", field, "payload_limit")
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        depth = json_depth(text)
        if depth > max_json_depth:
            raise LimitExceededError(f"{field or 'the request body'} nests {depth} levels deep, over max_json_depth "
                                     f"({max_json_depth})", field, "max_json_depth")
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        if isinstance(e, InvalidRequestError):
            raise
        message = f"{field}: not valid JSON ({e})" if field else f"the request body is not valid JSON: {e}"
        raise InvalidRequestError(message, field) from e
