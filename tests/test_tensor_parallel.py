"""Tensor parallelism (issue 18): the model sharded by its Hugging Face plan over N ranks on gloo.

Each test that starts workers checks the process table afterwards: no worker outlives its engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy
from pagedcore import LLM, EngineDeadError, RequestFailedError, SamplingParams, hookimpl
from pagedcore.distributed.launch import free_port

# One torch thread per rank: three ranks share two cores.
FP32 = dict(dtype="float32", num_kv_blocks=128, max_num_seqs=8, num_threads=1)
MAX_NEW = 24


def children() -> list[int]:
    """Live (not zombie) descendants of this process, from /proc."""
    me, kids = os.getpid(), {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            kids.setdefault(int(fields[1]), []).append(int(d.name))
    out, todo = [], [me]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def assert_no_workers_left(timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children() == [], f"processes left behind: {children()}"


class LogitsRecorder:
    """Records the logits rank 0 samples from (one row per sampling sequence, each step)."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    @hookimpl
    def pagedcore_logits_processors(self, config):
        def record(logits, seqs):
            self.steps.append(logits.detach().clone())
            return logits
        return [record]


def greedy(llm, prompts, n=MAX_NEW):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# ---- start-up refusals ----------------------------------------------------------------------------------
def test_heads_not_divisible_refused_naming_the_numbers(smollm2_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the model's attention heads \(9\) "
                                         r"and KV heads \(3\).*sizes that work: 1, 3"):
        LLM(str(smollm2_dir), tensor_parallel_size=2, **FP32)
    assert_no_workers_left()


def test_settings_refuse_what_does_not_compose():
    from pagedcore.config import EngineConfig

    with pytest.raises(ValueError, match="speculative decoding does not run with tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="compile=True does not run"):
        EngineConfig(tensor_parallel_size=2, compile=True)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(distributed_executor_backend="ray")
    assert not EngineConfig(tensor_parallel_size=2).use_compile(torch.device("cuda"))


def test_flag_and_env_setting():
    import argparse

    from pagedcore.settings import add_engine_arguments, settings_from_args, settings_from_env

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args(["--tensor-parallel-size", "3", "--distributed-timeout", "20", "--no-tensor-parallel-vocab"])
    assert settings_from_args(args) == {"tensor_parallel_size": 3, "distributed_timeout": 20.0,
                                        "tensor_parallel_vocab": False}
    assert settings_from_env({"PAGEDCORE_TENSOR_PARALLEL_SIZE": "2"}) == {"tensor_parallel_size": 2}


# ---- a small random Llama: 4 heads, 2 KV heads, TP=2 ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    from transformers import AutoConfig

    d = tiny_model_dir("llama")
    c = AutoConfig.from_pretrained(str(d))
    assert (c.num_attention_heads, c.num_key_value_heads) == (4, 2)
    return d


@pytest.fixture(scope="module")
def tiny_prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.encode(p) for p in ("Hello, my name is", "The sea is", "1, 2, 3,", "Paris")]


@pytest.fixture(scope="module")
def tiny_tp1(tiny_llama, tiny_prompts):
    llm = LLM(str(tiny_llama), **FP32)
    return greedy(llm, tiny_prompts)


@pytest.mark.parametrize("vocab_parallel", [True, False])
def test_tp2_tiny_llama_equals_tp1_and_transformers(tiny_llama, tiny_prompts, tiny_tp1, vocab_parallel):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama), tensor_parallel_size=2, tensor_parallel_vocab=vocab_parallel, **FP32)
    try:
        info = llm.engine.executor.rank_info
        assert [i["rank"] for i in info] == [0, 1]
        assert all(i["num_kv_heads"] == 1 and i["kv_cache_shape"][2] == 1 for i in info), info  # 2 KV heads / 2
        assert len({i["pid"] for i in info}) == 2
        assert greedy(llm, tiny_prompts) == tiny_tp1
        stats = llm.engine.executor.comm_stats()
        assert [s["rank"] for s in stats] == [0, 1] and all(s["comm_calls"] > 0 for s in stats)
        assert ("gather" in stats[0]["by_op"]) == vocab_parallel
    finally:
        llm.shutdown()
    assert_no_workers_left()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    with torch.inference_mode():
        assert [hf_greedy(model, p, MAX_NEW)[0] for p in tiny_prompts] == tiny_tp1


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma", "phi3"])
def test_tp2_other_architectures_equal_tp1(arch, tiny_model_dir, tiny_prompts):
    """No per-model code: each plan as transformers declares it (Phi-3's gathers its fused qkv, so its
    ranks keep every KV head; Gemma's embedding scales)."""
    d = tiny_model_dir(arch)
    ref = greedy(LLM(str(d), **FP32), tiny_prompts, 12)
    llm = LLM(str(d), tensor_parallel_size=2, **FP32)
    try:
        assert greedy(llm, tiny_prompts, 12) == ref
        kv_heads = {i["kv_cache_shape"][2] for i in llm.engine.executor.rank_info}
        assert kv_heads == ({2} if arch == "phi3" else {1})
    finally:
        llm.shutdown()
    assert_no_workers_left()


