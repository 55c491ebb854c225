"""GGUF files served with their linears kept quantized (`quantization="gguf"`): tiny llama GGUFs written
here with gguf's own GGUFWriter and quantizers (llama.cpp's q/k row permutation applied as its converter
does), checked layer by layer against gguf's own de-quantization and end to end against the default
path (transformers' GGUF loader, de-quantized); the bundled Q4_1 model in a slow test."""

import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")

from conftest import hf_greedy  # noqa: E402
from pagedcore import LLM, SamplingParams  # noqa: E402
from pagedcore import gguf_native, quantization  # noqa: E402
from pagedcore.model_loader import bundled_gguf_path, load_model_and_tokenizer, resolve_model_dir  # noqa: E402
from pagedcore.quantization import Int4Linear, Int8Linear  # noqa: E402
from quantized_models import tiny_llama  # noqa: E402
from test_quantization import common_prefix  # noqa: E402

# int8 vs fp32 activations over the file's own blocks: share of tokens before the first divergence, floor under
# the measured (test_quantization.py's int4 test had this floor until the int4 embedding came from its head).
FLOOR_AGREEMENT = 0.35

T = gguf.GGMLQuantizationType
GGUF_LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"}
CPU = torch.device("cpu")
# The tiny files carry the first VOCAB tokens of SmolLM2's tokenizer (and the merges among them): the whole
# one makes gguf's reader and transformers' GGUF tokenizer conversion take ~1 minute per file.
VOCAB = 2048
PROMPTS = [[1, 500, 600, 700, 42, 1900, 31], [9, 8, 7, 6, 5, 4, 3, 2, 1, 42]]


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute: the rotary halves of each head interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tokenizer_fields():
    """The bundled GGUF's tokenizer metadata, so that transformers can read a tokenizer from the tiny files."""
    reader = gguf.GGUFReader(str(bundled_gguf_path()))
    fields = {f.name: [f.contents(), f.types] for f in reader.fields.values() if f.name.startswith("tokenizer.")}
    tokens = fields["tokenizer.ggml.tokens"][0][:VOCAB]
    kept = set(tokens)
    fields["tokenizer.ggml.tokens"][0] = tokens
    fields["tokenizer.ggml.token_type"][0] = fields["tokenizer.ggml.token_type"][0][:VOCAB]
    fields["tokenizer.ggml.merges"][0] = [m for m in fields["tokenizer.ggml.merges"][0]
                                          if {*m.split(" "), m.replace(" ", "")} <= kept]
    return [(name, value, types) for name, (value, types) in fields.items()]


def write_gguf(path, tokenizer_fields, types: dict[str, "gguf.GGMLQuantizationType"], arch="llama",
               tied_embd=None):
    """A tiny random Llama as llama.cpp's converter writes it; `types`: GGUF linear name -> its type.
    `tied_embd`: a type for token_embd, written without output.weight (a tied head, as the bundled file)."""
    model = tiny_llama(vocab_size=VOCAB)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    for name, value, vtypes in tokenizer_fields:
        w.add_key_value(name, value, vtypes[0], sub_type=vtypes[-1] if len(vtypes) > 1 else None)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    quantized = {}  # tensor name -> (type, the bytes written): what the reference de-quantizes
    if tied_embd is None:
        w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
        w.add_tensor("output.weight", sd["lm_head.weight"])
    else:
        quantized["token_embd.weight"] = tied_embd, gguf.quants.quantize(sd["model.embed_tokens.weight"], tied_embd)
        w.add_tensor("token_embd.weight", quantized["token_embd.weight"][1], raw_dtype=tied_embd)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for hf, g in GGUF_LINEARS.items():
            data = sd[f"{p}{hf}.weight"]
            if g in ("attn_q", "attn_k"):
                data = llama_cpp_permute(data, cfg.num_attention_heads if g == "attn_q" else cfg.num_key_value_heads)
            qtype = types.get(g, T.F32)
            quantized[f"blk.{i}.{g}.weight"] = qtype, gguf.quants.quantize(data, qtype)
            w.add_tensor(f"blk.{i}.{g}.weight", quantized[f"blk.{i}.{g}.weight"][1], raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, quantized


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, tokenizer_fields):
    """name -> (file, {tensor name: (type, bytes)}); the converted directories are removed afterwards
    (they are keyed by the file's path and time, so they would only pile up in the cache)."""
    import shutil

    d = tmp_path_factory.mktemp("gguf")
    files = {t.name: write_gguf(d / f"tiny-{t.name}.gguf", tokenizer_fields, dict.fromkeys(GGUF_LINEARS.values(), t))
             for t in (T.Q4_0, T.Q4_1, T.Q8_0)}
    # mixed, with a type kept de-quantized (Q5_0)
    files["mixed"] = write_gguf(d / "tiny-mixed.gguf", tokenizer_fields, {
        "attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.Q5_0, "ffn_gate": T.Q4_1,
        "ffn_up": T.Q4_0, "ffn_down": T.Q8_0})
    files["tied-q8_0"] = write_gguf(d / "tiny-tied.gguf", tokenizer_fields, dict.fromkeys(GGUF_LINEARS.values(), T.Q4_1),
                                    tied_embd=T.Q8_0)
    yield files
    for path, _ in files.values():
        shutil.rmtree(resolve_model_dir(str(path)), ignore_errors=True)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_each_layer_equals_ggufs_own_dequantization(gguf_files, qtype):
    path, written = gguf_files[qtype]
    hf_dir = resolve_model_dir(str(path))
    (hf_dir / "gguf-quantized-linears.safetensors").write_bytes(b"a stale cache of an earlier version")
    ours, _ = load_model_and_tokenizer(str(path), torch.float32, CPU, quantization="gguf")
    # The blocks' cache lives in a subfolder: the converted directory stays a plain HF one (vLLM loads every
    # top-level *.safetensors as weights), and the old top-level cache is gone.
    assert sorted(p.name for p in hf_dir.glob("*.safetensors")) == ["model.safetensors"]
    assert (hf_dir / "pagedcore-gguf" / "quantized-linears.safetensors").is_file()
    kind = Int8Linear if qtype == "Q8_0" else Int4Linear
    assert sum(isinstance(m, kind) for m in ours.modules()) == 14
    cfg = ours.config
    for name, (t, data) in written.items():
        w = gguf.quants.dequantize(data, t)  # [N, K]: gguf's own de-quantization
        if ".attn_q." in name or ".attn_k." in name:  # transformers' reverse permutation
            n_head = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            w = w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(2, 1).reshape(w.shape)
        layer = name.split(".")[1]
        hf = next(h for h, g in GGUF_LINEARS.items() if f".{g}." in name)
        module = ours.get_submodule(f"model.layers.{layer}.{hf}")
        got = module(torch.eye(module.in_features)).t()  # column j of W: the layer on the j-th unit vector
        torch.testing.assert_close(got, torch.from_numpy(w), atol=1e-6, rtol=1e-5)


