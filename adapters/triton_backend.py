"""Triton Inference Server Python-backend model for pagedcore: translation only.

Shaped like Triton's vLLM backend. The model is decoupled: `execute` hands each request to a
coroutine on an asyncio loop in a daemon thread and returns at once; the coroutine streams the
engine's outputs to the request's response sender and ends with exactly one
TRITONSERVER_RESPONSE_COMPLETE_FINAL. The engine (AsyncLLMEngine) steps in its own thread and owns
batching, validation, KV blocks and aborts; this file turns tensors into a prompt and SamplingParams
and outputs back into tensors.

Inputs: text_input (string), stream, exclude_input_in_output, return_num_input_tokens,
return_num_output_tokens (bool), sampling_parameters (JSON of SamplingParams, plus vLLM's request
extras `priority` and `cache_salt`), lora_name (string: a LoRA adapter the engine holds, as in the
vLLM backend; adapters are named in model.json's `lora_modules` with `enable_lora: true`).
Outputs: text_output, finish_reason (final response), num_input_tokens, num_output_tokens.
Metrics: the engine's pagedcore:* gauges, counters and histograms (pagedcore/metrics.py, the same
names as the BentoML door) on Triton's /metrics through the Python backend's custom metrics API
(pb_utils.MetricFamily).

Limits live in the engine (README "Limits and failure behaviour"); errors map to INVALID_ARG (bad or
too large input), UNAVAILABLE (overload, a request past its Triton timeout, shutting down, unhealthy),
CANCELLED (a cancelled request; its engine request is aborted within a step), INTERNAL (a failed step).

Engine settings: model.json beside model.py (or beside config.pbtxt), overridden key by key by the
JSON object in $PAGEDCORE_TRITON_SETTINGS.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedcore.adapters.triton_launcher import SETTINGS_ENV
from pagedcore.async_engine import AsyncLLMEngine
from pagedcore.limits import OverloadedError, RequestTimeoutError
from pagedcore.metrics import METRICS, MetricsPublisher, Update
from pagedcore.outputs import OutputKind, RequestOutput
from pagedcore.sampling_params import InvalidRequestError

SETTINGS_FILE = "model.json"
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_INTERVAL_S = 0.25
CANCEL_POLL_S = 0.05  # how often a request with no output yet (queued) is checked for cancellation


def load_settings(model_dir: Path, version: str) -> dict:
    settings: dict = {}
    for path in (model_dir / SETTINGS_FILE, model_dir / version / SETTINGS_FILE):
        if path.is_file():
            settings.update(json.loads(path.read_text()))
    settings.update(json.loads(os.environ.get(SETTINGS_ENV) or "{}"))
    return settings


# ---- request translation --------------------------------------------------------------------------
@dataclass
class GenerateRequest:
    prompt: str
    sampling_params: dict
    stream: bool
    prepend_input: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool
    timeout: float | None = None  # seconds: the request's Triton timeout (`timeout` in the client call)
    priority: int = 0  # vLLM's request extras, read from sampling_parameters beside the sampling fields
    cache_salt: str | None = None
    lora_name: str | None = None  # None or "": the base model


def _scalar(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)  # None when an optional input is absent
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)
    if value.size != 1:
        raise InvalidRequestError(f"{name}: expected one element, got {value.size}", name)
    return value[0]


def _flag(request, name: str) -> bool | None:
    value = _scalar(request, name)
    return None if value is None else bool(value)


def _text(value, name: str = "text_input") -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"{name}: not valid UTF-8 ({e})", name) from e


def parse_request(request, load_json=json.loads) -> GenerateRequest:
    """`load_json(raw, field)`: the engine's bounded parser (payload_limit, max_json_depth)."""
    text = _scalar(request, "text_input")
    if text is None:
        raise InvalidRequestError("text_input: missing (a string input is required)", "text_input")
    raw_params = _scalar(request, "sampling_parameters")
    params = {}
    if raw_params is not None:
        try:
            params = load_json(raw_params if isinstance(raw_params, bytes) else _text(raw_params, "sampling_parameters"),
                               "sampling_parameters")
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise InvalidRequestError(f"sampling_parameters: not valid JSON ({e})", "sampling_parameters") from e
    extras = ({k: v for k in ("priority", "cache_salt") if (v := params.pop(k, None)) is not None}
              if isinstance(params, dict) else {})
    stream = bool(_flag(request, "stream"))
    exclude = _flag(request, "exclude_input_in_output")
    prepend = not stream if exclude is None else not exclude  # as in the vLLM backend
    if stream and prepend:
        raise InvalidRequestError("exclude_input_in_output: false is not supported with stream=true",
                                  "exclude_input_in_output")
    timeout_us = request.timeout()  # 0: none
    lora_name = _scalar(request, "lora_name")
    return GenerateRequest(_text(text), params, stream, prepend, bool(_flag(request, "return_num_input_tokens")),
                           bool(_flag(request, "return_num_output_tokens")), timeout_us / 1e6 if timeout_us else None,
                           **extras, lora_name=None if lora_name is None else _text(lora_name, "lora_name") or None)


