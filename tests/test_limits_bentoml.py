"""Issue 15 through the OpenAI door: a real `bentoml serve` (tiny model), the real `openai` client.

The probe that took the service down (one chat request with n = 100000) is now an immediate 400;
hostile bodies get a clear 400; overload a 429 with Retry-After; a request past its `timeout` a 408
(an error event when streaming); the refusals show on /metrics by reason and the gauges return to 0;
SIGTERM lets the request in flight finish and the server exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("bentoml")

from servers import bentoml_serve, stop, wait_ready  # noqa: E402

pytestmark = pytest.mark.slow

SETTINGS = dict(dtype="float32", num_kv_blocks=512, block_size=8, max_num_seqs=8, num_threads=1,
                max_concurrent_requests=2, payload_limit=100_000, shutdown_grace_period=30)
STARTUP_TIMEOUT = 120
USER = [{"role": "user", "content": "Tell me a story"}]
# Long requests ask for logprobs (every step then computes the whole logits row) and up to 2000 tokens of a tiny model
# that takes 4096: past the deadlines and read timeouts below however fast the steps get (its ~500 tokens with
# logprobs ran inside 0.3 s once a decode step's Python shrank).
SLOW = {"logprobs": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """(base url, model name, the server process)."""
    model = tiny_model_dir("llama-long")
    server = bentoml_serve(tmp_path_factory.mktemp("bentoml-limits"), {"model": model, **SETTINGS})
    try:
        wait_ready(server, STARTUP_TIMEOUT)
        yield server.url, model.name, server.process
    finally:
        stop(server.process)


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def samples(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = {}
    for m in re.finditer(r"^(pagedcore:\w+)\{([^}]*)\} (\S+)$", text, re.M):
        name, labels, value = m.groups()
        reason = re.search(r'reason="([^"]+)"', labels)
        if "le=" not in labels:
            out[name + (f'{{reason="{reason.group(1)}"}}' if reason else "")] = float(value)
    return out


def wait_metrics(base: str, ready, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = samples(base)
        if ready(m):
            return m
        assert time.monotonic() < deadline, f"/metrics not as expected after {timeout} s: {m}"
        time.sleep(0.25)


def rejected(m: dict, reason: str) -> float:
    return m.get(f'pagedcore:requests_rejected_total{{reason="{reason}"}}', 0.0)


def aborted(m: dict, reason: str) -> float:
    return m.get(f'pagedcore:requests_aborted_total{{reason="{reason}"}}', 0.0)


def assert_serves(base: str, client, model: str) -> None:
    assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200
    r = client.chat.completions.create(model=model, messages=USER, temperature=0, max_tokens=3)
    assert r.usage.completion_tokens == 3 or r.choices[0].finish_reason == "stop"


# ---- the probe of issue 15.3, and other hostile bodies -----------------------------------------------------
def test_n_100000_is_an_immediate_400_and_the_service_stays_up(served, client):
    base, model, _ = served
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=USER, n=100000)
    assert time.monotonic() - t0 < 3
    err = e.value.body
    assert err["param"] == "n" and "max_best_of" in err["message"], err
    assert_serves(base, client, model)


HOSTILE = {  # name: (route, raw body, param, words in the message)
    "JSON nested 40 deep": ("chat/completions", '{"messages": ' + "[" * 40 + "]" * 40 + "}", None, "max_json_depth"),
    "JSON nested 45000 deep": ("completions", "[" * 45000 + "]" * 45000, None, "max_json_depth"),
    "body over payload_limit": ("completions", json.dumps({"prompt": "x" * 100_001}), None, "payload_limit"),
    "17 stop strings": ("completions", json.dumps({"prompt": "Hi", "stop": [f"s{i}" for i in range(17)]}), "stop",
                        "max_stop_sequences"),
    "best_of 10**9": ("completions", json.dumps({"prompt": "Hi", "best_of": 10**9}), "best_of", "max_best_of"),
    "negative timeout": ("completions", json.dumps({"prompt": "Hi", "timeout": -1}), "timeout", "timeout"),
    "seed 2**70": ("completions", json.dumps({"prompt": "Hi", "seed": 2**70}), "seed", "seed"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_body_gets_a_clear_400_and_the_service_stays_up(served, client, case):
    base, model, _ = served
    route, body, param, words = HOSTILE[case]
    t0 = time.monotonic()
    r = httpx.post(f"{base}/v1/{route}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert time.monotonic() - t0 < 3
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert_serves(base, client, model)


# ---- overload: 429 with Retry-After, and everything back to 0 ------------------------------------------------
def test_overload_is_a_429_with_retry_after_and_the_gauges_return_to_0(served, client):
    """Eight requests at once against max_concurrent_requests 2: the ones that find two in flight
    are refused at once with 429 and Retry-After; the admitted ones run to the end."""
    base, model, _ = served
    body = {"model": model, "messages": USER, "temperature": 0, "max_tokens": 400, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(http.post(f"{base}/v1/chat/completions", json=body) for _ in range(8)))

    before = samples(base)
    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 429]
    served_ok = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(served_ok) == 8, [r.text for r in responses]
    assert refused and len(served_ok) >= 2
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "max_concurrent_requests" and "overloaded" in err["message"], err
    for r in served_ok:
        assert r.json()["usage"]["completion_tokens"] == 400
    m = wait_metrics(base, lambda m: rejected(m, "max_concurrent_requests") == rejected(
        before, "max_concurrent_requests") + len(refused) and m["pagedcore:num_requests_running"] == 0
        and m["pagedcore:num_requests_waiting"] == 0 and m["pagedcore:kv_cache_used_blocks"] == 0)
    assert m["pagedcore:engine_healthy"] == 1
    assert_serves(base, client, model)


def test_the_openai_client_sees_overload_as_a_rate_limit_error(served, client):
    base, model, _ = served
    body = {"model": model, "messages": USER, "temperature": 0, "max_tokens": 400, "extra_body": {"ignore_eos": True}}

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60) as ac:
            calls = [ac.chat.completions.create(**body) for _ in range(6)]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, Exception)]
    assert errors and all(isinstance(e, openai.RateLimitError) for e in errors), errors
    assert_serves(base, client, model)


# ---- deadlines: the `timeout` extra ------------------------------------------------------------------------------
def test_a_request_past_its_timeout_is_a_408_or_an_error_event_and_is_aborted(served, client):
    base, model, _ = served
    before = samples(base)
    body = {"model": model, "messages": USER, "temperature": 0, "max_tokens": 2000, "ignore_eos": True, "timeout": 0.3,
            **SLOW}
    t0 = time.monotonic()
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert 0.3 <= time.monotonic() - t0 < 10
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "request_timeout", events[-1]
    m = wait_metrics(base, lambda m: aborted(m, "timeout") == aborted(before, "timeout") + 2
                     and m["pagedcore:kv_cache_used_blocks"] == 0)
    assert m["pagedcore:num_requests_running"] == 0
    assert_serves(base, client, model)


# ---- disconnects ----------------------------------------------------------------------------------------------------
def test_a_non_streaming_client_that_hangs_up_is_aborted_at_once(served, client):
    base, model, _ = served
    time.sleep(1.0)  # the metrics of earlier tests are pushed (every 0.5 s) before the baseline
    before = samples(base)
    body = {"model": model, "messages": USER, "temperature": 0, "max_tokens": 2000, "ignore_eos": True, **SLOW}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    m = wait_metrics(base, lambda m: aborted(m, "client") == aborted(before, "client") + 1
                     and m["pagedcore:kv_cache_used_blocks"] == 0)
    generated = m["pagedcore:generation_tokens_total"] - before["pagedcore:generation_tokens_total"]
    assert generated < 2000, "the request ran to its end after the client left"
    assert_serves(base, client, model)


# ---- graceful shutdown (last: it stops the module's server) ------------------------------------------------------
def test_sigterm_lets_the_request_in_flight_finish_and_the_server_exits_0(served):
    base, model, proc = served
    body = {"model": model, "messages": USER, "temperature": 0, "max_tokens": 450, "ignore_eos": True, "stream": True, **SLOW,
            "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as s:
        lines = (line for line in s.iter_lines() if line)
        chunks.append(next(lines))
        os.killpg(proc.pid, signal.SIGTERM)  # mid-stream: 450 tokens take a while even here
        chunks += list(lines)
    events = [json.loads(c[6:]) for c in chunks if c.startswith("data: {")]
    assert chunks[-1] == "data: [DONE]", chunks[-3:]
    assert events[-1]["usage"]["completion_tokens"] == 450, events[-1]
    assert proc.wait(timeout=60) == 0
