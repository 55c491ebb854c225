"""The Triton front door: the real tritonserver (nvidia-pytriton wheel) and the real tritonclient.

One server for the module, on free loopback ports, with a small engine in float32; every streamed
or generated text is checked against the offline engine's greedy output on the same settings.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import time

import numpy as np
import pytest
import requests

grpcclient = pytest.importorskip("tritonclient.grpc")
aio = pytest.importorskip("tritonclient.grpc.aio")
pytest.importorskip("pytriton")

from pagedcore.adapters.triton_launcher import TritonServer  # noqa: E402
from pagedcore.bench.serve import free_ports  # noqa: E402
from pagedcore.metrics import METRICS  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "pagedcore"
# The server and the offline reference run the same engine settings; float32 on both sides. One torch
# thread each: on a small shared machine, OpenMP threads spin against each other (10x slower steps).
SETTINGS = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=32, max_model_len=1024, num_threads=1)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
    "Hi!",
    "Translate 'good morning' into Spanish and German.",
    "What does a compiler do? Answer for a ten-year-old.",
    "Name a famous painting.",
]
MAX_TOKENS = [8, 16]  # the concurrent streams' mix; test_grpc_stream_* also uses (prompt 1, 32 tokens)
TIMEOUT = 180
# Structured output (sampling_parameters.structured_outputs, vLLM's names): a JSON schema and a regex.
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
STRUCTURED = {"json": {"temperature": 0, "max_tokens": 60, "structured_outputs": {"json": PERSON}},
              "regex": {"temperature": 0, "max_tokens": 20, "structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}}


def greedy(max_tokens: int, **kw) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, **kw}


# ---- fixtures: the server starts, the offline references are computed while it loads --------------
@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    from pagedcore.model_loader import resolve_model_dir

    resolve_model_dir(None)  # convert the bundled GGUF here, never inside the server
    http, grpc, metrics = free_ports(3)
    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    server = TritonServer(http_port=http, grpc_port=grpc, metrics_port=metrics, engine_settings=SETTINGS, log_path=log)
    server.start()
    try:
        yield server
    finally:
        server.stop(timeout=30)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pagedcore.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def offline(server_process, prompts):
    """(prompt index, max_tokens) -> the offline engine's greedy CompletionOutput."""
    import torch

    from pagedcore import LLM

    threads = torch.get_num_threads()
    try:
        llm = LLM(**SETTINGS)  # sets torch's thread count for the whole process: restored below
        cases = [(i, m) for i in range(len(prompts)) for m in MAX_TOKENS] + [(1, 32)]
        outs = llm.generate([prompts[i] for i, _ in cases], [greedy(m) for _, m in cases], use_tqdm=False)
        structured = llm.generate([prompts[0]] * len(STRUCTURED), list(STRUCTURED.values()), use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
    return {**{case: out.outputs[0] for case, out in zip(cases, outs)},
            **{kind: out.outputs[0] for kind, out in zip(STRUCTURED, structured)}}


@pytest.fixture(scope="module")
def server(server_process, offline):
    try:
        server_process.wait_ready(timeout=150)
    except (RuntimeError, TimeoutError) as e:
        log = server_process.log_path.read_text(errors="replace")[-4000:]
        pytest.fail(f"{e}\n--- tritonserver log (tail) ---\n{log}")
    return server_process


# ---- client helpers -----------------------------------------------------------------------------------
def infer_inputs(prompt: str | None, params=None, *, stream: bool = True, raw_params: str | None = None,
                 **flags: bool) -> list:
    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else bool))
        return t

    inputs = [tensor("stream", stream, "BOOL")]
    if prompt is not None:
        inputs.append(tensor("text_input", prompt.encode(), "BYTES"))
    if params is not None or raw_params is not None:
        inputs.append(tensor("sampling_parameters", (raw_params or json.dumps(params)).encode(), "BYTES"))
    inputs += [tensor(name, value, "BOOL") for name, value in flags.items()]
    return inputs


def is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def text_of(result) -> str:
    out = result.as_numpy("text_output")
    return "" if out is None else out[0].decode()


class StreamClient:
    """tritonclient's callback API: start_stream once, async_stream_infer per request."""

    def __init__(self, server: TritonServer):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def generate(self, inputs) -> tuple[list, object]:
        """All responses of one request, up to its final one; or the error that ended it."""
        self.client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        results = []
        while True:
            result, error = self.responses.get(timeout=TIMEOUT)
            if error is not None:
                return results, error
            results.append(result)
            if is_final(result):
                return results, None

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


@pytest.fixture
def stream_client(server):
    c = StreamClient(server)
    try:
        yield c
    finally:
        c.close()


