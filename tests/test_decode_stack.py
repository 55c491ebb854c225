"""The decoder stack as one C++ call at decode (pagedcore/decode_stack.py) against the layer-by-layer path:
the same kernels in the same split of work, so tokens and logprobs must be equal, not merely close."""

from __future__ import annotations

import pytest
import torch

from pagedcore import LLMEngine, SamplingParams, onednn_linear
from pagedcore.decode_stack import DecodeStack

PROMPTS = [list(range(100 + 3 * i, 121 + 11 * i)) for i in range(6)]  # 21..76 tokens: several blocks
GREEDY = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)


@pytest.fixture(autouse=True)
def panels_only(monkeypatch):
    """The stack against the same panels layer by layer, at every batch size: oneDNN and the VNNI pairs (AMX
    CPUs) off, which the tests below force on any CPU."""
    from pagedcore import onednn_linear, vnni_layout

    monkeypatch.setattr(onednn_linear, "ROWS", None)
    monkeypatch.setattr(vnni_layout, "SETTING", "off")


@pytest.fixture
def stack_steps(monkeypatch):
    """One entry per step the stack was asked to run: whether it returned logits."""
    calls = []
    original = DecodeStack.__call__

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(DecodeStack, "__call__", counted)
    return calls


def _run(model_dir, prompts=PROMPTS, params=GREEDY, before=None, **settings):
    """Each request's outputs as (token ids, logprobs per token); the engine after all finished. `before(engine)`
    runs before the requests are added."""
    settings.setdefault("max_num_seqs", 8)
    engine = LLMEngine(model=str(model_dir), **settings)
    if before is not None:
        before(engine)
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.logprobs and [{t: lp.logprob for t, lp in s.items()}
                                                                      for s in c.logprobs]) for c in out.outputs]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    return engine, [done[i] for i in ids]


def _compare(model_dir, stack_steps, params=GREEDY, prompts=PROMPTS, **settings):
    on, got = _run(model_dir, prompts, params, decode_stack=True, **settings)
    assert on.runner.decode_stack is not None
    ran = sum(stack_steps)
    assert ran >= params.max_tokens - 1, f"the stack ran {ran} steps"
    off, want = _run(model_dir, prompts, params, decode_stack=False, **settings)
    assert off.runner.decode_stack is None
    assert got == want
    return got


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # mistral: sliding window 24; qwen2: q/k/v bias
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_tokens_and_logprobs_equal_layered(tiny_model_dir, stack_steps, arch, dtype):
    _compare(tiny_model_dir(arch), stack_steps, dtype=dtype)


@pytest.mark.skipif(not onednn_linear.available(), reason="oneDNN packs no bf16 weights on this CPU")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stack_over_onednn_equals_layered(tiny_model_dir, stack_steps, monkeypatch, arch):
    """From onednn_linear.ROWS rows (AMX CPUs; forced here on any CPU) the stack runs every linear through oneDNN
    between its parallel regions, the layers through the same oneDNN weights: equal bit for bit."""
    from pagedcore import onednn_linear

    monkeypatch.setattr(onednn_linear, "ROWS", 3)
    got = _compare(tiny_model_dir(arch), stack_steps, dtype="bfloat16")
    assert len(got) == len(PROMPTS)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stack_over_vnni_equals_layered(tiny_model_dir, stack_steps, monkeypatch, arch):
    """bf16 weights in VNNI pairs (AMX CPUs; forced here: CPUs without AMX run the scalar loop): the stack runs
    the same kernel on its threads as the layers' op does, every panel whole on one thread: equal bit for bit,
    prefill and batches 1-5."""
    from pagedcore import vnni_layout

    monkeypatch.setattr(vnni_layout, "SETTING", "on")
    engine, _ = _run(tiny_model_dir(arch), PROMPTS[:1], dtype="bfloat16", decode_stack=True)
    assert all(vnni_layout.is_packed(m._pagedcore_packed) for m in engine.model.modules()
               if hasattr(m, "_pagedcore_packed") and m.in_features % 32 == 0)
    got = _compare(tiny_model_dir(arch), stack_steps, dtype="bfloat16")
    assert len(got) == len(PROMPTS)


def test_stack_int4_equals_layered(tiny_model_dir, stack_steps):
    _compare(tiny_model_dir("llama"), stack_steps, dtype="bfloat16", quantization="int4")