def error_message(e: InvalidRequestError) -> str:
    """Name the Triton input at fault: the engine says `prompt` or a SamplingParams field."""
    msg = str(e)
    if e.field in ("text_input", "sampling_parameters", "exclude_input_in_output") and msg.startswith(e.field):
        return msg  # raised above, already named
    if e.field == "lora_request":
        return f"lora_name: {msg}"
    if e.field == "sampling_parameters":
        return f"sampling_parameters: {msg}"
    if e.field in ("prompt", "text_input"):
        return f"text_input: {msg}"
    if e.field in (None, "sampling_params", "sampling_parameters"):
        return f"sampling_parameters: {msg}"
    return f"sampling_parameters.{e.field}: {msg}"


def make_response(r: GenerateRequest, out: RequestOutput):
    prefix = r.prompt if r.prepend_input else ""
    tensors = [pb_utils.Tensor("text_output", np.array([(prefix + o.text).encode() for o in out.outputs], dtype=object))]
    if out.finished:
        reasons = [str(o.finish_reason).encode() for o in out.outputs]
        tensors.append(pb_utils.Tensor("finish_reason", np.array(reasons, dtype=object)))
    if r.return_num_input_tokens:
        tensors.append(pb_utils.Tensor("num_input_tokens", np.array([len(out.prompt_token_ids)], dtype=np.uint32)))
    if r.return_num_output_tokens:  # this response's tokens: deltas when streaming, all at the end otherwise
        tensors.append(pb_utils.Tensor("num_output_tokens", np.array([len(o.token_ids) for o in out.outputs],
                                                                     dtype=np.uint32)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def error_response(message: str, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


# ---- metrics --------------------------------------------------------------------------------------
class TritonMetrics:
    """The engine's metrics (`pagedcore.metrics.METRICS`) as Triton custom metrics, served on the
    metrics port's /metrics: `MetricsPublisher` sets the gauges, increments the counters and replays
    the histograms' new observations every METRICS_INTERVAL_S."""

    def __init__(self, engine, labels: dict[str, str]):
        # pb_utils gets MetricFamily from the stub when the model is loaded, not at import.
        kinds = {"gauge": pb_utils.MetricFamily.GAUGE, "counter": pb_utils.MetricFamily.COUNTER,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}
        self._families = []  # a family dropped is a family unregistered: kept until close()
        self.metrics = {}
        for spec in METRICS:
            family = pb_utils.MetricFamily(name=spec.name, description=spec.help, kind=kinds[spec.kind])
            self._families.append(family)
            for value in spec.label_values or [None]:
                series = {**labels, **({spec.label: value} if spec.label else {})}
                self.metrics[spec.name, value] = family.Metric(labels=series, buckets=list(spec.buckets)) \
                    if spec.kind == "histogram" else family.Metric(labels=series)
        self.publisher = MetricsPublisher(
            engine, self.push, METRICS_INTERVAL_S,
            on_error=lambda e: pb_utils.Logger.log_warn(f"pagedcore metrics update failed: {e}"))

    def push(self, update: Update) -> None:
        update.apply(self.metrics[update.spec.name, update.label_value], increment="increment")

    def close(self) -> None:
        self.publisher.stop()
        self.metrics.clear()  # metrics before their families, as the Python backend requires
        self._families.clear()


async def _drain(timeout: float = 10.0) -> None:
    """Let the request coroutines still running send their last response."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


# ---- the model --------------------------------------------------------------------------------------
class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError("the pagedcore model needs `model_transaction_policy { decoupled: true }`")
        settings = load_settings(Path(args["model_repository"]), args["model_version"])
        import pagedcore

        pb_utils.Logger.log_info(f"pagedcore engine settings: {settings} (pagedcore from {Path(pagedcore.__file__).parent}, "
                                 f"this backend from {Path(__file__).parent})")
        self.engine = AsyncLLMEngine.from_settings(**settings)
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="pagedcore-triton-loop", daemon=True)
        self.loop_thread.start()
        # Read live from the LLMEngine: AsyncLLMEngine.stats() is the last step's snapshot, which stays
        # stale when an abort leaves the engine idle (no step follows to refresh it).
        # Labelled by instance too: with instance_group count > 1 each replica's engine exports its own series.
        self.metrics = TritonMetrics(self.engine.engine, {"model_name": args["model_name"],
                                                          "model_instance": args.get("model_instance_name", "")})

    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self.generate(request), self.loop)
        return None  # decoupled: responses go through each request's sender

    async def generate(self, request) -> None:
        """Serve one request; a cancellation seen while it waits for output (queued, or between
        tokens) cancels the serving task, which closes its stream and aborts the engine request."""
        sender = request.get_response_sender()
        task = asyncio.ensure_future(self._serve(request, sender))
        while not task.done():
            await asyncio.wait({task}, timeout=CANCEL_POLL_S)
            if not task.done() and request.is_cancelled():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self._send_error(sender, "request cancelled", pb_utils.TritonError.CANCELLED)

    async def _serve(self, request, sender) -> None:
        try:
            r = parse_request(request, self.engine.engine.load_json)
            kind = OutputKind.DELTA if r.stream else OutputKind.CUMULATIVE  # CUMULATIVE: the last one holds it all
            # aclosing: leaving the loop early closes the stream at once, which aborts the engine request.
            async with aclosing(self.engine.generate(r.prompt, r.sampling_params, output_kind=kind, timeout=r.timeout,
                                                     priority=r.priority, cache_salt=r.cache_salt,
                                                     lora_request=r.lora_name)) as outputs:
                async for out in outputs:
                    if request.is_cancelled():
                        sender.send(error_response("request cancelled", pb_utils.TritonError.CANCELLED), flags=FINAL)
                        return
                    if r.stream or out.finished:
                        sender.send(make_response(r, out), flags=FINAL if out.finished else 0)
        except InvalidRequestError as e:
            self._send_error(sender, error_message(e), pb_utils.TritonError.INVALID_ARG)
        except RequestTimeoutError as e:  # Triton's own word for it: "Request timeout expired"
            self._send_error(sender, f"Request timeout expired: {e}", pb_utils.TritonError.UNAVAILABLE)
        except OverloadedError as e:  # overload, shutting down, unhealthy: retry later (or elsewhere)
            self._send_error(sender, f"{e} (retry after {e.retry_after:g} s)", pb_utils.TritonError.UNAVAILABLE)
        except Exception as e:
            pb_utils.Logger.log_error(f"pagedcore request failed: {type(e).__name__}: {e}")
            self._send_error(sender, f"{type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)

    @staticmethod
    def _send_error(sender, message: str, code) -> None:
        try:
            sender.send(error_response(message, code), flags=FINAL)
        except Exception as e:  # e.g. the final flag already went out, or the client is gone
            pb_utils.Logger.log_warn(f"pagedcore could not send an error response ({message}): {e}")

    def finalize(self) -> None:
        # Stop admitting, give the requests in flight the grace period; then open streams end with
        # EngineDeadError -> an UNAVAILABLE response each.
        self.engine.shutdown(self.engine.config.shutdown_grace_period)
        self.metrics.close()
        asyncio.run_coroutine_threadsafe(_drain(), self.loop).result(timeout=15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)
