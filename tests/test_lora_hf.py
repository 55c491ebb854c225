"""The HF drop-in on a PEFT-wrapped model: `patch(peft_model)` runs PEFT's own LoRA layers (the active
adapter) inside the engine; generate() equals PEFT's unpatched generate() token for token, also after
`set_adapter` switches adapters (the prefix cache is keyed by the active adapter, so the switch never
reuses KV computed under the other one), and unpatch gives the PeftModel back."""

from __future__ import annotations

import pytest
import torch

from lora_adapters import ATTENTION, MLP, make_peft_adapter
from pagedcore.adapters.hf import get_engine, patched

MAX_NEW = 10


@pytest.fixture(scope="module")
def peft_llama(tiny_model_dir, tmp_path_factory):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir, d = tiny_model_dir("llama"), tmp_path_factory.mktemp("lora-hf")
    a = make_peft_adapter(base_dir, d / "a", seed=1, r=8, target_modules=ATTENTION, lora_alpha=16, std=0.2)
    b = make_peft_adapter(base_dir, d / "b", seed=2, r=4, target_modules=MLP, lora_alpha=8, std=0.2)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(a), adapter_name="a").eval()
    model.load_adapter(str(b), adapter_name="b")
    return model


def generate(model, ids):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                          pad_token_id=2)


def test_patched_peft_model_equals_peft_per_adapter(peft_llama):
    ids = torch.tensor([[1, 3308, 314, 260, 3575, 282, 504, 2722, 31, 1120, 42, 17, 9, 77, 88, 99, 5]])
    refs = {}
    for name in ("a", "b"):
        peft_llama.set_adapter(name)
        refs[name] = generate(peft_llama, ids)
    with peft_llama.disable_adapter():
        refs[None] = generate(peft_llama, ids)
    assert not torch.equal(refs["a"], refs["b"]) and not torch.equal(refs["a"], refs[None])
    with patched(peft_llama, num_kv_blocks=64, block_size=4, enable_prefix_caching=True) as model:
        for name in ("a", "b", "a"):
            model.set_adapter(name)
            assert torch.equal(generate(model, ids), refs[name]), name
            assert get_engine(model) is not None  # it ran through the engine
        with model.disable_adapter():
            assert torch.equal(generate(model, ids), refs[None])
        engine = get_engine(model)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    peft_llama.set_adapter("b")
    assert torch.equal(generate(peft_llama, ids), refs["b"])  # unpatched: PEFT's own generate again