@pytest.mark.parametrize("threads", [1, 2])
def test_stack_long_context_split_attention(tiny_model_dir, stack_steps, threads):
    """Contexts of 300+ tokens: with 2 threads a sequence's positions split between them (flash-decoding)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prompts = [list(range(100, 420)), list(range(200, 230))]
        _compare(tiny_model_dir("llama"), stack_steps, prompts=prompts, dtype="float32")
    finally:
        torch.set_num_threads(saved)


def test_stack_with_preemption_prefix_hits_and_n(tiny_model_dir, stack_steps):
    """A pool of 12 blocks forces preemption; shared prompt prefixes hit the cache; n=2 forks share blocks."""
    prefix = list(range(300, 340))
    prompts = [prefix + list(range(500 + 10 * i, 510 + 10 * i)) for i in range(4)]
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, logprobs=1, ignore_eos=True)
    _compare(tiny_model_dir("llama"), stack_steps, params=params, prompts=prompts, num_kv_blocks=12)


def test_stack_matches_transformers_greedy(tiny_model_dir, stack_steps):
    from transformers import AutoModelForCausalLM

    from tests.conftest import hf_greedy

    model_dir = tiny_model_dir("llama")
    engine, got = _run(model_dir, PROMPTS[:2], decode_stack=True, dtype="float32")
    assert any(stack_steps)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, [(tokens, _)] in zip(PROMPTS[:2], got):
        want, _ = hf_greedy(hf, prompt, GREEDY.max_tokens)
        assert tokens == want


def test_stack_steps_aside_for_a_replaced_projection(tiny_model_dir, stack_steps):
    """A module replaced after the engine started (a plugin, an adapter) wins: the step goes layer by layer."""
    engine = LLMEngine(model=str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4)
    layer = engine.model.model.layers[1]
    original = layer.mlp.down_proj
    calls = []

    class Counted(torch.nn.Module):
        def forward(self, x):
            calls.append(x.shape)
            return original(x)

    layer.mlp.down_proj = Counted()
    engine.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(calls) == 4 and not stack_steps  # prefill + 3 decode steps, none through the stack


def test_stack_steps_aside_for_a_replaced_forward(tiny_model_dir, stack_steps):
    """A forward set on a module instance (as hooks-by-assignment and some adapters do) wins too: the step goes
    through the layer's own forward, which calls it."""
    engine = LLMEngine(model=str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4)
    attn = engine.model.model.layers[0].self_attn
    original, calls = attn.forward, []
    attn.forward = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    engine.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(calls) == 4 and not stack_steps  # the lean layers' forward runs it too (lean_layers._own)
    del attn.forward  # back to the class's forward: the stack runs again
    engine.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(calls) == 4 and any(stack_steps)


def test_stack_off_where_it_cannot_run(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))
    assert LLMEngine(model=model_dir, kv_cache_dtype="int8", max_num_seqs=2).runner.decode_stack is None
    assert LLMEngine(model=model_dir, pack_weights=False, max_num_seqs=2).runner.decode_stack is None
    assert LLMEngine(model=model_dir, enable_lora=True, max_num_seqs=2).runner.decode_stack is None
    assert LLMEngine(model=str(tiny_model_dir("phi3")), max_num_seqs=2).runner.decode_stack is None


def test_objects_in_place_agrees_with_the_python_check(ext, tiny_model_dir):
    """The C++ check the stack runs each step (ext.objects_in_place) says what the same lookups say in Python, over
    the stack's own checks and their edge cases: a missing key stands for None (dict.get), a replaced value or a
    dict that is no longer a plain dict is not in place, and a key whose hash raises raises."""
    import operator

    def _in_place(checks):
        dicts, keys, values = checks
        return all(map(operator.is_, map(dict.get, dicts, keys), values))

    engine = LLMEngine(model=str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=2)
    stack = engine.runner.decode_stack
    assert stack._intact() and stack._checks is not None
    dicts, keys, values = stack._checks
    assert len(dicts) > 40 and ext.objects_in_place(dicts, keys, values) and _in_place(stack._checks)
    layer = engine.model.model.layers[1]
    original = layer.mlp.down_proj
    layer.mlp.down_proj = torch.nn.Identity()
    assert not ext.objects_in_place(dicts, keys, values) and not _in_place(stack._checks)
    layer.mlp.down_proj = original
    assert ext.objects_in_place(dicts, keys, values)
    a, b, marker = {"x": 1}, {}, object()
    for ds, ks, vs, want in [([a], ["x"], [a["x"]], True), ([b], ["forward"], [None], True),
                             ([b], ["forward"], [marker], False), ([a, b] * 40, ["x", "y"] * 40, [a["x"], None] * 40, True),
                             ([a] * 50 + [b], ["x"] * 50 + ["z"], [a["x"]] * 50 + [1], False)]:
        assert ext.objects_in_place(ds, ks, vs) is want is _in_place((ds, ks, vs))
    from collections import OrderedDict
    assert not ext.objects_in_place([OrderedDict(x=1)], ["x"], [1])

    class BadHash:
        def __hash__(self):
            raise ValueError("no hash")

    with pytest.raises(ValueError, match="no hash"):
        ext.objects_in_place([{}], [BadHash()], [None])
    with pytest.raises(RuntimeError, match="one length"):
        ext.objects_in_place([a], ["x", "y"], [1])


