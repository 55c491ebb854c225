"""pagedcore: a paged-KV-cache, continuously batching LLM inference engine."""

import gc
import importlib
from contextlib import contextmanager

from pagedcore.config import EngineConfig
from pagedcore.hookspecs import hookimpl
from pagedcore.limits import (EngineDeadError, LimitExceededError, OverloadedError, RequestFailedError,
                              RequestTimeoutError)
from pagedcore.outputs import CompletionOutput, Logprob, OutputKind, RequestOutput
from pagedcore.sampling_params import InvalidRequestError, SamplingParams

__all__ = [
    "LLM", "LLMEngine", "AsyncLLMEngine", "LoRARequest", "EngineConfig", "SamplingParams", "InvalidRequestError",
    "RequestOutput", "CompletionOutput", "Logprob", "OutputKind", "hookimpl",
    "LimitExceededError", "OverloadedError", "EngineDeadError", "RequestTimeoutError", "RequestFailedError",
]
__version__ = "0.1.0"


@contextmanager
def gc_paused():
    """Run start-up work (importing torch/transformers, loading a model) with the cyclic GC off.

    That work creates ~400k long-lived objects and little garbage, yet the collector re-scans
    them at every threshold (7 full passes): ~1 s of a ~4 s cold start. On the way out, one
    young-generation pass frees that garbage and moves the survivors to the oldest generation,
    as the collector would have, once.
    """
    if not gc.isenabled():  # nested, or the caller turned GC off: leave it as it is
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(1)


# The engine classes import torch and transformers: load them only when asked for.
_LAZY = {"LLM": "pagedcore.llm", "LLMEngine": "pagedcore.llm_engine", "AsyncLLMEngine": "pagedcore.async_engine",
         "LoRARequest": "pagedcore.lora.request"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(name)
    with gc_paused():
        value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value
