"""Dependencies point one way: adapters -> engine -> kernels. The engine imports no front door and no
benchmark, the command line loads only the subcommand it runs, and Triton's CPU interpreter is chosen
by the Triton kernels alone, never by importing (or running) the engine.

Each check runs in a fresh interpreter (this one already holds everything), without TRITON_INTERPRET
(conftest.py sets it for the kernel tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

FRONT_DOORS_AND_BENCH = ("pagedcore.adapters", "pagedcore.bench", "bentoml", "pytriton", "tritonclient", "fastapi")
ENGINE = ["pagedcore.llm", "pagedcore.llm_engine", "pagedcore.async_engine", "pagedcore.model_runner",
          "pagedcore.scheduler", "pagedcore.sampler", "pagedcore.attention.torch_backend", "pagedcore.kernels.cpu_ext",
          "pagedcore.builtin_plugins", "pagedcore.plugins"]
REPORT = ("import json, os, sys; print(json.dumps({'modules': sorted(sys.modules), "
          "'TRITON_INTERPRET': os.environ.get('TRITON_INTERPRET')}))")


def fresh(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-c", f"{code}\n{REPORT}"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def loaded(modules: list[str], *packages: str) -> list[str]:
    """The modules that are one of `packages` or inside one."""
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


def test_importing_pagedcore_and_its_cli_loads_no_front_door_no_bench_no_torch():
    got = fresh("import pagedcore, pagedcore.cli")
    assert loaded(got["modules"], *FRONT_DOORS_AND_BENCH) == []
    assert loaded(got["modules"], "torch", "transformers") == []


def run_cli(*argv: str) -> str:
    return f"from pagedcore import cli\ntry:\n    cli.main({list(argv)!r})\nexcept SystemExit:\n    pass"


def test_cli_help_loads_no_subcommand():
    got = fresh(run_cli("--help"))
    assert loaded(got["modules"], *FRONT_DOORS_AND_BENCH, "torch") == []


def test_a_subcommand_loads_only_its_own_module():
    got = fresh(run_cli("serve-triton", "--help"))
    assert "pagedcore.adapters.triton_launcher" in got["modules"]
    assert loaded(got["modules"], "pagedcore.bench", "pytriton", "torch") == []


def test_importing_the_engine_loads_no_front_door_and_leaves_triton_interpret_unset():
    got = fresh("\n".join(f"import {m}" for m in ENGINE))
    assert loaded(got["modules"], *FRONT_DOORS_AND_BENCH) == []
    assert not [m for m in got["modules"] if m.startswith("pagedcore.kernels.") and "triton" in m]
    assert got["TRITON_INTERPRET"] is None


def test_running_the_engine_on_cpu_leaves_triton_interpret_unset(tiny_model_dir):
    model = tiny_model_dir("llama")
    got = fresh(f"from pagedcore import LLM, SamplingParams\n"
                f"llm = LLM(model={str(model)!r}, dtype='float32', num_kv_blocks=16, device='cpu')\n"
                f"llm.generate(['Hello'], SamplingParams(max_tokens=2), use_tqdm=False)")
    assert got["TRITON_INTERPRET"] is None
    assert loaded(got["modules"], *FRONT_DOORS_AND_BENCH) == []


def test_the_benchmarks_launch_the_front_doors_without_importing_them():
    got = fresh("import pagedcore.bench.serve")
    assert loaded(got["modules"], "pagedcore.adapters", "bentoml", "pytriton") == []


def test_the_triton_kernels_choose_the_interpreter_themselves():
    pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device: the Triton kernels compile, there is no interpreter to choose")
    got = fresh("from pagedcore.kernels.triton_attention_backend import TritonAttentionBackend\n"
                "from pagedcore.kernels.decode_attention import _decode_partition_kernel as kernel\n"
                "assert type(kernel).__name__ == 'InterpretedFunction', type(kernel)")
    assert got["TRITON_INTERPRET"] == "1"