def engine_metrics(server: TritonServer) -> dict[str, float]:
    """The engine's samples on the metrics port by name (histogram buckets as `name{le="..."}`), each
    checked to carry the model's name as its `model_name` label."""
    text = requests.get(server.metrics_url, timeout=10).text
    samples = {}
    for m in re.finditer(r"^(pagedcore:\w+)\{([^}]*)\} (\S+)$", text, re.M):
        name, labels, value = m.groups()
        assert f'model_name="{MODEL}"' in labels, m.group(0)
        le = re.search(r'le="([^"]+)"', labels)
        samples[name + (f'{{le="{le.group(1)}"}}' if le else "")] = float(value)
    return samples


def wait_for_metric(server: TritonServer, name: str, value: float, timeout: float = 30.0) -> dict:
    return wait_for_metrics(server, lambda m: m.get(name) == value, timeout, fail=False)


def wait_for_metrics(server: TritonServer, ready, timeout: float = 30.0, fail: bool = True) -> dict:
    """Scrape until `ready(samples)`: the model pushes the engine's metrics every METRICS_INTERVAL_S."""
    deadline = time.monotonic() + timeout
    while True:
        m = engine_metrics(server)
        if ready(m):
            return m
        if time.monotonic() > deadline:
            assert not fail, f"/metrics not as expected after {timeout} s: {m}"
            return m
        time.sleep(0.2)


