"""Clients of `pagedcore bench soak`: one request each, ending in exactly one `Outcome`.

BentoML through the official `openai` client (completions, streaming or not), Triton through
`tritonclient.grpc.aio` (the decoupled stream; `stream` false asks for one final response). A client
that "cancels" stops reading and closes its stream or connection, as a vanished user would.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

import numpy as np

from pagedcore.bench.serve_clients import TRITON_MODEL, FrontendError


@dataclass
class SoakRequest:
    index: int
    prompt: str
    max_tokens: int
    stream: bool
    too_long: bool = False  # over the server's input limit: must be refused as invalid
    cancel_after: float | None = None  # seconds; the client gives up then
    burst: bool = False
    ignore_eos: bool = False  # burst copies run their whole max_tokens: they must overlap to overload


@dataclass
class Outcome:
    index: int
    kind: str = "failed"  # completed | rejected | cancelled | failed
    reason: str = ""  # rejected: overload | invalid | http_<code>; failed: what went wrong
    output_tokens: int = 0


async def run_bounded(send, req: SoakRequest, out: Outcome, timeout: float, classify) -> Outcome:
    """Run `send(req, out)` until it ends, the client's cancel moment, or the timeout; then say which."""
    cancel = req.cancel_after is not None and req.cancel_after < timeout
    try:
        await asyncio.wait_for(send(req, out), req.cancel_after if cancel else timeout)
    except asyncio.TimeoutError:
        out.kind, out.reason = ("cancelled", "") if cancel else ("failed", f"no answer in {timeout:.0f} s (a hang)")
        return out
    except Exception as e:  # noqa: BLE001 - every error is classified, none ends the run
        out.kind, out.reason = classify(e)
    else:
        out.kind, out.reason = "completed", ""
    if out.kind == "completed" and req.too_long:
        out.kind, out.reason = "failed", "a prompt over the input limit was accepted"
    elif out.kind == "rejected" and out.reason == "invalid" and not req.too_long:
        out.kind, out.reason = "failed", "a valid request was refused as invalid"
    return out


# ---- BentoML: the OpenAI API --------------------------------------------------------------------------
def classify_openai(e: Exception) -> tuple[str, str]:
    import openai

    if isinstance(e, openai.APIStatusError):
        code = e.status_code
        message = str(e)[:200]
        if code in (429, 503):
            if code == 429 and not e.response.headers.get("retry-after"):
                return "failed", f"429 without Retry-After: {message}"
            return "rejected", "overload"
        if code == 400:
            return "rejected", "invalid"
        return ("rejected", f"http_{code}") if code < 500 else ("failed", f"HTTP {code}: {message}")
    return "failed", f"{type(e).__name__}: {str(e)[:200]}"


class OpenAISoakClient:
    def __init__(self, url: str):
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=None)
        self.model = ""

    async def open(self) -> None:
        try:
            self.model = (await self.client.models.list()).data[0].id
        except Exception as e:
            raise FrontendError(f"bentoml: {type(e).__name__}: {e}") from e

    async def run(self, req: SoakRequest, timeout: float) -> Outcome:
        return await run_bounded(self._send, req, Outcome(req.index), timeout, classify_openai)

    async def _send(self, req: SoakRequest, out: Outcome) -> None:
        kw = dict(model=self.model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=0.0)
        if req.ignore_eos:
            kw["extra_body"] = {"ignore_eos": True}
        if not req.stream:
            r = await self.client.completions.create(**kw)
            out.output_tokens = r.usage.completion_tokens
            return
        stream = await self.client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        try:
            async for chunk in stream:
                if chunk.usage:
                    out.output_tokens = chunk.usage.completion_tokens
        finally:
            await stream.close()  # on a cancel too: the server sees the disconnect

    async def close(self) -> None:
        await self.client.close()


# ---- Triton: the decoupled gRPC stream ----------------------------------------------------------------
def classify_triton(e: Exception) -> tuple[str, str]:
    """By the error's status where the client has it; a decoupled stream's error carries only its
    message, in which the backend names the limit (`over max_input_tokens`) or says `overloaded`."""
    status, message = str(getattr(e, "status", lambda: "")() or ""), str(e)
    if "UNAVAILABLE" in status or "overloaded" in message:
        return "rejected", "overload"
    if "INVALID_ARG" in status or re.search(r"over max_\w+ \(", message):
        return "rejected", "invalid"
    return "failed", f"{type(e).__name__}: {message[:200]}"


class TritonSoakClient:
    def __init__(self, url: str):
        from tritonclient.grpc import aio

        self.url = url
        self.client = aio.InferenceServerClient(url)

    async def open(self) -> None:
        if not await self.client.is_model_ready(TRITON_MODEL):
            raise FrontendError(f"triton at {self.url}: model {TRITON_MODEL!r} is not ready")

    async def run(self, req: SoakRequest, timeout: float) -> Outcome:
        return await run_bounded(self._send, req, Outcome(req.index), timeout, classify_triton)

    async def _send(self, req: SoakRequest, out: Outcome) -> None:
        async def one_request():
            yield {"model_name": TRITON_MODEL, "inputs": _inputs(req)}

        responses = self.client.stream_infer(one_request())
        try:
            async for result, error in responses:
                if error is not None:
                    raise error
                n = result.as_numpy("num_output_tokens")
                out.output_tokens += int(n.sum()) if n is not None else 0
        finally:
            responses.cancel()  # a no-op once the stream has ended; aborts the request otherwise

    async def close(self) -> None:
        await self.client.close()


def _inputs(req: SoakRequest) -> list:
    from tritonclient.grpc import InferInput

    def tensor(name: str, value, dtype: str):
        t = InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else bool))
        return t

    params = json.dumps({"temperature": 0.0, "max_tokens": req.max_tokens, "ignore_eos": req.ignore_eos}).encode()
    return [tensor("text_input", req.prompt.encode(), "BYTES"), tensor("stream", req.stream, "BOOL"),
            tensor("sampling_parameters", params, "BYTES"), tensor("return_num_output_tokens", True, "BOOL")]


SOAK_CLIENTS = {"bentoml": OpenAISoakClient, "triton": TritonSoakClient}
