"""Two engines in one process, stepping at the same time in two threads, each over its own model,
give each model's own greedy output: the forward state (backend, metadata, KV caches) is per engine."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from conftest import assert_greedy_equal, hf_greedy
from pagedcore import LLM, OutputKind, SamplingParams
from pagedcore.async_engine import AsyncLLMEngine
from pagedcore.llm_engine import LLMEngine

MAX_NEW = 16
ROUNDS = 4
TIMEOUT = 120  # seconds: a hang fails the test instead of the run
# Different block sizes and budgets: if one engine read the other's metadata or caches, the slot
# mappings would not fit (or would silently attend over the wrong tokens).
SETTINGS = {"llama": dict(block_size=8, num_kv_blocks=96), "qwen2": dict(block_size=16, num_kv_blocks=40)}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 33, 12, 26)]


@pytest.fixture(scope="module")
def references(tiny_model_dir, prompts):
    """transformers' greedy output of each tiny model (random weights, so the two models differ)."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for arch in SETTINGS:
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir(arch)), dtype=torch.float32)
        with torch.inference_mode():
            refs[arch] = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    assert [t for t, _ in refs["llama"]] != [t for t, _ in refs["qwen2"]]
    return refs


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)


def assert_outputs_equal(outs, refs) -> None:
    for out, (ref, ref_lps) in zip(outs, refs, strict=True):
        o = out.outputs[0]
        assert_greedy_equal(o.token_ids, o.logprobs, ref, ref_lps)


def run_in_threads(work: dict) -> None:
    """Run each callable in its own thread, started together; re-raise the first failure."""
    barrier = threading.Barrier(len(work))
    errors: dict[str, BaseException] = {}

    def target(name, fn):
        try:
            barrier.wait(TIMEOUT)
            fn()
        except BaseException as e:  # noqa: BLE001 -- reported below, in the test's thread
            errors[name] = e

    threads = [threading.Thread(target=target, args=item, name=f"engine-{item[0]}") for item in work.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "an engine thread hung"
    for name, e in errors.items():
        raise AssertionError(f"engine {name} failed: {type(e).__name__}: {e}") from e


def test_two_engines_in_two_threads_each_give_their_own_models_greedy_output(tiny_model_dir, prompts, references):
    llms = {arch: LLM(str(tiny_model_dir(arch)), dtype="float32", **s) for arch, s in SETTINGS.items()}

    def rounds(arch):
        def fn():
            for _ in range(ROUNDS):
                assert_outputs_equal(llms[arch].generate(prompts, greedy(), use_tqdm=False), references[arch])
        return fn

    run_in_threads({arch: rounds(arch) for arch in llms})
    for llm in llms.values():
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks, "blocks leaked"


def test_two_async_engines_stream_their_own_models_output(tiny_model_dir, prompts, references):
    engines = {arch: AsyncLLMEngine(LLMEngine(model=str(tiny_model_dir(arch)), dtype="float32", **s))
               for arch, s in SETTINGS.items()}

    async def one(arch, i, prompt):
        outs = [out async for out in engines[arch].generate(prompt, greedy(), request_id=f"{arch}-{i}",
                                                            output_kind=OutputKind.FINAL_ONLY)]
        return outs[-1]

    async def both():
        for r in range(ROUNDS):
            jobs = [one(arch, f"{r}-{i}", p) for arch in engines for i, p in enumerate(prompts)]
            outs = await asyncio.wait_for(asyncio.gather(*jobs), TIMEOUT)
            for k, arch in enumerate(engines):
                assert_outputs_equal(outs[k * len(prompts):(k + 1) * len(prompts)], references[arch])

    try:
        asyncio.run(both())
    finally:
        for engine in engines.values():
            engine.shutdown()
