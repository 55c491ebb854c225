"""Shared fixtures: the real SmolLM2 (converted once), tiny random-weight models, the HF greedy reference,
the Sampler's two paths, the offline-API tests' engines."""

from __future__ import annotations

import os

import pytest
import torch

from api_helpers import ENGINE, FRANCE, HAIKU, assert_pool_whole, gen1, greedy

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No GPU here: Triton kernels run in Triton's interpreter, which must be chosen before anything
# (transformers loads triton while loading a model) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The HF references (transformers' own forwards) may be a process's first cos/sin, before any engine's model runner
# settles MKL's vector math (pagedcore/vector_math.py: a first call on two threads at once sometimes came back at
# ~12 bits on the main thread's share).
from pagedcore import vector_math  # noqa: E402

vector_math.warm_up()

# Memory (issue 14.10): the suite peaked at ~12.6 GB. Two causes here, neither a test's own need:
# 1. An LLM/LLMEngine sits in reference cycles, so an engine a test made (weights + KV cache,
#    ~1.2 GB for SmolLM2) outlives the test until a full gc happens to run; several piled up.
#    `_release_engines` below runs gc.collect() after a test that grew the process by more than
#    RELEASE_AFTER_GROWTH, and after every module (module-scoped engines and HF reference models).
# 2. glibc keeps freed memory: its mmap threshold rises to the largest freed block (up to 32 MB),
#    so later weight-sized tensors land in the heap/arenas and are never returned (~0.8 GB kept per
#    engine built and dropped). A fixed 1 MB threshold keeps big tensors in mmap (returned on free),
#    and malloc_trim(0) after a release gives back what the heaps hold free.
# Not fixable here: test_bench_throughput's hf-cb peer (pagedcore/bench/peer_scripts/peer_hf_cb.py)
# lets transformers' continuous batching size its KV cache from free RAM (~14 GB on a 24 GB box, the
# suite's single largest process) until that script passes an explicit ContinuousBatchingConfig.
RELEASE_AFTER_GROWTH = 256 << 20
try:
    import ctypes

    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, which also stops the dynamic raise
except (OSError, AttributeError):  # not glibc: gc alone
    _libc = None


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _release() -> None:
    import gc

    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


@pytest.fixture(autouse=True, scope="module")
def _release_module():
    yield
    _release()


@pytest.fixture(autouse=True)
def _release_engines():
    before = _rss()
    yield
    if _rss() - before > RELEASE_AFTER_GROWTH:
        _release()

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
    "Hi!",
    "Translate 'good morning' into Spanish and German, and say which languages these are.",
    "What does a compiler do? Answer for a ten-year-old, in detail, with an example about cooking recipes.",
    "Name a famous painting.",
]


@pytest.fixture(scope="session")
def smollm2_dir():
    from pagedcore.model_loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def chat_prompt_ids(smollm2_tokenizer):
    return [list(smollm2_tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False)) for p in CHAT_PROMPTS]


def tiny_config(arch: str):
    from transformers import AutoConfig

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=2, initializer_range=0.3, tie_word_embeddings=False)
    name = arch.removesuffix("-long")
    extra = {"gemma": dict(head_dim=16), "mistral": dict(sliding_window=24), "qwen2": {}, "llama": {}, "phi3": {}}[name]
    if arch.endswith("-long"):  # requests long enough to outlast a deadline however fast the engine steps
        extra = {**extra, "max_position_embeddings": 4096}
    return AutoConfig.for_model(name, **{**common, **extra})


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer):
    """Factory: a saved tiny random-weight model of an architecture, with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM

    made = {}

    def make(arch: str):
        if arch not in made:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(d)
            smollm2_tokenizer.save_pretrained(d)
            made[arch] = d
        return made[arch]

    return make


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int):
    """transformers' own generate(): the tokens and the log-softmax of each step's logits."""
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=model.config.eos_token_id)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(l[0].float(), -1) for l in out.logits]
    return tokens, logprobs


def assert_greedy_equal(ours, ours_logprobs, ref, ref_logprobs, tol: float = 1e-3):
    """Token for token; a difference is allowed only at a near-tie (both engines' logprobs of the
    two tokens within `tol`), after which the continuations are no longer comparable."""
    for t, (a, b) in enumerate(zip(ref, ours)):
        if a == b:
            continue
        ref_gap = abs(ref_logprobs[t][a].item() - ref_logprobs[t][b].item())
        step = ours_logprobs[t]
        assert a in step and b in step, f"step {t}: HF token {a} not among our top logprobs {list(step)}"
        our_gap = abs(step[a].logprob - step[b].logprob)
        assert ref_gap < tol and our_gap < tol, (
            f"step {t}: HF chose {a}, we chose {b}; gaps HF {ref_gap:.2e}, ours {our_gap:.2e} (not a near-tie)")
        return t
    assert len(ours) == len(ref), f"lengths differ: ours {len(ours)}, HF {len(ref)}"
    return None


@pytest.fixture(scope="session")
def ext():
    """The C++ CPU ops module (kernels/cpu_ext.py); tests of them skip where it cannot be built."""
    from pagedcore.kernels import cpu_ext

    module = cpu_ext.load()
    if module is None:
        pytest.skip("no C++ toolchain: the C++ CPU ops are not built (callers keep their torch paths)")
    return module


@pytest.fixture(scope="module", params=["cpu-ext", "torch"])
def sampler_path(request):
    """The Sampler tests run on both paths (`pytestmark = pytest.mark.usefixtures("sampler_path")`): the C++
    row reductions (greedy argmax+logsumexp, inverse-CDF draw) and the portable torch ones (the exponential
    race) that other devices use."""
    import pagedcore.sampler as sampler_mod

    saved = sampler_mod._cpu_ext
    if request.param == "cpu-ext" and saved() is None:
        pytest.skip("C++ CPU ops not built")
    if request.param == "torch":
        sampler_mod._cpu_ext = lambda: None
    yield request.param
    sampler_mod._cpu_ext = saved


# ---- the offline API's engines (test_api*.py, test_engine_step_loop.py; helpers in api_helpers.py) -------
# Module-scoped: each module gets its own, checked whole at its end. A module may define its own `tiny`/`tok`.
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from pagedcore import LLM

    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=8, **ENGINE)
    yield llm
    assert_pool_whole(llm.engine)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from pagedcore import LLM

    llm = LLM(str(smollm2_dir), num_kv_blocks=64, block_size=16, **ENGINE)
    yield llm
    assert_pool_whole(llm.engine)


@pytest.fixture(scope="module")
def tok(smol):
    return smol.get_tokenizer()


@pytest.fixture(scope="module")
def france(smol):
    return smol.apply_chat_template([{"role": "user", "content": FRANCE}])


@pytest.fixture(scope="module")
def haiku(smol):
    return smol.apply_chat_template([{"role": "user", "content": HAIKU}])


@pytest.fixture(scope="module")
def france_greedy(smol, france):
    """Unconstrained greedy answer; it ends with EOS well before 24 tokens."""
    c = gen1(smol, france, greedy(24))
    assert c.finish_reason == "stop" and c.token_ids[-1] in smol.engine.eos_token_ids, c
    assert "Paris" in c.text
    return c


@pytest.fixture(scope="module")
def haiku_greedy(smol, haiku):
    c = gen1(smol, haiku, greedy(24))
    assert c.finish_reason == "length" and len(c.token_ids) == 24
    return c