def test_stack_rejects_what_it_cannot_run(ext):
    """Layouts it does not take raise a clear error before any thread starts (never a crash inside)."""
    stack = ext.DecodeStack(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=32)
    w = lambda n, k: (ext.pack_linear_weight(torch.randn(n, k)), None, None, n, 0, 0, False)  # noqa: E731
    cache = torch.zeros(4, 16, 1, 16)
    norm = torch.ones(32)
    with pytest.raises(RuntimeError, match="linear shapes"):
        stack.add_layer(norm, 1e-6, norm, 1e-6, 0.25, 0, cache, cache.clone(), w(48, 32), w(32, 32), w(32, 32),
                        w(32, 32))
    stack.add_layer(norm, 1e-6, norm, 1e-6, 0.25, 0, cache, cache.clone(), w(64, 32), w(32, 32), w(64, 32), w(32, 32))
    hidden, cs = torch.randn(1, 32), torch.ones(1, 16)
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        stack.forward(hidden, cs, cs, torch.tensor([64]), torch.tensor([0]), table, lens, 0, 0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        stack.forward(hidden.double(), cs, cs, torch.tensor([0]), torch.tensor([0]), table, lens, 0, 0)
    with pytest.raises(RuntimeError, match="without oneDNN weights"):  # oneDNN from 1 row, none added
        stack.forward(hidden, cs, cs, torch.tensor([0]), torch.tensor([0]), table, lens, 0, 1)
    with pytest.raises(RuntimeError, match="oneDNN's layout"):
        stack.add_onednn(0, tuple((torch.randn(32, 32), None) for _ in range(4)))
    out = stack.forward(hidden, cs, cs, torch.tensor([0]), torch.tensor([0]), table, lens, 0, 0)
    assert out.shape == (1, 32) and torch.isfinite(out).all()


def test_stack_rope_table_and_positions_past_it(tiny_model_dir, stack_steps, monkeypatch):
    """cos/sin come from a table made once by the model's rotary module; positions past it are computed."""
    from pagedcore import decode_stack

    monkeypatch.setattr(decode_stack, "ROPE_TABLE_MAX", 40)  # the prompts cross it while decoding
    _compare(tiny_model_dir("llama"), stack_steps, dtype="bfloat16")


def test_stack_phase_timers_change_nothing_and_count_its_steps(tiny_model_dir, stack_steps):
    """`bench step` turns the stack's phase timers on: same tokens and logprobs, every stack step timed."""
    _, want = _run(tiny_model_dir("llama"), decode_stack=True)
    plain_steps = len(stack_steps)
    engine, got = _run(tiny_model_dir("llama"), decode_stack=True,
                       before=lambda e: e.runner.decode_stack.stack.set_profiling(True))
    assert got == want
    stack = engine.runner.decode_stack.stack
    gemm, attention, other, steps = stack.take_profile()
    assert steps == sum(stack_steps[plain_steps:]) > 0
    assert gemm > 0 and attention > 0 and other > 0
    assert stack.take_profile() == (0.0, 0.0, 0.0, 0)  # taken: reset


@pytest.fixture
def io_steps(monkeypatch):
    """One entry per stack forward: whether it ran through forward_ids (embedding, RoPE and final norm inside); a
    multi-step decode's further forwards (decode_again) run only there."""
    calls = []
    original, again = DecodeStack._io_intact, DecodeStack.decode_again

    def counted(self):
        ok = original(self)
        calls.append(ok)
        return ok

    def counted_again(self, *args):
        out = again(self, *args)
        if out is not None:
            calls.append(True)
        return out

    monkeypatch.setattr(DecodeStack, "_io_intact", counted)
    monkeypatch.setattr(DecodeStack, "decode_again", counted_again)
    return calls


def _tied_llama(tmp_path, smollm2_tokenizer):
    from test_int4_tied_embedding import tied_llama_dir

    return tied_llama_dir(tmp_path, smollm2_tokenizer)


@pytest.mark.parametrize("case", ["fp32", "bf16", "bf16-vnni-tied"])
def test_stack_ids_path_equals_the_modules_path(tiny_model_dir, tmp_path, smollm2_tokenizer, stack_steps, io_steps,
                                                monkeypatch, case):
    """forward_ids (the embedding rows, RoPE table rows and final norm looked up and applied in the stack's call)
    gives what the modules give around forward: equal tokens and logprobs, with the greedy head (the tied case: its
    rows are the embedding's table) and without."""
    from pagedcore import vnni_layout

    if case == "bf16-vnni-tied":
        monkeypatch.setattr(vnni_layout, "SETTING", "on")
        model_dir = _tied_llama(tmp_path, smollm2_tokenizer)
    else:
        model_dir = tiny_model_dir("llama")
    dtype = "float32" if case == "fp32" else "bfloat16"
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    set_io = DecodeStack._set_io
    for params in (GREEDY, greedy):  # logprobs: the lm_head's logits; none: the greedy head where it runs
        io_steps.clear()
        engine, got = _run(model_dir, params=params, dtype=dtype, decode_stack=True)
        assert engine.runner.decode_stack._io_checks is not None and sum(io_steps) >= params.max_tokens - 1
        if case == "bf16-vnni-tied" and params is greedy:
            assert engine.runner.decode_stack.greedy_head.rows > 0  # its rows served the embedding too
        monkeypatch.setattr(DecodeStack, "_set_io", lambda self: None)
        io_steps.clear()
        _, want = _run(model_dir, params=params, dtype=dtype, decode_stack=True)
        assert not io_steps and got == want
        monkeypatch.setattr(DecodeStack, "_set_io", set_io)


def test_stack_ids_path_steps_aside_for_a_replaced_norm_weight_or_module(tiny_model_dir, stack_steps, io_steps):
    """A final norm weight re-pointed after the engine started: the modules' path (still the stack); the embedding
    module replaced: the layers (the stack stands in for it no more). Tokens as without the stack either way."""
    model_dir = tiny_model_dir("llama")
    _, want = _run(model_dir, decode_stack=False, dtype="float32")

    def new_norm_weight(engine):
        norm = engine.model.model.norm
        norm.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)

    _, got = _run(model_dir, decode_stack=True, dtype="float32", before=new_norm_weight)
    assert got == want and any(stack_steps) and io_steps and not any(io_steps)
    stack_steps.clear()

    def new_embedding(engine):
        old = engine.model.model.embed_tokens
        new = torch.nn.Embedding(*old.weight.shape, dtype=old.weight.dtype)
        new.weight.data.copy_(old.weight)
        engine.model.model.embed_tokens = new

    _, got = _run(model_dir, decode_stack=True, dtype="float32", before=new_embedding)
    assert got == want and not stack_steps


