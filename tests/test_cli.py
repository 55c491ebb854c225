"""`python -m pagedcore.cli generate`: JSON output with the bundled model, and exit code 2 with a
one-line error (no traceback) for bad values and missing models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SMALL_KV = ["--kv-cache-memory", str(64 * 2**20)]  # not a fraction of the machine's free memory


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "pagedcore.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_clean_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error:"), r.stderr
    for w in words:
        assert w in err, (w, err)


def test_generate_json_one_object_per_prompt(smollm2_dir):  # the fixture converts the bundled model
    prompts = ["What is the capital of France?", "List three prime numbers."]
    r = cli("generate", *prompts, "--max-tokens", "8", "--json", *SMALL_KV)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == len(prompts)
    for prompt, line in zip(prompts, lines):
        obj = json.loads(line)
        assert obj["prompt"] == prompt
        (o,) = obj["outputs"]
        assert isinstance(o["text"], str) and o["text"]
        assert 1 <= len(o["token_ids"]) <= 8 and all(isinstance(t, int) for t in o["token_ids"])
        assert o["finish_reason"] in ("stop", "length")
        if len(o["token_ids"]) < 8:
            assert o["finish_reason"] == "stop"
    # greedy by default, chat template applied
    first = json.loads(lines[0])["outputs"][0]
    assert "Paris" in first["text"]
    assert first["finish_reason"] == "stop"
    assert "[pagedcore] 2 prompt(s)" in r.stderr


def test_generate_n_and_stop_in_json(smollm2_dir):
    r = cli("generate", "What is the capital of France?", "--max-tokens", "8", "--json", "-n", "2",
            "--temperature", "0.7", "--seed", "1", "--stop", "Paris", *SMALL_KV)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = r.stdout.strip().splitlines()
    outs = json.loads(line)["outputs"]
    assert len(outs) == 2
    assert all("Paris" not in o["text"] for o in outs)


@pytest.mark.parametrize("flags,field", [
    (["--temperature", "-1"], "temperature"),
    (["--max-tokens", "0"], "max_tokens"),
])
def test_bad_sampling_value_exits_2_naming_it(flags, field):
    r = cli("generate", "Hello", *flags)
    assert_clean_error(r, field)


def test_bad_value_is_reported_before_the_model_is_loaded():
    # Both are wrong; the flag is checked first, so no model load is spent on a doomed run.
    r = cli("generate", "Hello", "--temperature", "-1", "--model", "/nonexistent/model")
    assert_clean_error(r, "temperature")


def test_missing_model_path_exits_2_naming_it():
    r = cli("generate", "Hello", "--model", "/nonexistent/model")
    assert_clean_error(r, "/nonexistent/model")


def test_no_prompt_exits_2():
    r = cli("generate")
    assert_clean_error(r, "prompt")


def test_unparsable_flag_is_an_argparse_error():
    r = cli("generate", "Hello", "--max-tokens", "many")
    assert r.returncode == 2
    assert "--max-tokens" in r.stderr and "Traceback" not in r.stderr


def test_help_lists_every_subcommand():
    r = cli("--help", timeout=60)
    assert r.returncode == 0, r.stderr
    for name in ("generate", "serve-bentoml", "serve-triton", "bench"):
        assert name in r.stdout


@pytest.mark.parametrize("argv,words", [
    (["serve-triton", "--help"], ["--model-repository", "--set KEY=VALUE"]),
    (["bench", "--help"], ["throughput", "step", "linears", "attention", "serve", "memory", "prefix", "plot"]),
    (["bench", "attention", "--help"], ["--shapes", "--repeats"]),
])
def test_each_subcommand_brings_its_own_arguments(argv, words):
    """The subcommands' modules are imported only when they run (tests/test_import_layering.py)."""
    r = cli(*argv, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for w in words:
        assert w in r.stdout, (w, r.stdout)


def test_unknown_bench_command_is_an_argparse_error():
    r = cli("bench", "nosuch", timeout=120)
    assert r.returncode == 2 and "invalid choice" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command,module,extra", [
    ("serve-bentoml", "bentoml", "bentoml"),
    ("serve-bentoml", "fastapi", "bentoml"),
    ("serve-triton", "pytriton", "triton-server"),
])
def test_a_front_door_without_its_extra_names_the_install_in_one_line(command, module, extra):
    # sys.modules[name] = None makes the module unimportable, as if the extra were not installed.
    code = (f"import sys; sys.modules[{module!r}] = None; from pagedcore.cli import main; "
            f"sys.exit(main([{command!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"pip install 'pagedcore[{extra}]'" in lines[0] and module in lines[0]


def test_generate_help_explains_every_sampling_flag():
    r = cli("generate", "--help", timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--seed", "-n N", "--stop"):
        block = r.stdout.split(flag, 1)[1].split("\n  -", 1)[0]  # the flag's lines up to the next flag
        assert len(block.split()) >= 3, (flag, block)
