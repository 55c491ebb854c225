"""Multi-LoRA serving on a tiny random Llama (fast; the bundled model's version is in
test_lora_smollm2.py): greedy output per adapter equals PEFT's own model token for token, mixed
batches equal separate runs, the prefix cache never crosses adapters, adapters beyond max_loras wait
and swap in, bad adapters fail at load with a clear error."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_greedy_equal
from lora_adapters import ATTENTION, MLP, lora_requests, make_peft_adapter, peft_references
from pagedcore import LLM, SamplingParams
from pagedcore.lora import LoRARequest, UnknownLoRAError
from pagedcore.lora.peft_adapter import LoRALoadError

MAX_NEW = 12
PROMPTS = [[1, 3308, 314, 260, 3575, 282], [1, 504, 2722, 31, 1120, 42, 17, 9], [1, 77, 88, 99]]


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    return {
        # attention only, rank 8, alpha / r
        "a": make_peft_adapter(base_dir, d / "a", seed=1, r=8, target_modules=ATTENTION, lora_alpha=16, std=0.2),
        # MLP and q, rank 4, rsLoRA's alpha / sqrt(r)
        "b": make_peft_adapter(base_dir, d / "b", seed=2, r=4, target_modules=MLP + ["q_proj"], lora_alpha=8,
                               use_rslora=True, std=0.2),
        # every projection, rank 2
        "c": make_peft_adapter(base_dir, d / "c", seed=3, r=2, target_modules=ATTENTION + MLP, lora_alpha=4, std=0.3),
    }


@pytest.fixture(scope="module")
def references(base_dir, adapters):
    return peft_references(base_dir, adapters, PROMPTS, MAX_NEW)


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=20)


def make_llm(base_dir, **settings):
    return LLM(str(base_dir), dtype="float32", enable_lora=True, num_kv_blocks=64, block_size=4, **settings)


def check(out, ref):
    tokens, logprobs = ref
    c = out.outputs[0]
    assert_greedy_equal(c.token_ids, c.logprobs, tokens, logprobs)


def test_adapters_change_the_output(references):
    """Else the equivalence tests below could pass with adapters ignored."""
    for name in ("a", "b", "c"):
        assert references[name][0][0] != references[None][0][0], name


def test_greedy_per_adapter_equals_peft(base_dir, adapters, references):
    llm = make_llm(base_dir, max_loras=3, max_lora_rank=8)
    reqs = lora_requests(adapters)
    for name in (None, "a", "b", "c"):
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=reqs.get(name))
        for out, ref in zip(outs, references[name]):
            check(out, ref)


def test_mixed_batch_equals_each_run_alone(base_dir, adapters, references):
    """Base, a, b, c interleaved in one batch (every request admitted in the first step)."""
    llm = make_llm(base_dir, max_loras=3, max_lora_rank=8)
    reqs = lora_requests(adapters)
    names = [None, "a", "b", "c"] * len(PROMPTS)
    prompts = [p for p in PROMPTS for _ in range(4)]
    steps = []
    engine = llm.engine
    step = engine.step
    engine.step = lambda: steps.append({s.lora_uid for s in engine.scheduler.running}) or step()
    outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=[reqs.get(n) for n in names])
    for i, (out, name) in enumerate(zip(outs, names)):
        check(out, references[name][i // 4])
    assert any(len(s) == 4 for s in steps[1:]), "the batch never held the base model and three adapters at once"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_more_adapters_than_max_loras_wait_and_swap_in(base_dir, adapters, references):
    llm = make_llm(base_dir, max_loras=1, max_lora_rank=8, max_num_seqs=8)
    reqs = lora_requests(adapters)
    engine = llm.engine
    seen = []
    step = engine.step
    engine.step = lambda: seen.append({s.lora_uid for s in engine.scheduler.running if s.lora}) or step()
    names = ["a", "b", None, "c", "a", "b"]
    outs = llm.generate([PROMPTS[i % 3] for i in range(6)], greedy(), use_tqdm=False,
                        lora_request=[reqs.get(n) for n in names])
    for i, (out, name) in enumerate(zip(outs, names)):
        check(out, references[name][i % 3])
    assert max(len(s) for s in seen) == 1  # never two adapters in one batch
    assert len(set().union(*seen)) == 3  # yet all three ran, swapped through the one slot
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_cache_never_crosses_adapters(base_dir, adapters, references):
    llm = make_llm(base_dir, max_loras=2, max_lora_rank=8, enable_prefix_caching=True)
    reqs = lora_requests(adapters)
    prompt = PROMPTS[1]  # 8 tokens: two full blocks of 4 to reuse
    first = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=reqs["a"])[0]
    again = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=reqs["a"])[0]
    other = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=reqs["b"])[0]
    base = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the cache is on and reused within one adapter
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    for out, name in ((first, "a"), (again, "a"), (other, "b"), (base, None)):
        check(out, references[name][1])


def test_reloaded_adapter_under_the_same_name_reuses_no_kv(base_dir, adapters, references):
    llm = make_llm(base_dir, max_loras=1, max_lora_rank=8, enable_prefix_caching=True)
    prompt = PROMPTS[1]
    llm.generate([prompt], greedy(), use_tqdm=False, lora_request=LoRARequest("x", 1, str(adapters["a"])))
    assert llm.engine.remove_lora("x")
    out = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=LoRARequest("x", 1, str(adapters["b"])))[0]
    assert out.num_cached_tokens == 0
    check(out, references["b"][1])


def test_bad_adapters_fail_at_load_with_clear_errors(base_dir, adapters, tmp_path):
    llm = make_llm(base_dir, max_loras=1, max_lora_rank=4)
    with pytest.raises(LoRALoadError, match="rank 8 .* over max_lora_rank 4"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters["a"])))
    with pytest.raises(UnknownLoRAError, match="unknown LoRA adapter 'nope'"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("nope", 9))
    with pytest.raises(LoRALoadError, match="no adapter_config.json"):
        llm.engine.add_lora(LoRARequest("missing", 2, str(tmp_path)))
    head = make_peft_adapter(base_dir, tmp_path / "head", seed=4, r=2, target_modules=["lm_head"], lora_alpha=2)
    with pytest.raises(LoRALoadError, match="'lm_head' cannot be served; supported are the attention and MLP"):
        llm.engine.add_lora(LoRARequest("head", 3, str(head)))
    assert llm.engine.list_loras() == [] and not llm.engine.has_unfinished_requests()
    plain = LLM(str(base_dir), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="without LoRA .*enable_lora=True"):
        plain.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("b", 1, str(adapters["b"])))


def test_slots_are_reused_least_recently_used_first(base_dir, adapters):
    from transformers import AutoModelForCausalLM

    from pagedcore.lora.manager import LoRAManager

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    manager = LoRAManager(model, max_loras=2, max_rank=8, device=torch.device("cpu"), dtype=torch.float32)
    a, b, c = (manager.add_lora(r) for r in lora_requests(adapters).values())
    cpu = torch.device("cpu")
    manager.prepare([a, None], [3, 1], cpu)
    manager.prepare([b], [1], cpu)
    manager.prepare([a], [1], cpu)  # a is now the most recently used
    mapping = manager.prepare([c, a, None], [2, 1, 1], cpu)  # b's slot goes to c
    assert manager.slot_of == {a.uid: 0, c.uid: 1} or manager.slot_of == {a.uid: 1, c.uid: 0}
    assert mapping.token_slots.tolist() == [manager.slot_of[c.uid]] * 2 + [manager.slot_of[a.uid], -1]
    q = "model.layers.0.self_attn.q_proj"
    slot_c = manager.slot_of[c.uid]
    r = c.weights[q][0].shape[0]
    assert torch.equal(manager.slots[q].a[slot_c, :r], c.weights[q][0])
    assert not manager.slots[q].a[slot_c, r:].any()  # zero past the adapter's rank
    with pytest.raises(RuntimeError, match="over max_loras"):
        manager.prepare([a, b, c], [1, 1, 1], cpu)
