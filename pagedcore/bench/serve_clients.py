"""Streaming clients of `pagedcore bench serve`: one request, one stream, every chunk timed on arrival.

BentoML is driven through the official `openai` client (`/v1/completions`, stream=True), Triton
through `tritonclient.grpc.aio` (the decoupled gRPC stream). Both doors get the same text prompts
and ask for exact output lengths (`max_tokens` with `ignore_eos`); output tokens are counted as the
door reports them (OpenAI `usage`, Triton `num_output_tokens`), never re-tokenized here.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

TRITON_MODEL = "pagedcore"


class FrontendError(RuntimeError):
    """A front door that cannot be started, reached or warmed up: the run stops with this message."""


@dataclass
class Request:
    prompt: str
    output_len: int  # exact: EOS is ignored


@dataclass
class RequestRecord:
    output_len: int  # asked for
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks carrying output
    input_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def sampling_parameters(output_len: int) -> dict:
    return {"temperature": 0.0, "max_tokens": output_len, "ignore_eos": True}


class OpenAIClient:
    """BentoML's OpenAI-compatible route."""

    def __init__(self, url: str, timeout: float):
        from openai import AsyncOpenAI

        self.url = url
        self.client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
        self.model = ""

    async def open(self) -> None:
        self.model = (await self.client.models.list()).data[0].id  # whatever name the server gives its model

    async def send(self, req: Request, rec: RequestRecord) -> None:
        # sampling_parameters() in OpenAI's terms: ignore_eos is an engine extra in the body.
        stream = await self.client.completions.create(
            model=self.model, prompt=req.prompt, max_tokens=req.output_len, temperature=0.0,
            extra_body={"ignore_eos": True}, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                rec.chunk_times.append(now)
            if chunk.usage:  # the last chunk: choices empty, usage of the whole request
                rec.input_tokens, rec.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens

    async def close(self) -> None:
        await self.client.close()


class TritonClient:
    """Triton's gRPC stream: one bidirectional stream per request, as many concurrently as arrive."""

    def __init__(self, url: str, timeout: float):
        from tritonclient.grpc import aio

        self.url, self.timeout = url, timeout
        self.client = aio.InferenceServerClient(url)

    async def open(self) -> None:
        if not await self.client.is_model_ready(TRITON_MODEL):
            raise FrontendError(f"Triton at {self.url}: model {TRITON_MODEL!r} is not ready")

    async def send(self, req: Request, rec: RequestRecord) -> None:
        async def one_request():
            yield {"model_name": TRITON_MODEL, "inputs": _triton_inputs(req)}

        responses = self.client.stream_infer(one_request(), stream_timeout=self.timeout)
        try:
            async for result, error in responses:
                now = time.perf_counter()
                if error is not None:
                    raise RuntimeError(str(error))
                n = int(result.as_numpy("num_output_tokens").sum())  # this response's tokens (a delta)
                if n:
                    rec.chunk_times.append(now)
                    rec.output_tokens += n
                rec.input_tokens = int(result.as_numpy("num_input_tokens")[0])
        finally:
            responses.cancel()  # a no-op once the stream has ended; aborts the request otherwise

    async def close(self) -> None:
        await self.client.close()


def _triton_inputs(req: Request) -> list:
    from tritonclient.grpc import InferInput

    def tensor(name: str, value, dtype: str):
        t = InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else bool))
        return t

    params = json.dumps(sampling_parameters(req.output_len)).encode()
    return [tensor("text_input", req.prompt.encode(), "BYTES"), tensor("stream", True, "BOOL"),
            tensor("sampling_parameters", params, "BYTES"), tensor("return_num_input_tokens", True, "BOOL"),
            tensor("return_num_output_tokens", True, "BOOL")]


CLIENTS = {"bentoml": OpenAIClient, "triton": TritonClient}


# ---- the load: Poisson arrivals ------------------------------------------------------------------------
def arrival_offsets(n: int, rate: float, rng) -> list[float]:
    """Seconds from the start at which each request is sent: exponential gaps (a Poisson process)
    of mean 1/rate; rate inf sends them all at once."""
    t, offsets = 0.0, []
    for _ in range(n):
        offsets.append(t)
        t += 0.0 if rate == float("inf") else rng.expovariate(rate)
    return offsets


async def timed(client, req: Request) -> RequestRecord:
    """One request; an error is recorded, never raised, so one failure does not end the run."""
    rec = RequestRecord(req.output_len, start=time.perf_counter())
    try:
        await client.send(req, rec)
        if not rec.chunk_times:
            rec.error = "the stream ended without output"
    except Exception as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.end = time.perf_counter()
    return rec


async def run_load(client, requests: list[Request], offsets: list[float]) -> tuple[list[RequestRecord], float]:
    """Send each request at its offset (scheduled from one clock, so gaps do not drift); the records
    and the seconds from the first send to the last answer."""
    t0 = time.perf_counter()

    async def at(offset: float, req: Request) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        return await timed(client, req)

    records = await asyncio.gather(*(at(o, r) for o, r in zip(offsets, requests)))
    return list(records), time.perf_counter() - t0


async def bench_frontend(frontend: str, url: str, requests: list[Request], offsets: list[float],
                         timeout: float) -> tuple[list[RequestRecord], float]:
    """Connect, warm up with one short request (not counted), then run the load."""
    client = CLIENTS[frontend](url, timeout)
    try:
        try:
            await client.open()
        except Exception as e:
            raise FrontendError(f"{frontend} at {url}: {type(e).__name__}: {e}") from e
        warm = await timed(client, Request(requests[0].prompt, 2))
        if warm.error:
            raise FrontendError(f"{frontend} at {url}: the warm-up request failed: {warm.error}")
        return await run_load(client, requests, offsets)
    finally:
        await client.close()
