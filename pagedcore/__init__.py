"""pagedcore: a paged-KV-cache, continuously batching LLM inference engine."""

from pagedcore.config import EngineConfig
from pagedcore.hookspecs import hookimpl
from pagedcore.outputs import CompletionOutput, Logprob, OutputKind, RequestOutput
from pagedcore.sampling_params import InvalidRequestError, SamplingParams

__all__ = [
    "LLM", "LLMEngine", "AsyncLLMEngine", "EngineConfig", "SamplingParams", "InvalidRequestError",
    "RequestOutput", "CompletionOutput", "Logprob", "OutputKind", "hookimpl",
]
__version__ = "0.1.0"


def __getattr__(name):
    # The engine classes import torch and transformers: load them only when asked for.
    if name == "LLM":
        from pagedcore.llm import LLM
        return LLM
    if name == "LLMEngine":
        from pagedcore.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLMEngine":
        from pagedcore.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    raise AttributeError(name)
