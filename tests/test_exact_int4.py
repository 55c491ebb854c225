"""fp32 weights on a 4-bit grid (kernels/csrc/cpu_exact_int4.cpp): the decode stack keeps their int4 form beside the
fp32 panels and widens it back at decode rows. Found only where every value is fma(q, d, m) per group of 32 (q in
0..15, d and m fp16, GGUF Q4_1's grid); results bit for bit those of the fp32 panels."""

from __future__ import annotations

import pytest
import torch

from pagedcore import LLMEngine, SamplingParams
from pagedcore.kernels import cpu_ext

ext = cpu_ext.load()
pytestmark = pytest.mark.skipif(ext is None or not hasattr(ext, "exact_int4_panels")
                                or ext.exact_int4_panels(torch.zeros(1, 32, 16), 32)[0] is None,
                                reason="exact int4 forms need the C++ ops on an AVX-512 CPU")


def on_grid(n: int, k: int, seed: int = 0, group: int = 32) -> torch.Tensor:
    """[n, k] fp32 values q * d + m per group (the product is exact in fp32: one rounding, as fma's), each group
    with its min at q = 0 and its max at q = 15, as Q4_1's quantizer places them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g).float()
    q.view(n, k // group, group)[:, :, 3], q.view(n, k // group, group)[:, :, 20] = 0.0, 15.0
    d = (torch.rand(n, k // group, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // group, 1, generator=g) * 0.15).half().float()
    return (q.view(n, k // group, group) * d + m).view(n, k)


def test_a_grid_is_found_and_values_off_it_are_not():
    w = on_grid(100, 192)
    q, sm = ext.exact_int4_panels(ext.pack_linear_weight(w), 32)
    assert q is not None and q.shape == (7, 48, 16) and sm.shape == (7, 6, 2, 16) and sm.dtype == torch.float16
    for bad in (torch.nextafter(w[37, 50], torch.tensor(1.0)), float("nan"), float("inf")):
        off = w.clone()
        off[37, 50] = bad
        assert ext.exact_int4_panels(ext.pack_linear_weight(off), 32)[0] is None
    assert ext.exact_int4_panels(ext.pack_linear_weight(torch.randn(64, 64)), 32)[0] is None
    assert ext.exact_int4_panels(ext.pack_linear_weight(w[:, :100]), 32)[0] is None  # K not a multiple of 32


def _snap(model: torch.nn.Module) -> None:
    """Every linear of the layers onto a 4-bit grid (as a GGUF Q4_1 checkpoint's de-quantized weights are)."""
    for i, layer in enumerate(model.model.layers):
        for lin in (*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                    *(getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))):
            n, k = lin.weight.shape
            lin.weight.data.copy_(on_grid(n, k, seed=1000 * i + n + k))


@pytest.fixture(scope="module")
def grid_model_dir(tmp_path_factory, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    _snap(model)
    d = tmp_path_factory.mktemp("tiny-llama-q4grid")
    model.save_pretrained(d)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model_dir("llama")).save_pretrained(d)
    return d


PROMPTS = [list(range(100 + 7 * i, 121 + 13 * i)) for i in range(40)]


def _run(engine: LLMEngine, params: SamplingParams, prompts=PROMPTS) -> list:
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    return [(done[i].token_ids, [[(t, lp.logprob) for t, lp in sorted(s.items())] for s in done[i].logprobs])
            for i in ids]


# Decode rows up to 12 widen each weight per 6-row tile, 13-36 per tall tile of 12-24 rows (one or two tiles),
# more into a buffer once; the prompts finish prefill over several steps, so the runs see many row counts.
@pytest.mark.parametrize("batch", [40, 30, 16, 9, 3])
def test_decode_steps_are_bit_for_bit_the_fp32_panels(grid_model_dir, batch):
    """Sequences decoding 16 tokens with their top-5 logprobs: the same floats with the int4 form as without."""
    # No prefix cache: both runs then schedule the same steps (a step's split of a long sequence's attention
    # depends on the step's other sequences, and moves logprobs by ulps).
    engine = LLMEngine(model=str(grid_model_dir), dtype="float32", max_num_seqs=40, num_kv_blocks=1024,
                       enable_prefix_caching=False)
    stack = engine.runner.decode_stack
    if stack is None:
        pytest.skip("no decode stack here")
    assert stack.stack.exact_int4_linears == 4 * stack.stack.num_layers  # qkv, o, gate_up, down per layer
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    stack.stack.set_exact_int4_rows(64)  # every decode step of the run
    with_form = _run(engine, params, PROMPTS[:batch])
    stack.stack.set_exact_int4_rows(0)
    without = _run(engine, params, PROMPTS[:batch])
    assert with_form == without
    assert all(len(t) == 16 for t, _ in with_form)


def test_random_weights_have_no_int4_form(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4, num_kv_blocks=64)
    if engine.runner.decode_stack is None:
        pytest.skip("no decode stack here")
    assert engine.runner.decode_stack.stack.exact_int4_linears == 0


def test_the_bundled_gguf_model_is_on_the_grid(smollm2_dir):
    """SmolLM2's linears are Q4_1 in the GGUF: every one found; greedy tokens as without the form."""
    engine = LLMEngine(model=str(smollm2_dir), dtype="float32", max_num_seqs=8, num_kv_blocks=128)
    stack = engine.runner.decode_stack
    if stack is None:
        pytest.skip("no decode stack here")
    assert stack.stack.exact_int4_linears == 4 * 30
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    stack.stack.set_exact_int4_rows(64)
    got = _run(engine, params)
    stack.stack.set_exact_int4_rows(0)
    assert got == _run(engine, params)
