"""The C heap keeps freed step activations (pagedcore/heap_tuning.py): no fresh pages for the next step's."""

import resource
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from pagedcore import heap_tuning
if sys.argv[1] == "tuned" and not heap_tuning.install():
    print("no-mallopt"); sys.exit(0)
if sys.argv[1] == "untuned":  # glibc's starting threshold, kept: where its dynamic one lands depends on the process
    import ctypes, ctypes.util
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(heap_tuning.M_MMAP_THRESHOLD, 128 << 10)
def step():  # a prompt step's pattern: several activations of a few MB alive at once, then all freed
    live = [torch.empty(6 << 20, dtype=torch.uint8).fill_(1) for _ in range(8)]
    del live
step()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int | None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True)
    last = out.stdout.split()[-1]
    return None if last == "no-mallopt" else int(last)


def test_freed_activations_are_not_faulted_in_again():
    tuned = _faults("tuned")
    if tuned is None:
        pytest.skip("the C library has no mallopt (not glibc)")
    untuned = _faults("untuned")
    pages = 4 * 8 * (6 << 20) // resource.getpagesize()  # what four steps touch
    assert untuned > pages // 2, f"{untuned} page faults untuned: the pattern does not show the cost"
    assert tuned < pages // 10, f"{tuned} page faults over 4 steps with the heap tuned ({pages} pages touched)"


def test_the_engine_tunes_the_heap_on_cpu(tiny_model_dir):
    from pagedcore import heap_tuning
    from pagedcore.llm_engine import LLMEngine

    LLMEngine(model=str(tiny_model_dir("llama")), dtype="float32", num_kv_blocks=16)
    assert heap_tuning._done or not heap_tuning.install()
