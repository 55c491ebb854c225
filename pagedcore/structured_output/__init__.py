"""Structured output: constrained decoding to a JSON schema, a regex, a choice or a grammar.

`params.py` parses what a request asks for (vLLM's `StructuredOutputsParams` names); `backend.py` is the
interface a grammar library implements (xgrammar built in, llguidance optional, others through the
`pagedcore_structured_output_backend` hook); `manager.py` compiles off the step loop and fills one
token bitmask per step for the constrained rows; `bitmask.py` applies it to the logits.
"""

from pagedcore.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
