"""Issue 15 through the Triton door: the real tritonserver and the real tritonclient, a tiny model.

Hostile inputs (wrong tensor types and shapes, huge n, bad or deep JSON, oversized text) get
INVALID_ARG and the server keeps serving; overload and a request past its Triton timeout get
UNAVAILABLE; the refusals show on /metrics by reason, and the gauges return to 0.
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import requests

grpcclient = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("pytriton")

from pagedcore.adapters.triton_launcher import TritonServer  # noqa: E402
from test_triton_server import MODEL, StreamClient, free_ports, infer_inputs, is_final, text_of  # noqa: E402

pytestmark = pytest.mark.slow

SETTINGS = dict(dtype="float32", num_kv_blocks=512, block_size=8, max_num_seqs=8, num_threads=1,
                max_concurrent_requests=2, payload_limit=100_000)
TIMEOUT = 120


def greedy(max_tokens: int, **kw) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, **kw}


def raw_tensor(name: str, value: np.ndarray, dtype: str):
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    http, grpc, metrics = free_ports(3)
    log = tmp_path_factory.mktemp("triton-limits") / "tritonserver.log"
    server = TritonServer(http_port=http, grpc_port=grpc, metrics_port=metrics, log_path=log,
                          engine_settings={**SETTINGS, "model": str(tiny_model_dir("llama-long"))})
    server.start()
    try:
        server.wait_ready(timeout=150)
        # the server runs this checkout's pagedcore, not another one installed in the venv
        text = log.read_text(errors="replace")
        assert f"pagedcore from {_repo()}," in text, text[-3000:]
        yield server
    except (RuntimeError, TimeoutError) as e:
        pytest.fail(f"{e}\n--- tritonserver log (tail) ---\n{log.read_text(errors='replace')[-4000:]}")
    finally:
        server.stop(timeout=30)


def _repo():
    from pathlib import Path

    import pagedcore

    return Path(pagedcore.__file__).parent


@pytest.fixture
def client(server):
    c = StreamClient(server)
    try:
        yield c
    finally:
        c.close()


def samples(server) -> dict[str, float]:
    """/metrics' pagedcore samples by name, with a `reason` label kept in the key."""
    text = requests.get(server.metrics_url, timeout=10).text
    out = {}
    for m in re.finditer(r"^(pagedcore:\w+)\{([^}]*)\} (\S+)$", text, re.M):
        name, labels, value = m.groups()
        reason = re.search(r'reason="([^"]+)"', labels)
        if "le=" not in labels:
            out[name + (f'{{reason="{reason.group(1)}"}}' if reason else "")] = float(value)
    return out