def wait_idle(server: TritonServer, timeout: float = 30.0) -> dict:
    """Scrape until no request runs or waits, no KV block is used, and nothing changed over two
    publish intervals (the model's METRICS_INTERVAL_S, 0.25 s): the numbers lag the engine by up to
    one, so a single idle scrape can still be the snapshot from before the last request arrived."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        now = engine_metrics(server)
        idle = all(now.get(f"pagedcore:{name}") == 0 for name in ("kv_cache_used_blocks", "num_requests_running",
                                                                  "num_requests_waiting"))
        if idle and now == last:
            return now
        assert time.monotonic() < deadline, f"not idle and settled after {timeout} s: {now}"
        last = now if idle else None
        time.sleep(0.6)


# ---- streaming -------------------------------------------------------------------------------------
def test_grpc_stream_equals_offline_greedy(stream_client, prompts, offline):
    results, error = stream_client.generate(infer_inputs(prompts[1], greedy(32)))
    assert error is None, error
    ref = offline[(1, 32)]
    assert "".join(text_of(r) for r in results) == ref.text
    assert len(results) > 2, "not streamed token by token"
    assert [is_final(r) for r in results].count(True) == 1 and is_final(results[-1])
    assert results[-1].as_numpy("finish_reason")[0].decode() == ref.finish_reason


def test_grpc_stream_reports_token_counts(stream_client, tokenizer, prompts, offline):
    results, error = stream_client.generate(
        infer_inputs(prompts[3], greedy(16), return_num_input_tokens=True, return_num_output_tokens=True))
    assert error is None, error
    ref = offline[(3, 16)]
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in results) == len(ref.token_ids)
    assert {int(r.as_numpy("num_input_tokens")[0]) for r in results} == {len(tokenizer.encode(prompts[3]))}


def test_http_generate_stream_sse_equals_offline_greedy(server, prompts, offline):
    body = {"text_input": prompts[1], "stream": True, "sampling_parameters": json.dumps(greedy(32))}
    with requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate_stream", json=body, stream=True,
                       timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.text
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
    ref = offline[(1, 32)]
    assert len(events) > 2 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == ref.text
    assert events[-1]["finish_reason"] == ref.finish_reason


def test_http_generate_non_streaming_one_response(server, prompts, offline):
    url = f"http://{server.http_url}/v2/models/{MODEL}/generate"
    ref = offline[(0, 16)]
    r = requests.post(url, json={"text_input": prompts[0], "sampling_parameters": json.dumps(greedy(16)),
                                 "exclude_input_in_output": True, "return_num_output_tokens": True}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == ref.text
    assert r.json()["num_output_tokens"] == len(ref.token_ids)
    # Without exclude_input_in_output, a non-streaming response carries the prompt first (as vLLM's backend).
    r = requests.post(url, json={"text_input": prompts[0], "sampling_parameters": json.dumps(greedy(16))},
                      timeout=TIMEOUT)
    assert r.json()["text_output"] == prompts[0] + ref.text


def test_structured_outputs_streamed_and_not_validate_and_equal_offline(server, stream_client, prompts, offline):
    jsonschema = pytest.importorskip("jsonschema")
    for kind, params in STRUCTURED.items():
        results, error = stream_client.generate(infer_inputs(prompts[0], params))
        assert error is None, error
        text = "".join(text_of(r) for r in results)
        assert text == offline[kind].text and results[-1].as_numpy("finish_reason")[0].decode() == "stop"
        r = requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate", timeout=TIMEOUT, json={
            "text_input": prompts[0], "sampling_parameters": json.dumps(params), "exclude_input_in_output": True})
        assert r.status_code == 200 and r.json()["text_output"] == text, r.text
    jsonschema.validate(json.loads(offline["json"].text), PERSON)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", offline["regex"].text)


# ---- 32 concurrent streams, some cancelled -------------------------------------------------------------
async def _stream(client, prompt: str, params: dict, cancel_after: int | None = None) -> dict:
    async def one_request():
        yield {"model_name": MODEL, "inputs": infer_inputs(prompt, params), "enable_empty_final_response": True}

    responses = client.stream_infer(one_request())
    text, n, finals = "", 0, 0
    async for result, error in responses:
        if error is not None:
            return {"error": str(error)}
        text, n, finals = text + text_of(result), n + 1, finals + is_final(result)
        if cancel_after is not None and n >= cancel_after:
            responses.cancel()  # the client walks away mid-stream
            return {"cancelled": True, "text": text}
    return {"text": text, "finals": finals}


def test_32_concurrent_streams_some_cancelled_all_blocks_freed(server, prompts, offline):
    cases = [(i % len(prompts), MAX_TOKENS[i // len(prompts) % len(MAX_TOKENS)], i % 5 == 2) for i in range(32)]
    tokens_before = engine_metrics(server)["pagedcore:generation_tokens_total"]

    async def run_all():
        client = aio.InferenceServerClient(server.grpc_url)
        try:
            return await asyncio.gather(*(
                _stream(client, prompts[p], greedy(200, ignore_eos=True) if cancel else greedy(m),
                        cancel_after=2 if cancel else None)
                for p, m, cancel in cases))
        finally:
            await client.close()

    results = asyncio.run(asyncio.wait_for(run_all(), TIMEOUT))
    for (p, m, cancel), res in zip(cases, results):
        assert "error" not in res, res
        if cancel:
            assert res.get("cancelled")
        else:
            assert res["finals"] == 1
            assert res["text"] == offline[(p, m)].text, f"prompt {p}, max_tokens {m}"

    m = wait_for_metric(server, "pagedcore:kv_cache_used_blocks", 0)
    assert m["pagedcore:kv_cache_used_blocks"] == 0, f"KV blocks still held after all streams ended: {m}"
    assert m["pagedcore:num_requests_running"] == 0 and m["pagedcore:num_requests_waiting"] == 0
    # The cancelled requests (200 tokens each if left alone) were aborted long before their end.
    n_cancelled = sum(c for *_, c in cases)
    finished_tokens = sum(len(offline[(p, m)].token_ids) for p, m, c in cases if not c)
    generated = m["pagedcore:generation_tokens_total"] - tokens_before
    assert finished_tokens <= generated < finished_tokens + n_cancelled * 100


def test_http_client_disconnect_aborts_the_request(server, prompts):
    tokens_before = engine_metrics(server)["pagedcore:generation_tokens_total"]
    body = {"text_input": prompts[0], "stream": True, "sampling_parameters": json.dumps(greedy(300, ignore_eos=True))}
    with requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate_stream", json=body, stream=True,
                       timeout=TIMEOUT) as r:
        events = (line for line in r.iter_lines() if line.startswith(b"data: "))
        next(events), next(events)  # two tokens in, then hang up
    m = wait_for_metric(server, "pagedcore:num_requests_running", 0)
    assert m["pagedcore:num_requests_running"] == 0 and m["pagedcore:kv_cache_used_blocks"] == 0, m
    assert m["pagedcore:generation_tokens_total"] - tokens_before < 100, "the request ran on after the disconnect"


def test_metrics_endpoint_shows_every_engine_metric(server, stream_client, prompts):
    tpot = "pagedcore:time_per_output_token_seconds_count"
    before = wait_idle(server)
    results, error = stream_client.generate(infer_inputs(prompts[4], greedy(4)))
    assert error is None, error
    wait_for_metrics(server, lambda m: m.get(tpot, 0) > before.get(tpot, 0))
    m = wait_idle(server)
    for spec in METRICS:  # the same names as the BentoML door (tests/test_bentoml_service.py)
        if spec.kind == "histogram":
            assert m[f'{spec.name}_bucket{{le="+Inf"}}'] == m[f"{spec.name}_count"] > 0, spec.name
            assert m[f"{spec.name}_sum"] > 0, spec.name
        else:
            assert spec.name in m, f"{spec.name} missing from /metrics"
    assert m["pagedcore:kv_cache_total_blocks"] == SETTINGS["num_kv_blocks"]
    assert m["pagedcore:kv_cache_usage_perc"] == 0 and m["pagedcore:num_requests_waiting"] == 0
    assert m["pagedcore:generation_tokens_total"] > 0 and m["pagedcore:prompt_tokens_total"] > 0


def test_metrics_count_one_request_exactly(server, stream_client, prompts):
    before = wait_idle(server)
    results, error = stream_client.generate(
        infer_inputs(prompts[2], greedy(12, ignore_eos=True), return_num_input_tokens=True,
                     return_num_output_tokens=True))
    assert error is None, error
    e2e = "pagedcore:e2e_request_latency_seconds"
    after = wait_for_metrics(server, lambda m: m[f"{e2e}_count"] > before[f"{e2e}_count"])
    d = {name: after[name] - before[name] for name in before}
    assert d["pagedcore:prompt_tokens_total"] == int(results[0].as_numpy("num_input_tokens")[0])
    assert d["pagedcore:generation_tokens_total"] == sum(int(r.as_numpy("num_output_tokens")[0]) for r in results) == 12
    ttft, tpot = "pagedcore:time_to_first_token_seconds", "pagedcore:time_per_output_token_seconds"
    assert d[f"{ttft}_count"] == d[f"{tpot}_count"] == d[f"{e2e}_count"] == 1
    assert 0 < d[f"{ttft}_sum"] < d[f"{e2e}_sum"] < 60
    # TPOT x (tokens - 1) is the time from the first token to the last: end to end less TTFT.
    assert d[f"{tpot}_sum"] * 11 == pytest.approx(d[f"{e2e}_sum"] - d[f"{ttft}_sum"], rel=1e-6)
    assert d["pagedcore:num_preemptions_total"] == 0


# ---- bad input: an error for that request, and the instance keeps serving ----------------------------------
BAD_INPUTS = {
    "missing text_input": (dict(prompt=None, params=greedy(4)), "text_input"),
    "non-JSON sampling_parameters": (dict(prompt="Hi", raw_params="{max_tokens: 4"), "sampling_parameters: not valid JSON"),
    "sampling_parameters not an object": (dict(prompt="Hi", params=[1, 2]), "sampling_parameters"),
    "unknown sampling field": (dict(prompt="Hi", params={"max_tokens": 4, "temprature": 0}), "temprature"),
    "bad sampling value": (dict(prompt="Hi", params={"temperature": -1}), "sampling_parameters.temperature"),
    "bad max_tokens": (dict(prompt="Hi", params={"max_tokens": 0}), "sampling_parameters.max_tokens"),
    "prompt over the limit": (dict(prompt="hello " * 1100, params=greedy(4)), "text_input: prompt has"),
    "empty prompt": (dict(prompt="", params=greedy(4)), "text_input"),
    "streaming with the input": (dict(prompt="Hi", params=greedy(4), exclude_input_in_output=False),
                                 "exclude_input_in_output"),
    "priority under fcfs": (dict(prompt="Hi", params={**greedy(4), "priority": 1}), "sampling_parameters.priority"),
    "cache_salt not a string": (dict(prompt="Hi", params={**greedy(4), "cache_salt": 5}), "sampling_parameters.cache_salt"),
    "invalid regex": (dict(prompt="Hi", params={**greedy(4), "structured_outputs": {"regex": "a(b"}}),
                      "sampling_parameters.structured_outputs: structured_outputs.regex does not compile"),
    "unsupported schema feature": (dict(prompt="Hi", params={**greedy(4), "structured_outputs": {
        "json": {"type": "object", "patternProperties": {"^x": {}}}}}), "'patternProperties' at # is not supported"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_an_error_and_the_next_request_succeeds(stream_client, prompts, offline, case):
    kwargs, expected = BAD_INPUTS[case]
    prompt, params = kwargs.pop("prompt"), kwargs.pop("params", None)
    results, error = stream_client.generate(infer_inputs(prompt, params, **kwargs))
    assert error is not None and not results, f"{case}: no error"
    assert expected in str(error), f"{case}: unclear message {error}"

    results, error = stream_client.generate(infer_inputs(prompts[4], greedy(8)))
    assert error is None, error
    assert "".join(text_of(r) for r in results) == offline[(4, 8)].text


def test_http_generate_bad_input_is_a_400_naming_the_field(server):
    r = requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate", timeout=TIMEOUT,
                      json={"text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": 4, "bogus": 1})})
    assert r.status_code == 400 and "sampling_parameters.bogus" in r.json()["error"]
