"""The captured forward (EngineConfig.compile): same greedy tokens as eager and transformers, one
graph for every step shape, a clean eager fallback, and inductor artifacts reused by a new process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import assert_greedy_equal, hf_greedy
from pagedcore import LLM, SamplingParams, capture, lean_layers

MAX_NEW = 10
# 3 / 29 / 47 tokens together (a batch of 3 decoding; 47 > the 32-token budget: chunked prefill),
# then 40 alone (a first chunk that samples no row, then batch-1 decode), then a prompt whose first
# two blocks are the 47-token prompt's (a prefix-cache hit: queries start mid-sequence).
BATCH = [[5 + i for i in range(n)] for n in (3, 29, 47)]
ALONE = [[900 + 7 * i for i in range(40)]]
PREFIX_HIT = [BATCH[2][:32] + [3000 + i for i in range(9)]]
SETTINGS = dict(dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=32)


def _generate(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _run_all(llm):
    return _generate(llm, BATCH) + _generate(llm, ALONE) + _generate(llm, PREFIX_HIT)


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """A PAGEDCORE_CACHE of this module's own; this process's inductor artifacts go to its inductor/."""
    root = tmp_path_factory.mktemp("pagedcore-cache")
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    yield root
    if previous is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


@pytest.fixture(scope="module")
def captured_run(ext, tiny_model_dir, inductor_cache):
    """One compiled engine over the tiny Llama, every prompt group run through it."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    llm = LLM(str(tiny_model_dir("llama")), compile=True, **SETTINGS)
    outs = _run_all(llm)
    # The thread count it compiled for: inductor's CPU code (and its cache key) depend on it.
    return llm, outs, counters["stats"]["unique_graphs"] - graphs, torch.get_num_threads()


def test_captured_greedy_equals_eager_and_transformers(captured_run, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    llm, captured, new_graphs, _ = captured_run
    assert not llm.engine.runner.captured.failed
    assert new_graphs == 1, "one graph for every token count and number of sampled rows"
    assert llm.engine.kv.num_prefix_hit_tokens >= 32, "the prefix-cache prompt did not hit"
    eager = _run_all(LLM(str(tiny_model_dir("llama")), **SETTINGS))
    for a, b in zip(captured, eager):
        assert a.token_ids == b.token_ids
        for tok, step_a, step_b in zip(a.token_ids, a.logprobs, b.logprobs):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t].logprob - step_b[t].logprob) < 1e-4 for t in step_a)

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")), dtype=torch.float32)
    with torch.inference_mode():
        for prompt, out in zip(BATCH + ALONE + PREFIX_HIT, captured):
            ref, ref_logprobs = hf_greedy(model, prompt, MAX_NEW)
            assert_greedy_equal(out.token_ids, out.logprobs, ref, ref_logprobs)


def test_captured_bf16_rounds_where_eager_rounds(ext, tiny_model_dir, inductor_cache):
    """Inductor fuses the norms, RoPE and SiLU into one loop each, yet rounds to bf16 where the eager
    ops round (emulate_precision_casts): the same tokens, logprobs within bf16's coarseness."""
    settings = dict(SETTINGS, dtype="bfloat16")
    llm = LLM(str(tiny_model_dir("llama")), compile=True, **settings)
    captured = _generate(llm, BATCH) + _generate(llm, ALONE)
    assert not llm.engine.runner.captured.failed
    eager_llm = LLM(str(tiny_model_dir("llama")), **settings)
    eager = _generate(eager_llm, BATCH) + _generate(eager_llm, ALONE)
    for a, b in zip(captured, eager):
        assert a.token_ids == b.token_ids
        for tok, step_a, step_b in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(step_a[tok].logprob - step_b[tok].logprob) < 0.1