def wait_metrics(server, ready, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = samples(server)
        if ready(m):
            return m
        assert time.monotonic() < deadline, f"/metrics not as expected after {timeout} s: {m}"
        time.sleep(0.2)


def rejected(m: dict, reason: str) -> float:
    return m.get(f'pagedcore:requests_rejected_total{{reason="{reason}"}}', 0.0)


def assert_serves(client) -> None:
    results, error = client.generate(infer_inputs("Hello there", greedy(4, ignore_eos=True)))
    assert error is None, error
    assert is_final(results[-1]) and "".join(text_of(r) for r in results)


# ---- hostile inputs: INVALID_ARG, and the next request is served ------------------------------------------
def _inputs(case: str) -> list:
    good = infer_inputs("Hi", greedy(4))
    text_int = raw_tensor("text_input", np.array([7], dtype=np.int32), "INT32")
    two_texts = raw_tensor("text_input", np.array([b"a", b"b"], dtype=object), "BYTES")
    stream_bytes = raw_tensor("stream", np.array([b"yes"], dtype=object), "BYTES")
    bad_utf8 = raw_tensor("text_input", np.array([b"\xff\xfe\xfa"], dtype=object), "BYTES")
    return {
        "text_input INT32": [text_int],
        "text_input of shape [2]": [two_texts],
        "stream as BYTES": [stream_bytes, good[1]],
        "text_input not UTF-8": [bad_utf8],
        "n 100000": infer_inputs("Hi", {"n": 100000}),
        "best_of 10**9": infer_inputs("Hi", {"best_of": 10**9}),
        "17 stop strings": infer_inputs("Hi", {"stop": [f"s{i}" for i in range(17)]}),
        "sampling_parameters nested 40 deep": infer_inputs("Hi", raw_params="[" * 40 + "]" * 40),
        "sampling_parameters not JSON": infer_inputs("Hi", raw_params="{'n': 1"),
        "sampling_parameters a string": infer_inputs("Hi", raw_params='"greedy"'),
        "max_tokens a string": infer_inputs("Hi", {"max_tokens": "many"}),
        "seed 2**70": infer_inputs("Hi", {"seed": 2**70}),
        "logprobs 1000": infer_inputs("Hi", {"logprobs": 1000}),
        "text_input over payload_limit": infer_inputs("x" * 100_001, greedy(4)),
        "sampling_parameters over payload_limit": infer_inputs("Hi", raw_params=json.dumps({"stop": ["y" * 100_001]})),
    }[case]


EXPECTED = {  # case: what the message must say
    "text_input INT32": "text_input", "text_input of shape [2]": "text_input", "stream as BYTES": "stream",
    "text_input not UTF-8": "text_input: not valid UTF-8", "n 100000": "max_best_of",
    "best_of 10**9": "max_best_of", "17 stop strings": "max_stop_sequences",
    "sampling_parameters nested 40 deep": "max_json_depth", "sampling_parameters not JSON": "not valid JSON",
    "sampling_parameters a string": "sampling_parameters", "max_tokens a string": "max_tokens",
    "seed 2**70": "seed", "logprobs 1000": "logprobs", "text_input over payload_limit": "payload_limit",
    "sampling_parameters over payload_limit": "payload_limit",
}


def generate_http(server, body: dict) -> requests.Response:
    """Triton's HTTP generate endpoint. Neither it nor a gRPC stream shows a decoupled model's error
    code to the client (a gRPC stream carries the message only; generate answers 400 to any error
    the model sends), so these tests check the messages; the codes are set in triton_backend.py."""
    return requests.post(f"http://{server.http_url}/v2/models/{MODEL}/generate", json=body, timeout=TIMEOUT)


@pytest.mark.parametrize("case", list(EXPECTED))
def test_hostile_input_is_refused_clearly_at_once_and_the_server_keeps_serving(client, case):
    t0 = time.monotonic()
    results, error = client.generate(_inputs(case))
    assert error is not None and not results, f"{case}: no error"
    assert time.monotonic() - t0 < 10
    assert EXPECTED[case] in str(error), f"{case}: unclear message {error}"
    assert_serves(client)


HTTP_BODIES = {  # the JSON-expressible cases again, on the HTTP generate endpoint
    "n 100000": {"text_input": "Hi", "sampling_parameters": json.dumps({"n": 100000})},
    "nested 40 deep": {"text_input": "Hi", "sampling_parameters": "[" * 40 + "]" * 40},
    "not JSON": {"text_input": "Hi", "sampling_parameters": "{'n': 1"},
    "seed 2**70": {"text_input": "Hi", "sampling_parameters": json.dumps({"seed": 2**70})},
    "over payload_limit": {"text_input": "x" * 100_001},
}


@pytest.mark.parametrize("case", list(HTTP_BODIES))
def test_hostile_input_on_http_generate_is_a_400(server, client, case):
    r = generate_http(server, HTTP_BODIES[case])
    assert r.status_code == 400, f"{case}: {r.status_code} {r.text}"
    assert r.json()["error"]
    assert_serves(client)


def test_over_limit_refusals_show_on_metrics_by_reason(server, client):
    time.sleep(1.0)  # earlier tests' refusals reach /metrics (pushed every 0.25 s) before the baseline
    before = samples(server)
    reasons = ("max_best_of", "max_json_depth", "payload_limit")
    for case in ("n 100000", "sampling_parameters nested 40 deep", "text_input over payload_limit"):
        client.generate(_inputs(case))
    m = wait_metrics(server, lambda m: all(rejected(m, r) > rejected(before, r) for r in reasons))
    time.sleep(1.0)
    m = samples(server)
    for reason in reasons:
        assert rejected(m, reason) == rejected(before, reason) + 1, reason


# ---- overload and timeouts: UNAVAILABLE ---------------------------------------------------------------------
def test_overload_is_unavailable_at_once_and_the_gauges_return_to_0(server, client):
    long = greedy(2000, ignore_eos=True)  # in flight until cancelled, however fast the steps
    holders = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(2)]
    firsts = []
    try:
        for h in holders:  # two streams in flight fill max_concurrent_requests (2)
            got = []
            h.start_stream(callback=lambda result, error, got=got: got.append((result, error)))
            h.async_stream_infer(MODEL, infer_inputs("Tell me a story", long), enable_empty_final_response=True)
            firsts.append(got)
        deadline = time.monotonic() + 30
        while not all(firsts):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        results, error = client.generate(infer_inputs("Hi", greedy(4)))
        assert time.monotonic() - t0 < 5 and error is not None and not results
        assert "max_concurrent_requests" in str(error) and "retry after" in str(error), str(error)
    finally:
        for h in holders:  # cancel the streams: their requests are aborted
            h.stop_stream(cancel_requests=True)
            h.close()
    m = wait_metrics(server, lambda m: rejected(m, "max_concurrent_requests") >= 1
                     and m['pagedcore:requests_aborted_total{reason="client"}'] >= 2
                     and m["pagedcore:num_requests_running"] == 0 and m["pagedcore:kv_cache_used_blocks"] == 0)
    assert m["pagedcore:num_requests_waiting"] == 0
    assert_serves(client)


def test_a_request_past_its_triton_timeout_is_aborted_and_unavailable(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    got = []
    c.start_stream(callback=lambda result, error: got.append((result, error)))
    try:
        t0 = time.monotonic()
        c.async_stream_infer(MODEL, infer_inputs("Tell me a story", greedy(2000, ignore_eos=True)),
                             enable_empty_final_response=True, timeout=300_000)  # microseconds: 0.3 s
        deadline = time.monotonic() + 30
        while not any(error is not None or (r is not None and is_final(r)) for r, error in got):
            assert time.monotonic() < deadline, "the request ran on past its timeout"
            time.sleep(0.05)
        error = next(e for _, e in got if e is not None)
        assert "Request timeout expired" in str(error), str(error)  # UNAVAILABLE, as Triton's own timeouts
        assert 0.3 <= time.monotonic() - t0 < 10
    finally:
        c.stop_stream()
        c.close()
    m = wait_metrics(server, lambda m: m['pagedcore:requests_aborted_total{reason="timeout"}'] >= 1
                     and m["pagedcore:kv_cache_used_blocks"] == 0)
    assert m["pagedcore:num_requests_running"] == 0


# ---- shutdown (last: it stops the module's server) ----------------------------------------------------------
def test_sigterm_unloads_the_model_and_tritonserver_exits_0(server):
    assert server.stop(timeout=60) == 0
