"""LoRA through the BentoML door with the official `openai` client: `model` picks the base model or an
adapter, /v1/models lists them, adapters load at start (settings) and at run time (load/unload
routes, opt-in), an unknown adapter is a 404 naming it. One `bentoml serve` on a tiny random Llama;
each adapter's text equals the offline engine's under the same adapter (itself checked against
PEFT in test_lora.py)."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("bentoml")

from lora_adapters import door_adapters, offline_texts  # noqa: E402
from servers import bentoml_serve, stop, wait_ready  # noqa: E402
from pagedcore import SamplingParams  # noqa: E402

SETTINGS = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, num_threads=1, enable_lora=True,
                max_loras=2, max_lora_rank=8)
PROMPT = "The capital of France is"
MAX_TOKENS = 8
STARTUP_TIMEOUT = 180


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return door_adapters(tiny_model_dir("llama"), tmp_path_factory.mktemp("lora-openai"))


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters, tmp_path_factory):
    base = tiny_model_dir("llama")
    env = {**SETTINGS, "model": str(base), "lora_modules": json.dumps({"a": str(adapters["a"])}),
           "allow_runtime_lora_updating": "true", "served_model_name": "tiny"}
    s = bentoml_serve(tmp_path_factory.mktemp("bentoml-lora"), env)
    try:
        wait_ready(s, STARTUP_TIMEOUT)
        yield s.url
    finally:
        stop(s.process)


@pytest.fixture(scope="module")
def offline(tiny_model_dir, adapters):
    """Greedy texts per adapter from the offline engine, same settings."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return offline_texts(tiny_model_dir("llama"), SETTINGS, adapters, PROMPT, params)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def complete(client, model: str, stream: bool = False) -> str:
    kw = dict(model=model, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    out = client.completions.create(**kw)
    assert out.model == model
    return out.choices[0].text


def test_model_field_selects_the_adapter_and_models_lists_them(client, server, adapters, offline):
    assert len(set(offline.values())) == 3  # the adapters change the text: the checks below can fail
    assert [m.id for m in client.models.list().data] == ["tiny", "a"]
    assert complete(client, "tiny") == offline[None]
    assert complete(client, "a") == offline["a"]
    assert complete(client, "a", stream=True) == offline["a"]
    with pytest.raises(openai.NotFoundError, match="The model `b` does not exist. Available: tiny, a"):
        complete(client, "b")

    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
    assert complete(client, "b") == offline["b"]
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_tokens=4)
    assert chat.model == "b" and chat.choices[0].message.content is not None

    r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError, match="`b`"):
        complete(client, "b")
    assert complete(client, "a") == offline["a"]  # the other adapter is untouched


def test_bad_adapter_loads_are_clear_errors(server, tmp_path):
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}, timeout=60)
    assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "never"}, timeout=60)
    assert r.status_code == 404 and "'never'" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_runtime_loading_is_off_unless_allowed(tiny_model_dir, adapters):
    import asyncio

    from pagedcore.adapters.openai_api import OpenAIError, OpenAIServing
    from pagedcore.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_settings(model=str(tiny_model_dir("llama")), **SETTINGS)
    try:
        serving = OpenAIServing(engine, "tiny")
        with pytest.raises(OpenAIError, match="PAGEDCORE_ALLOW_RUNTIME_LORA_UPDATING") as e:
            asyncio.run(serving.load_lora_adapter({"lora_name": "a", "lora_path": str(adapters["a"])}))
        assert e.value.status == 403 and engine.list_loras() == []
        serving.allow_lora_updates = True
        asyncio.run(serving.load_lora_adapter({"lora_name": "a", "lora_path": str(adapters["a"])}))
        assert [m["id"] for m in serving.models()["data"]] == ["tiny", "a"]
        assert serving.models()["data"][1]["parent"] == "tiny"
    finally:
        engine.shutdown(0)
