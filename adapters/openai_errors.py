"""The OpenAI API's errors: `OpenAIError` (HTTP status + OpenAI error body) and the client's view of the
engine's refusals and failures."""

from __future__ import annotations

from pagedcore.limits import OverloadedError, RequestFailedError, RequestTimeoutError


class OpenAIError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_error(e: Exception) -> OpenAIError | None:
    """The client's view of an engine refusal or failure (None: not one of the engine's)."""
    if isinstance(e, OverloadedError):
        unavailable = e.reason == "unavailable"
        return OpenAIError(str(e), status=503 if unavailable else 429, code=e.reason,
                           type="service_unavailable" if unavailable else "overloaded_error",
                           headers={"Retry-After": str(max(1, round(e.retry_after)))})
    if isinstance(e, RequestTimeoutError):
        return OpenAIError(str(e), "timeout", status=408, type="timeout_error", code="request_timeout")
    if isinstance(e, RequestFailedError):
        return OpenAIError(str(e), status=500, type="server_error", code="generation_failed")
    return None


def raise_engine_error(e: BaseException) -> None:
    mapped = engine_error(e) if isinstance(e, Exception) else None
    if mapped is not None:
        raise mapped from e


def model_not_found(name: str, available: list[str]) -> OpenAIError:
    return OpenAIError(f"The model `{name}` does not exist. Available: {', '.join(available)}", "model",
                       status=404, code="model_not_found")
