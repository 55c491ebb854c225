"""LoRA through the Triton door: adapters named in the model's settings (`lora_modules`), a request
picks one with the `lora_name` input (as Triton's vLLM backend), an unknown one is INVALID_ARG naming
it. The real tritonserver on a tiny random Llama; texts equal the offline engine's per adapter."""

from __future__ import annotations

import json

import pytest
import requests

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("pytriton")

from lora_adapters import door_adapters, offline_texts  # noqa: E402
from pagedcore import SamplingParams  # noqa: E402
from pagedcore.adapters.triton_launcher import TritonServer  # noqa: E402
from pagedcore.bench.serve import free_ports  # noqa: E402

SETTINGS = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, num_threads=1, enable_lora=True,
                max_loras=1, max_lora_rank=8)
PROMPT = "The capital of France is"
PARAMS = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return door_adapters(tiny_model_dir("llama"), tmp_path_factory.mktemp("lora-triton"))


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters, tmp_path_factory):
    http, grpc, metrics = free_ports(3)
    settings = {**SETTINGS, "model": str(tiny_model_dir("llama")),
                "lora_modules": {name: str(path) for name, path in adapters.items()}}
    s = TritonServer(http_port=http, grpc_port=grpc, metrics_port=metrics, engine_settings=settings,
                     log_path=tmp_path_factory.mktemp("triton-lora") / "tritonserver.log")
    s.start()
    try:
        try:
            s.wait_ready(timeout=150)
        except (RuntimeError, TimeoutError) as e:
            pytest.fail(f"{e}\n--- tritonserver log (tail) ---\n{s.log_path.read_text(errors='replace')[-4000:]}")
        yield s
    finally:
        s.stop(timeout=30)


@pytest.fixture(scope="module")
def offline(tiny_model_dir, adapters):
    return offline_texts(tiny_model_dir("llama"), SETTINGS, adapters, PROMPT, SamplingParams(**PARAMS))


def generate(server, lora_name: str | None) -> requests.Response:
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps(PARAMS), "exclude_input_in_output": True}
    if lora_name is not None:
        body["lora_name"] = lora_name
    return requests.post(f"http://{server.http_url}/v2/models/pagedcore/generate", json=body, timeout=120)


def test_lora_name_selects_the_adapter_and_unknown_is_invalid_arg(server, offline):
    assert len(set(offline.values())) == 3  # the adapters change the text: the checks below can fail
    for name in (None, "a", "b", "a"):
        r = generate(server, name)
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == offline[name], name
    r = generate(server, "nope")
    assert r.status_code == 400
    assert "lora_name: unknown LoRA adapter 'nope' (loaded adapters: 'a', 'b')" in r.json()["error"]
