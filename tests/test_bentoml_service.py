"""The BentoML front door: a real `bentoml serve` subprocess, driven by the official `openai` client.

One server for the module, on a free loopback port, with a small float32 engine; greedy texts are
checked against the offline engine (`pagedcore.LLM`, same settings) on the same prompt and params.
The door's CLI and PAGEDCORE_* settings, which need no server: test_bentoml_settings.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("bentoml")

from conftest import CHAT_PROMPTS  # noqa: E402
from servers import bentoml_serve, stop, wait_ready  # noqa: E402
from pagedcore import SamplingParams  # noqa: E402
from pagedcore.adapters.bentoml_service import METRICS_INTERVAL_S  # noqa: E402
from pagedcore.metrics import METRICS  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# The server and the offline reference run the same engine settings; one torch thread each, since
# oversubscribed threads on a small shared machine make every step many times slower.
SETTINGS = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=64, max_model_len=1024, num_threads=1)
STARTUP_TIMEOUT = 120


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- fixtures: the server loads while the offline reference engine does ------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    from pagedcore.model_loader import resolve_model_dir

    resolve_model_dir(None)  # convert the bundled GGUF here, never inside the server
    server = bentoml_serve(tmp_path_factory.mktemp("bentoml"), SETTINGS)
    try:
        request.getfixturevalue("offline")  # load the reference engine while the server starts
        wait_ready(server, STARTUP_TIMEOUT)
        yield server.url
    finally:
        stop(server.process)


@pytest.fixture(scope="module")
def offline():
    from pagedcore import LLM

    return LLM(**SETTINGS)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat_ref(offline, messages, params):
    (out,) = offline.chat(messages, params, use_tqdm=False)
    return out


def gen_ref(offline, prompt, params):
    (out,) = offline.generate([prompt], params, use_tqdm=False)
    return out


def scrape(base: str) -> dict[str, float]:
    """The engine's samples in /metrics by name (histogram buckets as `name{le="..."}`), each checked
    to carry the served model's name as its `model_name` label."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    samples = {}
    for m in re.finditer(r"^(pagedcore:\w+)\{([^}]*)\} (\S+)$", text, re.M):
        name, labels, value = m.groups()
        assert f'model_name="{MODEL}"' in labels, m.group(0)
        le = re.search(r'le="([^"]+)"', labels)
        samples[name + (f'{{le="{le.group(1)}"}}' if le else "")] = float(value)
    return samples


def metric(base: str, name: str) -> float:
    samples = scrape(base)
    assert name in samples, f"{name} not in /metrics"
    return samples[name]


def wait_for_metrics(base: str, ready, timeout: float = 20.0) -> dict[str, float]:
    """Scrape until `ready(samples)`: the door pushes the engine's metrics every METRICS_INTERVAL_S."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(base)
        if ready(samples):
            return samples
        assert time.monotonic() < deadline, f"/metrics not as expected after {timeout} s: {samples}"
        time.sleep(0.2)


def wait_kv_free(base: str, timeout: float = 20.0) -> dict[str, float]:
    """Scrape until no request runs or waits, no KV block is used, and nothing changed over two
    publish intervals: the door's numbers lag the engine by up to one, so a single idle scrape can
    still be the snapshot from before the last request arrived."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        now = scrape(base)
        idle = all(now[f"pagedcore:{name}"] == 0 for name in ("kv_cache_used_blocks", "num_requests_running",
                                                              "num_requests_waiting"))
        if idle and now == last:
            return now
        assert time.monotonic() < deadline, f"not idle and settled after {timeout} s: {now}"
        last = now if idle else None
        time.sleep(2.2 * METRICS_INTERVAL_S)


# ---- the OpenAI API ------------------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_chat_equals_offline_chat_with_exact_usage(client, offline):
    question = CHAT_PROMPTS[0]
    ref = chat_ref(offline, user(question), greedy(16))
    r = client.chat.completions.create(model=MODEL, messages=user(question), temperature=0, max_completion_tokens=16)
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(offline.apply_chat_template(user(question)))
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_equals_offline_and_ends_with_usage(client, offline):
    question = CHAT_PROMPTS[2]
    ref = chat_ref(offline, user(question), greedy(20))
    chunks = list(client.chat.completions.create(model=MODEL, messages=user(question), temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.outputs[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_greedy_completion_streamed_and_not_equals_offline_generate(client, offline):
    prompt = "The three primary colors are"
    ref = gen_ref(offline, prompt, greedy(12, stop=["\n\n"]))
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=["\n\n"])
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=["\n\n"],
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


def test_completion_default_max_tokens_is_16_and_token_prompts_work(client, offline):
    ids = offline.get_tokenizer().encode("Once upon a time")
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == gen_ref(offline, ids, greedy(16, ignore_eos=True)).outputs[0].text


def test_a_list_of_prompts_gets_one_choice_per_prompt_streamed_or_not(client, offline):
    prompts = ["The capital of France is", "Two plus two equals"]
    refs = offline.generate(prompts, greedy(8), use_tqdm=False)
    r = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=8)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in refs]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)
    texts = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=8, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[0], texts[1]] == [o.outputs[0].text for o in refs]


