"""BentoML front door: one AsyncLLMEngine behind an OpenAI-compatible API and a native stream.

Serve (bundled SmolLM2 unless PAGEDCORE_MODEL says otherwise):

    pagedcore serve-bentoml --host 127.0.0.1 --port 3000
    # = bentoml serve pagedcore.adapters.bentoml_service:PagedCore --host 127.0.0.1 --port 3000

Engine settings come from the environment: `PAGEDCORE_<FIELD>` for every EngineConfig field
(PAGEDCORE_MODEL, PAGEDCORE_DTYPE, PAGEDCORE_NUM_KV_BLOCKS, PAGEDCORE_MAX_NUM_SEQS,
PAGEDCORE_MAX_MODEL_LEN, PAGEDCORE_NUM_THREADS, ...); PAGEDCORE_SERVED_MODEL_NAME names the model
in the API (default: "SmolLM2-135M-Instruct" for the bundled one, else the model path's name).
LoRA: PAGEDCORE_ENABLE_LORA=true, PAGEDCORE_LORA_MODULES='{"name": "/peft/dir"}'; requests pick an
adapter by `model`; PAGEDCORE_ALLOW_RUNTIME_LORA_UPDATING=true opens the load/unload routes.

Routes:
  /v1/models, /v1/completions, /v1/chat/completions   OpenAI API (see adapters/openai_api.py)
  /v1/load_lora_adapter, /v1/unload_lora_adapter       LoRA adapters at run time (vLLM's routes; opt-in)
  /generate                                            native stream of text deltas (POST JSON)
  /healthz /livez /readyz /metrics                     BentoML's own; /metrics adds the engine's pagedcore:*
                                                       metrics (pagedcore/metrics.py; README "Metrics");
                                                       /readyz is 503 once the engine is unhealthy or stopping

Limits live in the engine (README "Limits and failure behaviour"); this door only translates them:
400 too long / too many, 429 + Retry-After overload, 503 + Retry-After stopping or unhealthy, 408
past a request's `timeout`. On shutdown the engine stops admitting and gives the requests in flight
shutdown_grace_period seconds.

One worker: the engine batches every request itself, so a second worker would only halve its memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import typing
from contextlib import aclosing
from pathlib import Path
from typing import AsyncGenerator

import bentoml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedcore.adapters.openai_api import OpenAIError, OpenAIServing, engine_error
from pagedcore.adapters.openai_schema import openapi_document
from pagedcore.metrics import METRICS, MetricsPublisher, Update
from pagedcore.limits import OverloadedError
from pagedcore.sampling_params import InvalidRequestError, SamplingParams
from pagedcore.settings import ENV_PREFIX, settings_from_env

logger = logging.getLogger("pagedcore")

METRICS_INTERVAL_S = 0.5


# ---- settings ------------------------------------------------------------------------------------

def engine_settings_from_env(environ: typing.Mapping[str, str] = os.environ) -> dict:
    """EngineConfig keyword arguments from PAGEDCORE_<FIELD> variables (pagedcore/settings.py)."""
    return settings_from_env(environ)


def allow_runtime_lora_updating(environ: typing.Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV_PREFIX + "ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true", "yes", "on")


def served_model_name(model: str | None, environ: typing.Mapping[str, str] = os.environ) -> str:
    from pagedcore.model_loader import BUNDLED_NAMES

    if environ.get(ENV_PREFIX + "SERVED_MODEL_NAME"):
        return environ[ENV_PREFIX + "SERVED_MODEL_NAME"]
    if model in BUNDLED_NAMES:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


# ---- metrics ---------------------------------------------------------------------------------------

class PrometheusMetrics:
    """The engine's metrics (`pagedcore.metrics.METRICS`, labelled `model_name`) in BentoML's /metrics.

    BentoML serves /metrics from prometheus_client's multiprocess files, so the metrics are pushed:
    `MetricsPublisher` sets the gauges, advances the counters and replays the histograms' new
    observations every METRICS_INTERVAL_S. prometheus_client is imported here, not at module import:
    BentoML sets its multiprocess directory in the worker after importing the service module (what
    `bentoml.metrics`, now deprecated, did for the same reason).
    """

    def __init__(self, engine, model_name: str):
        from prometheus_client import Counter, Gauge, Histogram

        make = {
            # liveall: with workers=N, each live worker (an engine replica) exports its own series (`pid` label)
            "gauge": lambda s: Gauge(s.name, s.help, ["model_name"], multiprocess_mode="liveall"),
            "counter": lambda s: Counter(s.name, s.help, ["model_name", *filter(None, [s.label])]),
            "histogram": lambda s: Histogram(s.name, s.help, ["model_name"], buckets=s.buckets),
        }
        self.metrics = {}  # (name, label value or None) -> the series
        for spec in METRICS:
            metric = make[spec.kind](spec)
            for value in spec.label_values or [None]:
                labels = {"model_name": model_name, **({spec.label: value} if spec.label else {})}
                self.metrics[spec.name, value] = metric.labels(**labels)
        self.publisher = MetricsPublisher(engine, self.push, METRICS_INTERVAL_S,
                                          on_error=lambda e: logger.exception("updating engine metrics failed"))

    def push(self, update: Update) -> None:
        update.apply(self.metrics[update.spec.name, update.label_value])

    def stop(self) -> None:
        self.publisher.stop()


# ---- the HTTP app ------------------------------------------------------------------------------------

app = FastAPI(title="pagedcore OpenAI-compatible API")
app.openapi = openapi_document  # /v1/openapi.json: the bodies are parsed by hand, so written out by hand


def _error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
    return _error(e)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return _error(OpenAIError(str(e.detail), status=e.status_code,
                              code="not_found" if e.status_code == 404 else None))


@app.exception_handler(Exception)
async def _server_error(request: Request, e: Exception) -> JSONResponse:
    mapped = engine_error(e)
    if mapped is not None:
        return _error(mapped)
    logger.exception("request failed")
    return _error(OpenAIError(f"internal error: {e}", type="server_error", status=500))


async def _json_body(request: Request, engine) -> object:
    """The body as JSON, within the engine's payload_limit and max_json_depth (a too-large body is
    refused by its Content-Length, before it is read)."""
    try:
        engine.check_payload(int(request.headers.get("content-length") or 0))
        return engine.load_json(await request.body())
    except InvalidRequestError as e:
        raise OpenAIError(str(e)) from e


async def _unless_disconnected(request: Request, coro) -> object:
    """Run `coro`; cancel it (aborting its engine request) the moment the client goes away: the
    ASGI disconnect message is awaited, not polled, so the abort lands before the next step."""
    task = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        raise OpenAIError("client disconnected", status=499)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()


async def _disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
    """Streams SSE and always closes the generator, which aborts unfinished engine requests."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _respond(result) -> JSONResponse | StreamingResponse:
    if isinstance(result, dict):
        return JSONResponse(result)
    return _SSEResponse(result, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- the service ----------------------------------------------------------------------------------

@bentoml.asgi_app(app, path="/v1")
@bentoml.service(name="pagedcore", workers=1, traffic={"timeout": 3600})
class PagedCore:
    def __init__(self) -> None:
        from pagedcore.async_engine import AsyncLLMEngine

        settings = engine_settings_from_env()
        self.engine = AsyncLLMEngine.from_settings(**settings)
        model = settings.get("model")
        self.openai = OpenAIServing(self.engine, served_model_name(model),
                                    aliases=tuple(a for a in (model,) if a),
                                    allow_lora_updates=allow_runtime_lora_updating())
        # Read live from the LLMEngine: AsyncLLMEngine.stats() is the last *step's* snapshot, which
        # misses blocks freed by an abort when no step follows.
        self.metrics = PrometheusMetrics(self.engine.engine, self.openai.model_name)

    @bentoml.on_shutdown
    async def shutdown(self) -> None:
        # Stop admitting, let the requests in flight finish (or abort them after the grace period).
        await asyncio.to_thread(self.engine.shutdown, self.engine.config.shutdown_grace_period)
        self.metrics.stop()

    def __is_ready__(self) -> bool:
        """/readyz: false once repeated step failures mark the engine unhealthy, or it is stopping."""
        return self.engine.healthy

    # ---- OpenAI routes (FastAPI; `self` is injected by BentoML) ------------------------------------
    @app.get("/models")
    async def models(self) -> JSONResponse:
        return JSONResponse(self.openai.models())

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.openai.load_lora_adapter(await _json_body(request, self.engine.engine)))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.openai.unload_lora_adapter(await _json_body(request, self.engine.engine)))

    @app.post("/completions")
    async def completions(self, request: Request):
        body = await _json_body(request, self.engine.engine)
        return _respond(await _unless_disconnected(request, self.openai.completions(body)))

    @app.post("/chat/completions")
    async def chat_completions(self, request: Request):
        body = await _json_body(request, self.engine.engine)
        return _respond(await _unless_disconnected(request, self.openai.chat_completions(body)))

    # ---- the native stream ---------------------------------------------------------------------------
    @bentoml.api
    async def generate(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, seed: typing.Optional[int] = None, stop: typing.Optional[list[str]] = None,
                       chat: bool = True) -> AsyncGenerator[str, None]:
        """Stream the text of one completion as it is generated. `chat`: wrap `prompt` as a user
        message in the model's chat template (default), else send it raw. BentoML reads the first
        chunk before it answers, so invalid input is a 400, not a broken stream."""
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=seed, stop=stop or [])
            if chat:
                prompt = list(self.engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                    return_dict=False))
            async with aclosing(self.engine.generate(prompt, params)) as deltas:
                async for out in deltas:
                    if out.outputs[0].text:
                        yield out.outputs[0].text
        except InvalidRequestError as e:
            raise bentoml.exceptions.InvalidArgument(str(e)) from e
        except OverloadedError as e:  # BentoML has no 429 of its own: 503, as TGI answers overload
            raise bentoml.exceptions.ServiceUnavailable(str(e)) from e
