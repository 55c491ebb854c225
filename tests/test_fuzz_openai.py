"""Fuzzing the OpenAI routes of a real `pagedcore serve-bentoml`: schemathesis drives them from their
OpenAPI document (valid and invalid bodies), hypothesis sends hostile bodies (NaN and inf, huge and
negative numbers, control characters, invalid UTF-8, token ids out of range, deep nesting, wrong
types). Every answer must be a 2xx, or a 4xx with a message, within the time limit, never a 5xx or a
hang; afterwards the server still answers and the engine is idle (nothing leaked).

The CI runs a short campaign (about a minute); PAGEDCORE_FUZZ_EXAMPLES scales it up.
"""

from __future__ import annotations

import json
import math
import os

import pytest

httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("bentoml")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedcore.adapters.openai_schema import openapi_document  # noqa: E402
from pagedcore.bench.serve import serving_server  # noqa: E402
from pagedcore.bench.soak import IDLE_GAUGES, wait_idle  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("PAGEDCORE_FUZZ_EXAMPLES", "20"))
TIMEOUT = 60.0  # seconds per request: longer is a hang
VOCAB = 49152
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # Small bounds: every valid request finishes in seconds (the tiny model, a 256-token context).
    engine = {"model": str(tiny_model_dir("llama")), "dtype": "float32", "num_threads": 1, "num_kv_blocks": 256,
              "max_num_seqs": 16, "max_model_len": 256}
    with serving_server("bentoml", engine, startup_timeout=150) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def assert_answered(r) -> None:
    """A 2xx, or a 4xx whose body is an OpenAI error with a message; never a 5xx."""
    sent = getattr(r.request, "content", None) or getattr(r.request, "body", None) or b""
    assert r.status_code < 500, f"{r.status_code} for {sent[:300]!r}: {r.text[:500]}"
    if r.status_code >= 400:
        body = r.json()
        assert isinstance(body.get("error"), dict) and body["error"].get("message"), r.text[:500]
    if r.status_code == 429:
        assert r.headers.get("retry-after"), "429 without Retry-After"


def test_the_openapi_document_is_served_and_loads(http):
    doc = http.get("/v1/openapi.json").json()
    assert doc == openapi_document()
    schema = schemathesis.openapi.from_dict(doc)
    assert {op.ok().path for op in schema.get_all_operations()} >= {"/completions", "/chat/completions"}


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_schema_driven_bodies_get_an_answer(server, model, path, mode):
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(openapi_document())
    strategy = schema[path]["POST"].as_strategy(generation_mode=GenerationMode(mode))
    seen = []

    @FUZZ_SETTINGS
    @given(case=strategy)
    def run(case):
        if mode == "positive" and isinstance(case.body, dict):
            case.body["model"] = model  # a valid body names the served model
        r = case.call(base_url=f"{server.url}/v1", timeout=TIMEOUT)  # schemathesis serializes what it generated
        seen.append(r.status_code)
        assert_answered(r)

    run()
    if mode == "positive":
        assert any(200 <= s < 300 for s in seen), f"no valid body was answered 2xx: {seen}"
    else:
        assert any(400 <= s < 500 for s in seen), f"no invalid body was refused: {seen}"


HOSTILE = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 10**30, -(10**30), -1, 0, 2**63, "", "\x00", "\x1b[2J\r\n",
                     None, True, [], {}, [[]], "A" * 100_000, [-1, VOCAB, 10**12]]),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=50),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.lists(st.integers(min_value=-5, max_value=VOCAB + 5), max_size=8),
    st.recursive(st.integers(), lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids,
                                                                                          max_size=3), max_leaves=8),
)
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of", "seed", "stop",
          "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
          "stop_token_ids", "stream", "stream_options", "model", "use_beam_search", "max_completion_tokens",
          "no_such_field"]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@FUZZ_SETTINGS
@given(chat=st.booleans(), field=st.sampled_from(FIELDS), value=HOSTILE, stream=st.booleans())
def test_hostile_field_values_are_refused_or_served(http, model, chat, field, value, stream):
    body = ({"model": model, "messages": [{"role": "user", "content": "hi"}]} if chat
            else {"model": model, "prompt": "hi"})
    body.update({"max_tokens": 4, "stream": stream, field: value})
    r = http.post("/v1/chat/completions" if chat else "/v1/completions",
                  content=json.dumps(body, allow_nan=True).encode(), headers={"content-type": "application/json"})
    assert_answered(r)


@pytest.mark.parametrize("raw", [
    b"\xff\xfe\x00 not utf-8", b'{"model": "x", "prompt": "\xc3\x28"}', b'{"model": ', b"null", b"[]", b"42",
    b'{"model": "m", "prompt": "hi", "max_tokens": 1e999}', ('{"model": "m", "prompt": ' + _nested(50_000) + "}").encode(),
    b'{"model": "m", "prompt": "hi", "n": 100000}', b'{"model": "m", "prompt": "hi", "best_of": 100000}',
    b'{"model": "m", "prompt": "hi", "max_tokens": 10000000}', b"{" + b'"a":1,' * 200_000 + b'"b":2}',
    b'{"model": [], "prompt": "0", "stream": 0.0}', b'{"model": {"a": 1}, "prompt": "hi"}',
    b'{"model": "m", "messages": [{"role": [], "content": "hi"}]}',
], ids=["invalid-utf8", "invalid-utf8-in-string", "truncated", "null", "array", "number", "overflow-float",
        "deep-nesting", "huge-n", "huge-best-of", "huge-max-tokens", "huge-object",
        "model-list", "model-object", "chat-role-list"])
def test_hostile_raw_bodies_are_refused_or_served(http, model, raw):
    r = http.post("/v1/chat/completions" if b'"messages"' in raw else "/v1/completions", content=raw.replace(b'"m"', json.dumps(model).encode()),
                  headers={"content-type": "application/json"})
    assert_answered(r)


def test_after_the_fuzzing_the_server_serves_and_nothing_leaked(http, server, model):
    r = http.post("/v1/completions", json={"model": model, "prompt": "still there?", "max_tokens": 4,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    idle = wait_idle(server.metrics_url)
    assert all(idle.get(g) == 0.0 for g in IDLE_GAUGES), idle