def test_n3_seeded_sampling_returns_three_choices_equal_to_offline(client, offline):
    params = dict(temperature=0.8, max_tokens=12, seed=7)
    ref = chat_ref(offline, user(CHAT_PROMPTS[1]), SamplingParams(n=3, **params))
    r = client.chat.completions.create(model=MODEL, messages=user(CHAT_PROMPTS[1]), n=3, **params)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert [c.message.content for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in ref.outputs]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    # Streaming: every choice's deltas carry its index and it finishes exactly once.
    texts, finishes = {}, {}
    stream = client.chat.completions.create(model=MODEL, messages=user(CHAT_PROMPTS[1]), n=3, stream=True, **params)
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                assert c.index not in finishes
                finishes[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [o.text for o in ref.outputs]
    assert sorted(finishes) == [0, 1, 2]


def test_chat_logprobs_shape_and_values(client, offline):
    ref = chat_ref(offline, user(CHAT_PROMPTS[3]), greedy(8, logprobs=3))
    r = client.chat.completions.create(model=MODEL, messages=user(CHAT_PROMPTS[3]), temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    ref_out = ref.outputs[0]
    assert len(content) == r.usage.completion_tokens == len(ref_out.token_ids)
    for entry, tid, step in zip(content, ref_out.token_ids, ref_out.logprobs):
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(step[tid].logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    tokens = content[:-1] if r.choices[0].finish_reason == "stop" else content  # "stop": the last is <|im_end|>
    assert "".join(e.token for e in tokens) == r.choices[0].message.content


def test_completion_logprobs_shape(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)  # top-2, plus the sampled token if not among them
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


# ---- many clients, some leaving early -----------------------------------------------------------------
def test_32_concurrent_streams_with_disconnects_complete_and_free_every_block(server, offline):
    questions = [f"{q} (#{i})" for i, q in enumerate(CHAT_PROMPTS * 4)]
    leavers = set(range(3, 32, 8))  # 4 clients close their stream after a few chunks; one more times out
    refs = offline.chat([user(q) for q in questions], greedy(16), use_tqdm=False)

    async def one(aclient, i: int) -> str:
        # Leavers ask for far more tokens than they read: only an abort ends them quickly.
        extra = {"max_tokens": 900, "extra_body": {"ignore_eos": True}} if i in leavers else {"max_tokens": 16}
        stream = await aclient.chat.completions.create(model=MODEL, messages=user(questions[i]), temperature=0,
                                                       stream=True, **extra)
        text, n = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            n += 1
            if i in leavers and n == 3:
                await stream.close()
                break
        return text

    async def impatient(aclient) -> None:  # a non-streaming client that gives up waiting
        with pytest.raises(openai.APITimeoutError):
            await aclient.with_options(timeout=3).chat.completions.create(
                model=MODEL, messages=user("Tell me a long story."), max_tokens=900, extra_body={"ignore_eos": True})

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=180) as ac:
            texts = await asyncio.gather(*(one(ac, i) for i in range(32)), impatient(ac))
            return texts[:32]

    t0 = time.monotonic()
    texts = asyncio.run(main())
    for i, (text, ref) in enumerate(zip(texts, refs)):
        if i not in leavers:
            assert text == ref.outputs[0].text, f"client {i}: {text!r} != {ref.outputs[0].text!r}"
    wait_kv_free(server, timeout=15)  # a leaver left running would hold its blocks for ~900 more steps
    assert time.monotonic() - t0 < 120


# ---- structured output and tools ----------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


def test_response_format_json_schema_streamed_and_not_validates_and_equals_offline(client, offline):
    jsonschema = pytest.importorskip("jsonschema")
    messages = user("Describe a person as JSON.")
    ref = chat_ref(offline, messages, greedy(80, structured_outputs={"json": PERSON}))
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=80, response_format=fmt)
    assert r.choices[0].message.content == ref.outputs[0].text and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=80,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    # completions, sampled: any JSON object; the structured_outputs extra: a choice
    r = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=60, seed=3, n=2,
                                  extra_body={"response_format": {"type": "json_object"}})  # not in the client's API
    done = [c for c in r.choices if c.finish_reason == "stop"]  # seeded: the same choices finish every run
    assert done and all(isinstance(json.loads(c.text), dict) for c in done), r.choices
    r = client.chat.completions.create(model=MODEL, messages=user("Pick a colour."), max_tokens=10, seed=1,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].message.content in ("red", "green", "blue")