def test_compile_failure_warns_once_and_serves_eagerly(ext, tiny_model_dir, monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("inductor exploded")
        return run

    monkeypatch.setattr(capture.torch, "compile", broken_compile)
    llm = LLM(str(tiny_model_dir("llama")), compile=True, **SETTINGS)
    with caplog.at_level(logging.WARNING, logger="pagedcore"):
        outs = _generate(llm, BATCH)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "inductor exploded" in warnings[0].getMessage()
    assert llm.engine.runner.captured.failed
    # The eager installs are back: lean layers, and transformers' attention through hf_glue.
    layers = [m for m in llm.engine.model.modules() if type(m).__name__ in lean_layers.SUPPORTED_LAYERS]
    assert layers and all("_lean_forward" in m.forward.__qualname__ for m in layers)
    assert llm.engine.model.config._attn_implementation == "pagedcore"
    eager = _generate(LLM(str(tiny_model_dir("llama")), **SETTINGS), BATCH)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]


FRESH_PROCESS = textwrap.dedent("""
    import json, sys, time
    from torch._dynamo.utils import counters
    from pagedcore import LLM, SamplingParams

    llm = LLM(sys.argv[1], compile=True, dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=32,
              num_threads=int(sys.argv[2]))
    t0 = time.perf_counter()
    out = llm.generate([list(range(5, 25))], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    print(json.dumps({"seconds": time.perf_counter() - t0, "failed": llm.engine.runner.captured.failed,
                      "tokens": out[0].outputs[0].token_ids, **counters["inductor"], **counters["aot_autograd"]}))
""")


def test_fresh_process_reuses_inductor_artifacts(captured_run, tiny_model_dir, inductor_cache):
    """A new process with the same PAGEDCORE_CACHE (and thread count: earlier tests may leave this
    process at 1 thread, and inductor's C++ kernels are generated for a thread count) finds the graph
    this process compiled."""
    from pagedcore.kernels import cpu_ext

    # The C++ ops already built for this checkout, so the new process does not rebuild them.
    name = cpu_ext._name()
    (inductor_cache / "cpu_ops").mkdir(exist_ok=True)
    if not (inductor_cache / "cpu_ops" / name).exists():
        (inductor_cache / "cpu_ops" / name).symlink_to(cpu_ext._build_dir(name))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PAGEDCORE_CACHE"] = str(inductor_cache)
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(tiny_model_dir("llama")),
                           str(captured_run[3])], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["failed"]
    assert report.get("fxgraph_cache_hit", 0) >= 1 or report.get("autograd_cache_hit", 0) >= 1, report
    assert report.get("fxgraph_cache_miss", 0) == 0 and report.get("autograd_cache_miss", 0) == 0, report


def test_compile_options_per_device():
    cpu = capture.compile_options(torch.device("cpu"))
    assert cpu["cpp_wrapper"] and "triton.cudagraphs" not in cpu and "freezing" not in cpu
    sizes = capture.decode_sizes(64)
    assert sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    cuda = capture.compile_options(torch.device("cuda"), sizes)
    # Piecewise CUDA graphs: inductor partitions the graph at the attention op and records the
    # pieces for decode batch sizes only (a piece's key: its token count, or (tokens, rows)).
    assert cuda["triton.cudagraphs"] and cuda["graph_partition"]
    assert cuda["custom_should_partition_ops"] == ["pagedcore::paged_attention"]
    assert 1 in cuda["triton.cudagraph_capture_sizes"] and (64, 64) in cuda["triton.cudagraph_capture_sizes"]
    assert 2048 not in cuda["triton.cudagraph_capture_sizes"]
    assert "cpp_wrapper" not in cuda
    capture.register_ops()
    assert torch.Tag.cudagraph_unsafe in torch.ops.pagedcore.paged_attention.default.tags


def test_pagedcore_cache_holds_inductor_artifacts(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("PAGEDCORE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # torch's own default counts as unset
    assert capture.use_cache_dir() == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice is kept
    assert capture.use_cache_dir() == str(tmp_path / "mine")