def test_bench_throughput_reports_time_in_collectives(tiny_llama, tmp_path):
    from pagedcore.cli import main

    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--tensor-parallel-size", "2", "--num-threads", "1",
                 "--num-prompts", "4", "--input-min", "8", "--input-max", "16", "--output-min", "4", "--output-max", "8",
                 "--dtype", "float32", "--no-single-stream", "--json", str(out)]) == 0
    tp = json.loads(out.read_text())["tensor_parallel"]
    assert tp["size"] == 2 and tp["steps"] > 0 and tp["comm_ms_per_step"] > 0 and 0 < tp["comm_fraction"] < 1
    # per layer: the all-reduces of o_proj and down_proj; plus the embedding's, and the LM head's gather
    assert tp["collectives_per_step"] == 2 * 2 + 2
    assert [r["rank"] for r in tp["ranks"]] == [0, 1]
    assert_no_workers_left()


def test_killed_worker_fails_the_request_and_marks_the_engine_unhealthy(tiny_llama, tiny_prompts):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, distributed_timeout=30, **FP32)
    engine = llm.engine
    try:
        worker_pid = engine.executor.rank_info[1]["pid"]
        rid = engine.add_request(None, tiny_prompts[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        for _ in range(3):
            assert not any(o.error for o in engine.step())
        os.kill(worker_pid, signal.SIGKILL)
        t0 = time.monotonic()
        outs = []
        while engine.has_unfinished_requests() and time.monotonic() - t0 < 30:
            outs += engine.step()
        failed = [o for o in outs if o.request_id == rid]
        assert failed and failed[-1].finished and isinstance(failed[-1].error, RequestFailedError)
        message = str(failed[-1].error)
        assert "worker rank 1" in message and str(worker_pid) in message and "SIGKILL" in message, message
        assert time.monotonic() - t0 < 10
        assert not engine.healthy
        with pytest.raises(EngineDeadError, match="unhealthy.*worker rank 1"):
            engine.add_request(None, tiny_prompts[1], SamplingParams(max_tokens=4))
    finally:
        llm.shutdown()
    assert_no_workers_left()


def test_hung_worker_fails_within_the_timeout(tiny_llama, tiny_prompts):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, distributed_timeout=4, **FP32)
    engine = llm.engine
    try:
        worker_pid = engine.executor.rank_info[1]["pid"]
        engine.add_request(None, tiny_prompts[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        engine.step()
        os.kill(worker_pid, signal.SIGSTOP)
        t0 = time.monotonic()
        outs = []
        while engine.has_unfinished_requests() and time.monotonic() - t0 < 30:
            outs += engine.step()
        assert outs and "distributed_timeout (4 s)" in str(outs[-1].error), outs
        assert time.monotonic() - t0 < 15 and not engine.healthy
    finally:
        llm.shutdown()
    assert_no_workers_left()


def test_async_engine_readiness_and_dropped_engine_leave_no_process(tiny_llama, tiny_prompts):
    import gc

    from pagedcore import AsyncLLMEngine

    aeng = AsyncLLMEngine.from_settings(str(tiny_llama), tensor_parallel_size=2, **FP32)
    assert aeng.healthy
    os.kill(aeng.engine.executor.rank_info[1]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while aeng.healthy and time.monotonic() < deadline:  # idle: the monitor notices
        time.sleep(0.1)
    assert not aeng.healthy
    aeng.shutdown()
    assert_no_workers_left()
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **FP32)
    assert len(children()) == 1
    del llm
    gc.collect()
    assert_no_workers_left()


ORPHAN_SCRIPT = """
import sys, time
from pagedcore import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", num_kv_blocks=32, num_threads=1)
print(" ".join(str(i["pid"]) for i in llm.engine.executor.rank_info[1:]), flush=True)
time.sleep(600)
"""


def test_workers_exit_when_the_engine_process_is_killed(tiny_llama, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(ORPHAN_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_llama)], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 1 and Path(f"/proc/{workers[0]}").exists()
    finally:
        proc.kill()  # SIGKILL: no atexit, no finalizer runs in the engine's process
        proc.wait()
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{w}").exists() and b"pagedcore.distributed.worker" in cmdline(w) for w in workers) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{w}").exists() and b"pagedcore.distributed.worker" in cmdline(w) for w in workers)


# ---- torchrun (external_launcher) --------------------------------------------------------------------------
TORCHRUN_SCRIPT = """
import json, os, sys
from pagedcore import LLM, SamplingParams

model, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
          dtype="float32", num_kv_blocks=128, max_num_seqs=8, num_threads=1)
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens={max_new}), use_tqdm=False)
second = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
if os.environ["RANK"] == "0":
    with open(out, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outs + second], f)
else:
    assert outs == [] and second == []
"""


def test_torchrun_two_ranks_equal_tp1(tiny_llama, tiny_prompts, tiny_tp1, tmp_path):
    script = tmp_path / "tp_script.py"
    script.write_text(TORCHRUN_SCRIPT.replace("{max_new}", str(MAX_NEW)))
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(tiny_llama), json.dumps(tiny_prompts), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    tokens = json.loads(out.read_text())
    assert tokens[:-1] == tiny_tp1
    assert tokens[-1] == tiny_tp1[0][:4]


# ---- the bundled SmolLM2 (9 heads, 3 KV heads), TP=3, fp32 ------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_prompts(chat_prompt_ids):
    return chat_prompt_ids[:4]


@pytest.fixture(scope="module")
def smollm2_tp1(smollm2_dir, smollm2_prompts):
    rec = LogitsRecorder()
    llm = LLM(str(smollm2_dir), plugins=[rec], **FP32)
    return greedy(llm, smollm2_prompts), rec.steps[0]


@pytest.mark.slow
def test_tp3_smollm2_equals_tp1_and_transformers(smollm2_dir, smollm2_prompts, smollm2_tp1):
    from transformers import AutoModelForCausalLM

    tp1_tokens, tp1_prefill = smollm2_tp1
    rec = LogitsRecorder()
    llm = LLM(str(smollm2_dir), tensor_parallel_size=3, plugins=[rec], **FP32)
    try:
        info = llm.engine.executor.rank_info
        assert len(info) == 3 and all(i["kv_cache_shape"][2] == 1 for i in info), info  # 3 KV heads / 3
        tokens = greedy(llm, smollm2_prompts)
    finally:
        llm.shutdown()
    assert_no_workers_left()
    prefill = rec.steps[0]  # the prompts' last-position logits, all four prompts in one prefill step
    assert prefill.shape == tp1_prefill.shape == (len(smollm2_prompts), 49152)
    torch.testing.assert_close(prefill, tp1_prefill, rtol=1e-4, atol=1e-4)
    assert tokens == tp1_tokens
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    with torch.inference_mode():
        assert [hf_greedy(model, p, MAX_NEW)[0] for p in smollm2_prompts] == tokens


@pytest.mark.slow
def test_triton_door_tp3_stream_equals_tp1(smollm2_dir, smollm2_tokenizer, tmp_path):
    pytest.importorskip("pytriton")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from pagedcore.adapters.triton_launcher import TritonServer
    from test_triton_server import StreamClient, infer_inputs, text_of

    settings = dict(dtype="float32", num_kv_blocks=128, max_num_seqs=8, max_model_len=1024, num_threads=1)
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                                   add_generation_prompt=True, tokenize=False)
    http, grpc, metrics = (free_port() for _ in range(3))
    server = TritonServer(http_port=http, grpc_port=grpc, metrics_port=metrics, log_path=tmp_path / "triton.log",
                          engine_settings=dict(settings, tensor_parallel_size=3))
    server.start()
    try:
        threads = torch.get_num_threads()
        try:
            ref = LLM(str(smollm2_dir), **settings).generate(prompt, SamplingParams(temperature=0, max_tokens=20),
                                                             use_tqdm=False)[0].outputs[0].text
        finally:
            torch.set_num_threads(threads)
        try:
            server.wait_ready(timeout=240)
        except (RuntimeError, TimeoutError) as e:
            pytest.fail(f"{e}\n{(tmp_path / 'triton.log').read_text(errors='replace')[-4000:]}")
        client = StreamClient(server)
        try:
            results, error = client.generate(infer_inputs(prompt, {"temperature": 0, "max_tokens": 20}))
        finally:
            client.close()
        assert error is None, error
        assert "".join(text_of(r) for r in results) == ref
        workers = [pid for pid in children() if b"pagedcore.distributed.worker" in cmdline(pid)]
        assert len(workers) == 2, "the Triton model's engine did not run its two tensor-parallel workers"
        assert grpcclient is not None
    finally:
        server.stop(timeout=60)
    assert_no_workers_left(timeout=30)