def _assert_calls_valid(calls, names):
    jsonschema = pytest.importorskip("jsonschema")
    assert calls and all(c.type == "function" and c.id for c in calls)
    assert {c.function.name for c in calls} <= set(names)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), PARAMETERS[c.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_streamed_and_not_validate_and_the_client_assembles_them(client, tool_choice):
    messages = user("What is the weather like in Paris today?")
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER, ADD], tool_choice=tool_choice, temperature=0,
              max_tokens=80)
    r = client.chat.completions.create(**kw)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls", choice
    _assert_calls_valid(choice.message.tool_calls, ["get_weather"] if isinstance(tool_choice, dict) else ["get_weather", "add"])
    with client.chat.completions.stream(**kw) as stream:  # the official client assembles the deltas
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
           [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    # sampled, n=3: every choice's calls still validate
    r = client.chat.completions.create(**{**kw, "temperature": 1.0, "seed": 5, "n": 3})
    for c in r.choices:
        _assert_calls_valid(c.message.tool_calls, ["get_weather", "add"])


def test_tool_choice_auto_and_none_answer_with_content_or_valid_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=user("Hi! How are you?"), tools=[WEATHER], max_tokens=30,
                                       temperature=0, tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    r = client.chat.completions.create(model=MODEL, messages=user("What is 2 + 3? Use the add tool."), tools=[ADD],
                                       max_tokens=60, temperature=0)
    msg = r.choices[0].message
    if msg.tool_calls:  # the model chose to call: then the call parsed into tool_calls and validates
        assert r.choices[0].finish_reason == "tool_calls"
        _assert_calls_valid(msg.tool_calls, ["add"])
    else:
        assert msg.content and "<tool_call>" not in msg.content


def test_logit_bias_equals_offline(client, offline):
    token = offline.get_tokenizer().encode(" banana")[0]
    ref = gen_ref(offline, "My favourite fruit is", greedy(6, logit_bias={token: 30.0}))
    r = client.completions.create(model=MODEL, prompt="My favourite fruit is", temperature=0, max_tokens=6,
                                  logit_bias={str(token): 30})
    assert r.choices[0].text == ref.outputs[0].text and " banana" in r.choices[0].text


# ---- bad input -------------------------------------------------------------------------------------------
LONG_PROMPT = "hello " * 1100  # over max_model_len = 1024

BAD = {  # name: (route, body, status, param)
    "malformed-json": ("chat/completions", b'{"model": "x", "messages": [', 400, None),
    "unknown-model": ("chat/completions", {"model": "gpt-4", "messages": user("Hi")}, 404, "model"),
    "negative-temperature": ("chat/completions", {"model": MODEL, "messages": user("Hi"), "temperature": -0.5}, 400,
                             "temperature"),
    "n-zero": ("chat/completions", {"model": MODEL, "messages": user("Hi"), "n": 0}, 400, "n"),
    "top-p-over-1": ("completions", {"model": MODEL, "prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    "prompt-over-context": ("completions", {"model": MODEL, "prompt": LONG_PROMPT}, 400, "prompt"),
    "chat-over-context": ("chat/completions", {"model": MODEL, "messages": user(LONG_PROMPT)}, 400, "messages"),
    "no-messages": ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    "unknown-field": ("chat/completions", {"model": MODEL, "messages": user("Hi"), "temprature": 0}, 400, "temprature"),
    "top-logprobs-alone": ("chat/completions", {"model": MODEL, "messages": user("Hi"), "top_logprobs": 2}, 400,
                           "top_logprobs"),
    "max-tokens-zero": ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    "bad-engine-extra": ("completions", {"model": MODEL, "prompt": "Hi", "top_k": -3}, 400, "top_k"),
    "priority-under-fcfs": ("completions", {"model": MODEL, "prompt": "Hi", "priority": 2}, 400, "priority"),
    "cache-salt-not-string": ("chat/completions", {"model": MODEL, "messages": user("Hi"), "cache_salt": 7}, 400,
                              "cache_salt"),
    "invalid-json-schema": ("chat/completions", {"model": MODEL, "messages": user("Hi"), "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, 400, "response_format"),
    "invalid-regex": ("completions", {"model": MODEL, "prompt": "Hi", "structured_outputs": {"regex": "a(b"}}, 400,
                      "structured_outputs"),
    "unsupported-schema-feature": ("chat/completions", {"model": MODEL, "messages": user("Hi"), "tool_choice": "required",
                                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                       "type": "object", "patternProperties": {"^x": {}}}}}]}, 400, "tools"),
    "unknown-tool": ("chat/completions", {"model": MODEL, "messages": user("Hi"), "tools": [WEATHER],
                                          "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
                     "tool_choice"),
    "logit-bias-range": ("completions", {"model": MODEL, "prompt": "Hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
}


@pytest.mark.parametrize("route,body,status,param", BAD.values(), ids=BAD.keys())
def test_bad_input_gets_an_openai_error_and_the_next_request_succeeds(server, client, route, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(f"{server}/v1/{route}", content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(f"{server}/v1/{route}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param is None or param in err["message"], err["message"]
    ok = client.chat.completions.create(model=MODEL, messages=user("Hi!"), temperature=0, max_tokens=2)
    assert ok.choices[0].message.content


def test_the_openai_client_raises_its_own_error_types(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=user("Hi"))
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)


# ---- the native API, health and metrics -------------------------------------------------------------------
def test_native_generate_streams_the_greedy_chat_text(server, offline):
    ref = chat_ref(offline, user(CHAT_PROMPTS[4]), greedy(16))
    body = {"prompt": CHAT_PROMPTS[4], "max_tokens": 16}
    with httpx.stream("POST", f"{server}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        pieces = list(r.iter_text())
    assert "".join(pieces) == ref.outputs[0].text
    bad = httpx.post(f"{server}/generate", json={"prompt": "Hi", "temperature": -1}, timeout=30)
    assert bad.status_code == 400 and "temperature" in bad.text


def test_health_endpoints_and_every_engine_metric_in_metrics(server, client):
    for path in ("/healthz", "/livez", "/readyz"):
        assert httpx.get(server + path, timeout=10).status_code == 200
    tpot = "pagedcore:time_per_output_token_seconds_count"
    before = wait_kv_free(server)
    client.chat.completions.create(model=MODEL, messages=user("Hi!"), temperature=0, max_tokens=4)
    wait_for_metrics(server, lambda m: m[tpot] > before[tpot])
    m = wait_kv_free(server)
    for spec in METRICS:  # the same names as the Triton door (tests/test_triton_server.py)
        if spec.kind == "histogram":
            assert m[f'{spec.name}_bucket{{le="+Inf"}}'] == m[f"{spec.name}_count"] > 0, spec.name
            assert m[f"{spec.name}_sum"] > 0, spec.name
        else:
            assert spec.name in m, f"{spec.name} missing from /metrics"
    assert m["pagedcore:kv_cache_total_blocks"] == SETTINGS["num_kv_blocks"]
    assert m["pagedcore:kv_cache_usage_perc"] == 0 and m["pagedcore:num_requests_waiting"] == 0
    assert m["pagedcore:generation_tokens_total"] > 0 and m["pagedcore:prompt_tokens_total"] > 0


def test_metrics_count_one_request_exactly(server, client):
    before = wait_kv_free(server)
    r = client.chat.completions.create(model=MODEL, messages=user(CHAT_PROMPTS[2]), temperature=0,
                                       max_completion_tokens=12, extra_body={"ignore_eos": True})
    e2e = "pagedcore:e2e_request_latency_seconds"
    after = wait_for_metrics(server, lambda m: m[f"{e2e}_count"] > before[f"{e2e}_count"])
    d = {name: after[name] - before[name] for name in before}
    assert d["pagedcore:prompt_tokens_total"] == r.usage.prompt_tokens
    assert d["pagedcore:generation_tokens_total"] == r.usage.completion_tokens == 12
    ttft, tpot = "pagedcore:time_to_first_token_seconds", "pagedcore:time_per_output_token_seconds"
    assert d[f"{ttft}_count"] == d[f"{tpot}_count"] == d[f"{e2e}_count"] == 1
    assert 0 < d[f"{ttft}_sum"] < d[f"{e2e}_sum"] < 60
    # TPOT x (tokens - 1) is the time from the first token to the last: end to end less TTFT.
    assert d[f"{tpot}_sum"] * 11 == pytest.approx(d[f"{e2e}_sum"] - d[f"{ttft}_sum"], rel=1e-6)
    assert d["pagedcore:num_preemptions_total"] == 0

