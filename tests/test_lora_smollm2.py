"""Multi-LoRA on the bundled SmolLM2 in fp32 (slow): two random PEFT adapters, greedy output per
adapter equals PeftModel's generate token for token, a mixed batch (base, A, B interleaved) equals
each run alone, and the prefix cache gives the same prompt under each adapter its own output."""

from __future__ import annotations

import pytest

from conftest import assert_greedy_equal
from lora_adapters import ATTENTION, MLP, lora_requests, make_peft_adapter, peft_references
from pagedcore import LLM, SamplingParams

pytestmark = pytest.mark.slow
MAX_NEW = 16
NUM_PROMPTS = 3


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-smollm2")
    return {"a": make_peft_adapter(smollm2_dir, d / "a", seed=1, r=8, target_modules=ATTENTION, lora_alpha=16,
                                   std=0.08),
            "b": make_peft_adapter(smollm2_dir, d / "b", seed=2, r=16, target_modules=ATTENTION + MLP, lora_alpha=16,
                                   use_rslora=True, std=0.05)}


@pytest.fixture(scope="module")
def references(smollm2_dir, adapters, chat_prompt_ids):
    return peft_references(smollm2_dir, adapters, chat_prompt_ids[:NUM_PROMPTS], MAX_NEW)


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=20)  # stops at EOS, as HF does


def check(out, ref):
    c = out.outputs[0]
    assert_greedy_equal(c.token_ids, c.logprobs, *ref)


def test_smollm2_adapters_equal_peft_alone_and_mixed(smollm2_dir, adapters, references, chat_prompt_ids):
    for name in ("a", "b"):
        assert all(references[name][i][0] != references[None][i][0] for i in range(NUM_PROMPTS)), \
            f"adapter {name} does not change every output"
    llm = LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=2, max_lora_rank=16,
              enable_prefix_caching=True)
    reqs = lora_requests(adapters)
    prompts = chat_prompt_ids[:NUM_PROMPTS]
    for name in ("a", "b"):
        for out, ref in zip(llm.generate(prompts, greedy(), use_tqdm=False, lora_request=reqs[name]), references[name]):
            check(out, ref)
    names = [None, "a", "b"] * NUM_PROMPTS
    outs = llm.generate([p for p in prompts for _ in range(3)], greedy(), use_tqdm=False,
                        lora_request=[reqs.get(n) for n in names])
    for i, (out, name) in enumerate(zip(outs, names)):
        check(out, references[name][i // 3])
        # Each adapter ran these prompts before: hits from its own run. The base model never did: a hit
        # there would be KV computed under an adapter.
        assert (out.num_cached_tokens > 0) == (name is not None), (name, out.num_cached_tokens)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