@pytest.fixture
def exact_activations(monkeypatch):
    """fp32 activations at every M: the de-quantized weights exactly (decode rows' int8 activations: below)."""
    monkeypatch.setattr(quantization, "INT8_ACTIVATION_ROWS", 0)


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's activation blocks (Q8, 32 inputs, d = max|x| / 127, round to nearest), de-quantized;
    d kept in fp32 (llama.cpp stores it as fp16)."""
    blocks = x.double().view(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / d) * d).view(x.shape)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 5])
def test_decode_rows_compute_as_llama_cpp_does(gguf_files, qtype, rows):
    """Decode rows (M <= INT8_ACTIVATION_ROWS): 4- or 8-bit blocks times int8 activation blocks, which is
    gguf's de-quantized weight times llama.cpp's de-quantized Q8 activations, to fp32 summation order."""
    if quantization.cpu_ext.load() is None:
        pytest.skip("torch's int4 kernel (no C++ ops) keeps the activations as they are")
    assert rows <= quantization.INT8_ACTIVATION_ROWS
    path, written = gguf_files[qtype]
    ours, _ = load_model_and_tokenizer(str(path), torch.float32, CPU, quantization="gguf")
    g = torch.Generator().manual_seed(rows)
    for hf, name in [("mlp.down_proj", "blk.1.ffn_down.weight"), ("self_attn.v_proj", "blk.0.attn_v.weight")]:
        t, data = written[name]
        w = torch.from_numpy(gguf.quants.dequantize(data, t)).double()
        module = ours.get_submodule(f"model.layers.{name.split('.')[1]}.{hf}")
        x = torch.randn(rows, module.in_features, generator=g)
        got = module(x).double()
        want, exact = q8_activations(x) @ w.T, x.double() @ w.T
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
        assert (got - exact).abs().max() > 1e-4 * exact.abs().max()  # the activations were quantized


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "mixed"])
def test_logits_equal_the_dequantized_default(gguf_files, qtype, exact_activations):
    path = str(gguf_files[qtype][0])
    ours, _ = load_model_and_tokenizer(path, torch.float32, CPU, quantization="gguf")
    ref, _ = load_model_and_tokenizer(path, torch.float32, CPU)
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in ref.modules())  # the default stays as it was
    if qtype == "mixed":  # Q5_0 is not kept: transformers' de-quantized Linear
        assert [type(ours.get_submodule(f"model.layers.0.{h}")) for h in GGUF_LINEARS] == \
            [Int4Linear, Int4Linear, Int8Linear, nn.Linear, Int4Linear, Int4Linear, Int8Linear]
    ids = torch.tensor(PROMPTS[:1])
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    assert a.abs().max() > 1
    torch.testing.assert_close(b, a, atol=1e-4 * a.abs().max().item(), rtol=1e-4)


def test_engine_greedy_equals_transformers_gguf_loader(gguf_files, exact_activations):
    from transformers import AutoModelForCausalLM

    path = gguf_files["mixed"][0]
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    llm = LLM(str(path), quantization="gguf", num_kv_blocks=64, block_size=8)
    assert sum(isinstance(m, (Int4Linear, Int8Linear)) for m in llm.engine.model.modules()) == 12
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 12)[0]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_gguf_quantization_needs_a_gguf_model(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization='gguf' needs a GGUF model"):
        LLM(str(tiny_model_dir("llama")), quantization="gguf", num_kv_blocks=16)


def test_other_architectures_are_refused_naming_what_is_supported(tmp_path, tokenizer_fields):
    path, _ = write_gguf(tmp_path / "tiny-qwen2.gguf", tokenizer_fields, {"attn_q": T.Q4_0}, arch="qwen2")
    with pytest.raises(ValueError, match="architecture 'qwen2'.*supports GGUF llama-architecture"):
        gguf_native.load(path, tmp_path, torch.float32)


@pytest.mark.slow
def test_bundled_q4_1_model_native_matches_dequantized(chat_prompt_ids, monkeypatch):
    """The bundled SmolLM2 (Q4_1 linears, Q8_0 embedding): the same weights either way, so with fp32
    activations logits agree to fp32 summation order and greedy text is the same; with int8 activations at
    decode (the default, llama.cpp's scheme) greedy text agrees up to near-tied tokens."""
    monkeypatch.setattr(quantization, "INT8_ACTIVATION_ROWS", 0)
    ours, _ = load_model_and_tokenizer(None, torch.float32, CPU, quantization="gguf")
    ref, _ = load_model_and_tokenizer(None, torch.float32, CPU)
    assert sum(isinstance(m, Int4Linear) for m in ours.modules()) == 210
    assert isinstance(ours.lm_head, Int8Linear)  # the tied Q8_0 token_embd, kept as the file has it
    assert (resolve_model_dir(None) / gguf_native.CACHE_NAME).is_file()
    ids = torch.tensor([chat_prompt_ids[0]])
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    torch.testing.assert_close(b, a, atol=1e-4 * a.abs().max().item(), rtol=1e-4)
    del ours, ref
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = chat_prompt_ids[:4]
    native = LLM(quantization="gguf", num_kv_blocks=128)
    got = [o.outputs[0].token_ids for o in native.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in LLM(num_kv_blocks=128).generate(prompts, params)]
    assert got == want
    monkeypatch.setattr(quantization, "INT8_ACTIVATION_ROWS", quantization.int8_activation_rows("int8"))
    int8 = [o.outputs[0].token_ids for o in native.generate(prompts, params)]
    agree = [common_prefix(a, b) for a, b in zip(want, int8)]
    print("GGUF int8 vs fp32 activations, tokens before the first divergence:", agree)
    assert sum(agree) >= FLOOR_AGREEMENT * sum(map(len, want))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_decode_stack_runs_the_files_blocks(gguf_files, qtype):
    """The decode stack over the file's own Q4 / Q8 blocks (fused q/k/v and gate/up): tokens and logprobs
    equal the layer-by-layer path's, int8 activations on both."""
    path = str(gguf_files[qtype][0])
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
    results = []
    for stack in (True, False):
        llm = LLM(path, quantization="gguf", num_kv_blocks=64, block_size=8, decode_stack=stack)
        assert (llm.engine.runner.decode_stack is not None) == stack
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs])
                        for o in outs])
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert results[0] == results[1]


