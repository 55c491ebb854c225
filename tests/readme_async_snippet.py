"""The README's AsyncLLMEngine snippet, leaving the `async for` early as the README invites, run in
RUNS forked processes (PARALLEL at a time); prints each one's exit code. Used by test_clean_exit.py.

    python readme_async_snippet.py MODEL_DIR RUNS PARALLEL

Forked from one parent that has only imported (torch, transformers, pagedcore; no torch op has run)
so that each run starts in a second, not ten: each child then builds its engine, streams, leaves
the loop, and exits the usual way (asyncio.run returns, atexit, interpreter teardown).
"""

import asyncio
import os
import sys

import transformers.models.llama.modeling_llama  # noqa: F401  imported once, before the forks
from transformers import AutoConfig, AutoTokenizer

import pagedcore.async_engine  # noqa: F401
import pagedcore.llm_engine  # noqa: F401

MODEL, RUNS, PARALLEL = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
AutoConfig.from_pretrained(MODEL), AutoTokenizer.from_pretrained(MODEL)  # transformers' lazy imports


async def readme_snippet() -> None:
    from pagedcore import AsyncLLMEngine

    engine = AsyncLLMEngine.from_settings(model=MODEL, num_threads=1, num_kv_blocks=64)  # same settings as LLM
    async for delta in engine.generate("Tell me a story", {"max_tokens": 100}):
        print(delta.outputs[0].text, end="", flush=True)  # leaving the loop early aborts the request
        break


def wait_one(running: set) -> int:
    pid, status = os.wait()
    running.discard(pid)
    return os.waitstatus_to_exitcode(status)  # -6: SIGABRT ("terminate called without an active exception")


def main() -> None:
    codes, running = [], set()
    for _ in range(RUNS):
        if len(running) == PARALLEL:
            codes.append(wait_one(running))
        pid = os.fork()
        if pid == 0:
            asyncio.run(readme_snippet())
            return  # the child ends here: the interpreter exits as after any script
        running.add(pid)
    while running:
        codes.append(wait_one(running))
    print("\nEXIT CODES", " ".join(map(str, codes)))


main()
