"""The OpenAPI 3 document of the OpenAI routes (served at /v1/openapi.json by the BentoML door).

The routes parse their JSON bodies themselves (openai_request.py), so FastAPI cannot infer this: it is
written out here, field for field as openai_request.py accepts them, with OpenAI's own ranges. Clients
and fuzzers (tests/test_fuzz_openai.py, schemathesis) read it; the server does not validate with it.
"""

from __future__ import annotations


def _nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

_SAMPLING = {
    "model": _STR,
    "stream": _nullable(_BOOL),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": _BOOL},
                                 "additionalProperties": False}),
    "n": _nullable({**_INT, "minimum": 1, "maximum": 128}),
    "temperature": _nullable({**_NUM, "minimum": 0, "maximum": 2}),
    "top_p": _nullable({**_NUM, "minimum": 0, "exclusiveMinimum": True, "maximum": 1}),
    "presence_penalty": _nullable({**_NUM, "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({**_NUM, "minimum": -2, "maximum": 2}),
    "seed": _nullable(_INT),
    "max_tokens": _nullable({**_INT, "minimum": 1}),
    "stop": _nullable({"oneOf": [{**_STR, "minLength": 1},
                                 {"type": "array", "items": {**_STR, "minLength": 1}, "maxItems": 4}]}),
    "user": _STR,
    "logit_bias": _nullable({"type": "object", "additionalProperties": {**_NUM, "minimum": -100, "maximum": 100}}),
    # structured output: OpenAI's response_format, or vLLM's structured_outputs extra (one of them)
    "response_format": _nullable({"oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"type": "string", "enum": ["json_schema"]},
            "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
                "name": _STR, "schema": {"type": "object"}, "strict": _nullable(_BOOL)}}}}]}),
    "structured_outputs": _nullable({"type": "object", "minProperties": 1, "maxProperties": 1, "properties": {
        "json": {"type": "object"}, "regex": {**_STR, "minLength": 1}, "grammar": {**_STR, "minLength": 1},
        "choice": {"type": "array", "items": {**_STR, "minLength": 1}, "minItems": 1},
        "json_object": {"type": "boolean", "enum": [True]}}, "additionalProperties": False}),
    # engine extras (vLLM's names; openai_request.ENGINE_EXTRAS): the common ones, any SamplingParams field is accepted
    "top_k": _nullable({**_INT, "minimum": -1}),
    "min_p": _nullable({**_NUM, "minimum": 0, "maximum": 1}),
    "repetition_penalty": _nullable({**_NUM, "exclusiveMinimum": True, "minimum": 0}),
    "min_tokens": _nullable({**_INT, "minimum": 0}),
    "ignore_eos": _nullable(_BOOL),
    "stop_token_ids": _nullable({"type": "array", "items": {**_INT, "minimum": 0}}),
    # request extras (vLLM's): seconds to the deadline, admission order (lower first; needs the engine's
    # "priority" scheduling policy), a tenant's salt keeping its prefix cache apart
    "timeout": _nullable({**_NUM, "exclusiveMinimum": True, "minimum": 0}),
    "priority": _nullable(_INT),
    "cache_salt": _nullable({**_STR, "minLength": 1}),
}

_COMPLETION = {
    "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
    "properties": {
        **_SAMPLING,
        "prompt": {"oneOf": [{**_STR, "minLength": 1}, _TOKEN_IDS,
                             {"type": "array", "minItems": 1, "items": {"oneOf": [{**_STR, "minLength": 1}, _TOKEN_IDS]}}]},
        "logprobs": _nullable({**_INT, "minimum": 0, "maximum": 5}),
        "best_of": _nullable({**_INT, "minimum": 1}),
    },
}

_MESSAGE = {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
                   "content": {"oneOf": [_STR, {"type": "array", "items": {
                       "type": "object", "required": ["type", "text"],
                       "properties": {"type": {"type": "string", "enum": ["text"]}, "text": _STR}}}]},
                   "name": _STR, "tool_call_id": _STR,  # role "tool": the call it answers
                   "tool_calls": {"type": "array", "items": {  # role "assistant": the calls it made
                       "type": "object", "required": ["id", "type", "function"], "properties": {
                           "id": _STR, "type": {"type": "string", "enum": ["function"]},
                           "function": {"type": "object", "required": ["name", "arguments"],
                                        "properties": {"name": _STR, "arguments": _STR}}}}}},
}

_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {**_STR, "minLength": 1}, "description": _STR, "parameters": {"type": "object"},
        "strict": _nullable(_BOOL)}}}}

_CHAT = {
    "type": "object", "required": ["model", "messages"], "additionalProperties": False,
    "properties": {
        **_SAMPLING,
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": _nullable({**_INT, "minimum": 1}),
        "logprobs": _nullable(_BOOL),
        "top_logprobs": _nullable({**_INT, "minimum": 0, "maximum": 20}),
        "tools": _nullable({"type": "array", "items": _TOOL}),
        "tool_choice": _nullable({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": _STR}}}}]}),
        "parallel_tool_calls": _nullable(_BOOL),
    },
}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {**_STR, "minLength": 1}, "type": _STR, "param": _nullable(_STR),
                   "code": _nullable(_STR)}}}}


def _responses(ok: str) -> dict:
    error = {"content": {"application/json": {"schema": _ERROR}}}
    return {"200": {"description": ok},
            "400": {"description": "invalid request (the message names the field)", **error},
            "404": {"description": "unknown model", **error},
            "429": {"description": "overloaded: retry after the Retry-After header's seconds", **error},
            "503": {"description": "not ready or shutting down", **error}}


def _post(summary: str, body: dict) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True,
                                                          "content": {"application/json": {"schema": body}}},
                     "responses": _responses("the completion, or an SSE stream of chunks when stream is true")}}


def _lora_route(summary: str, required: list[str]) -> dict:
    body = {"type": "object", "required": required, "additionalProperties": False,
            "properties": {"lora_name": {**_STR, "minLength": 1}, "lora_path": {**_STR, "minLength": 1},
                           "lora_int_id": _nullable(_INT)}}
    error = {"content": {"application/json": {"schema": _ERROR}}}
    route = _post(summary, body)
    route["post"]["responses"] = {"200": {"description": "done"},
                                  "400": {"description": "a bad adapter (the message says why)", **error},
                                  "403": {"description": "run-time LoRA updates are off on this server", **error},
                                  "404": {"description": "unload: no adapter of that name", **error}}
    return route


def openapi_document() -> dict:
    return {
        "openapi": "3.0.3",
        "info": {"title": "pagedcore OpenAI-compatible API", "version": "1"},
        "servers": [{"url": "/v1"}],  # where the door mounts the routes
        "paths": {
            "/models": {"get": {"summary": "the served model and its LoRA adapters", "responses": {"200": {"description": "models"}}}},
            "/completions": _post("text completion", _COMPLETION),
            "/chat/completions": _post("chat completion", _CHAT),
            "/load_lora_adapter": _lora_route("load a PEFT LoRA adapter (vLLM's route; opt-in)", ["lora_name", "lora_path"]),
            "/unload_lora_adapter": _lora_route("unload a LoRA adapter (vLLM's route; opt-in)", ["lora_name"]),
        },
    }
