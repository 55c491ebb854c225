"""pagedcore/installs.py: what the engine installs on a tracked model comes off again, all of it,
newest first, leaving the model as it was; an untracked model records nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedcore import fused_norms, installs, lean_layers, packed_linear
from pagedcore.attention import hf_glue
from pagedcore.kernels import cpu_ext
from pagedcore.quantization import Int4Linear, quantize_int4

CPU = torch.device("cpu")


def load(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")), dtype=torch.float32).eval()


def install_everything(model, compile: bool = False) -> None:
    """What LLMEngine and its ModelRunner install, in their order."""
    quantize_int4(model, CPU)
    hf_glue.install(model)
    fused_norms.install(model, CPU)
    lean_layers.install(model, CPU)
    packed_linear.install(model, CPU)
    if compile:  # swaps the eager forwards for its own (compiling waits for the first step)
        from pagedcore.capture import CapturedForward

        CapturedForward(model, CPU, max_num_seqs=4)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "captured"])
def test_restore_undoes_every_install_bit_for_bit(compile, tiny_model_dir):
    model, untouched = load(tiny_model_dir), load(tiny_model_dir)
    own_forward = model.model.norm.forward  # a forward the user set on a module before: it stays
    model.model.norm.forward = own_forward
    attn = model.config._attn_implementation
    installs.track(model)
    install_everything(model, compile)
    assert model.config._attn_implementation != attn
    assert any(isinstance(m, Int4Linear) for m in model.modules())

    assert installs.restore(model) == (5 if cpu_ext.load() is not None else 2)  # without the C++ ops: int4, attention
    assert model.model.norm.__dict__.pop("forward") is own_forward
    assert not [(n, a) for n, m in model.named_modules() for a in vars(m) if a == "forward" or "pagedcore" in a]
    assert [type(m) for m in model.modules()] == [type(m) for m in untouched.modules()]
    assert model.config._attn_implementation == attn
    ids = torch.tensor([[5, 17, 300, 4000, 12]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, untouched(ids).logits)
    assert installs.restore(model) == 0  # nothing left to undo


def test_untracked_model_records_nothing(tiny_model_dir):
    model = load(tiny_model_dir)
    install_everything(model)
    assert installs.restore(model) == 0
    assert any(isinstance(m, Int4Linear) for m in model.modules())  # an engine's own model keeps its installs