def test_tied_q8_0_embedding_stays_q8_0_as_head_and_embedding(gguf_files, exact_activations):
    """A tied token_embd in Q8_0 (as the bundled file): the LM head runs the file's blocks, the embedding
    reads its rows from them (one copy); both equal gguf's de-quantization, and greedy equals transformers'."""
    from transformers import AutoModelForCausalLM

    path, written = gguf_files["tied-q8_0"]
    ours, _ = load_model_and_tokenizer(str(path), torch.float32, CPU, quantization="gguf")
    assert isinstance(ours.lm_head, Int8Linear) and ours.get_input_embeddings().weight.numel() == 0
    t, data = written["token_embd.weight"]
    w = torch.from_numpy(gguf.quants.dequantize(data, t))
    ids = torch.tensor([[0, 17, 255, VOCAB - 1], [5, 16, 31, 1024]])
    torch.testing.assert_close(ours.get_input_embeddings()(ids), w[ids], atol=0, rtol=0)
    head = ours.lm_head(torch.eye(w.shape[1])).t()  # column j of the head's weight
    torch.testing.assert_close(head, w, atol=1e-6, rtol=1e-5)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    assert ref.config.tie_word_embeddings
    llm = LLM(str(path), quantization="gguf", num_kv_blocks=64, block_size=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 12)[0]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