def test_stack_ids_path_rejects_bad_ids(ext):
    """An id past the vocabulary or a position past the RoPE table: a clear error before any thread starts."""
    stack = ext.DecodeStack(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=32)
    w = lambda n, k: (ext.pack_linear_weight(torch.randn(n, k)), None, None, n, 0, 0, False)  # noqa: E731
    cache = torch.zeros(4, 16, 1, 16)
    norm = torch.ones(32)
    stack.add_layer(norm, 1e-6, norm, 1e-6, 0.25, 0, cache, cache.clone(), w(64, 32), w(32, 32), w(64, 32), w(32, 32))
    with pytest.raises(RuntimeError, match="set_io first"):
        stack.forward_ids(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.tensor([0]),
                          torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0, 0)
    emb, cos = torch.randn(10, 32), torch.ones(8, 16)
    stack.set_io(emb, cos, cos.clone(), norm, 1e-6)
    args = (torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            0, 0)
    with pytest.raises(RuntimeError, match="token id 10 out of range"):
        stack.forward_ids(torch.tensor([10]), torch.tensor([0]), *args)
    with pytest.raises(RuntimeError, match="position 8 past the RoPE table"):
        stack.forward_ids(torch.tensor([3]), torch.tensor([8]), *args)
    out = stack.forward_ids(torch.tensor([3]), torch.tensor([0]), *args)
    ref = ext.rms_norm(stack.forward(emb[3:4].clone(), cos[:1], cos[:1], *args), norm, 1e-6)
    assert torch.equal(out, ref)
