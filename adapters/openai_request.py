"""OpenAI request bodies, parsed: the fields each endpoint accepts, their types and OpenAI's rules
(openai_api.py's docstring lists the choices), into SamplingParams and the engine's request options.
Bad input raises OpenAIError naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedcore.adapters.openai_errors import OpenAIError
from pagedcore.adapters.tool_calls import ToolRequest
from pagedcore.sampling_params import InvalidRequestError, SamplingParams


# Fields each endpoint maps itself; every other SamplingParams field is an "engine extra".
_OPENAI_MAPPED = {"n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "max_tokens",
                  "stop", "logprobs"}
ENGINE_EXTRAS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - _OPENAI_MAPPED
_COMMON = {"model", "stream", "stream_options", "n", "temperature", "top_p", "presence_penalty", "frequency_penalty",
           "seed", "max_tokens", "stop", "logprobs", "logit_bias", "user", "timeout",
           "priority", "cache_salt"}  # vLLM's request extras: admission order, a tenant's own prefix cache
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of", "response_format"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
                         "functions", "function_call", "parallel_tool_calls", "store", "metadata", "service_tier",
                         "modalities", "prompt_cache_key", "safety_identifier", "reasoning_effort"}
_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def get_field(body: dict, name: str, kind: type | tuple, what: str, default: Any = None) -> Any:
    """body[name] if of `kind` (null means absent); bools are never numbers."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise OpenAIError(f"'{name}' must be {what}, got {value!r}", name)
    return value


def check_fields(body: Any, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed - ENGINE_EXTRAS)
    if unknown:
        raise OpenAIError(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError(f"'stop' must be a non-empty string or a list of them, got {stop!r}", "stop")
    return stop


def sampling_params(body: dict, max_tokens: int | None, logprobs: int | None,
                     rename: dict[str, str], structured: dict | None = None) -> SamplingParams:
    num = (int, float)
    kw: dict[str, Any] = dict(
        n=get_field(body, "n", int, "an integer", 1),
        temperature=get_field(body, "temperature", num, "a number", 1.0),
        top_p=get_field(body, "top_p", num, "a number", 1.0),
        presence_penalty=get_field(body, "presence_penalty", num, "a number", 0.0),
        frequency_penalty=get_field(body, "frequency_penalty", num, "a number", 0.0),
        seed=get_field(body, "seed", int, "an integer"),
        stop=_stop(body), max_tokens=max_tokens, logprobs=logprobs)
    kw.update({k: v for k, v in body.items() if k in ENGINE_EXTRAS and v is not None})
    kw["logit_bias"] = _logit_bias(body)
    if structured is not None:
        kw["structured_outputs"] = structured
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        param = rename.get(e.field, e.field)
        raise OpenAIError(named(str(e).replace(f"{e.field} ", f"'{param}' ", 1), param), param) from e
    except TypeError as e:  # a wrongly typed extra reaching a comparison
        raise OpenAIError(f"invalid sampling parameters: {e}") from e


def stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise OpenAIError("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = opts.get("include_usage") if isinstance(opts, dict) else "invalid"
    if include_usage is not None and not isinstance(include_usage, bool):
        raise OpenAIError(f"'stream_options' must be an object like {{\"include_usage\": true}}, got {opts!r}",
                          "stream_options")
    return bool(include_usage)


def named(message: str, param: str) -> str:
    return message if param in message else f"'{param}': {message}"


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids as strings (JSON keys) -> a bias in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if isinstance(bias, dict) and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bias.values()):
        try:
            return {int(t): float(b) for t, b in bias.items()}
        except ValueError:
            pass
    raise OpenAIError(f"'logit_bias' must map token ids to numbers in [-100, 100], got {bias!r}", "logit_bias")


def structured_outputs(body: dict, tools: ToolRequest | None) -> tuple[dict | None, str]:
    """The engine's structured_outputs from `response_format`, the `structured_outputs` extra or a
    constrained tool choice (at most one of them), and the field to name in its errors."""
    asked = {}
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        asked["response_format"] = _response_format(fmt)
    if body.get("structured_outputs") is not None:
        asked["structured_outputs"] = body["structured_outputs"]
    if tools is not None and tools.constrained:
        asked["tools"] = tools.structured_outputs()  # its errors are the functions' parameters'
    if len(asked) > 1:
        raise OpenAIError(f"{' and '.join(repr(k) for k in asked)} both constrain the output: send one of them",
                          list(asked)[1])
    return next(((v, k) for k, v in asked.items()), (None, "structured_outputs"))


def _response_format(fmt: Any) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                              "response_format")
        return {"json": schema}
    raise OpenAIError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                      f"{{\"type\": \"json_schema\", \"json_schema\": {{...}}}}, got {fmt!r}", "response_format")


def reject_unsupported(body: dict) -> None:
    if body.get("echo"):
        raise OpenAIError("'echo' is not supported", "echo")
    if body.get("suffix"):
        raise OpenAIError("'suffix' is not supported", "suffix")
    if body.get("functions") or body.get("function_call"):
        raise OpenAIError("'functions' is deprecated and not supported: use 'tools'", "functions")


def _timeout(body: dict) -> float | None:
    timeout = get_field(body, "timeout", (int, float), "a number of seconds")
    if timeout is not None and timeout <= 0:
        raise OpenAIError(f"'timeout' must be > 0 seconds, got {timeout!r}", "timeout")
    return timeout


def request_options(body: dict) -> dict:
    """vLLM's per-request extras, checked by the engine (priority needs the "priority" policy)."""
    return {"timeout": _timeout(body), "priority": get_field(body, "priority", int, "an integer", 0),
            "cache_salt": get_field(body, "cache_salt", str, "a string")}


def completion_prompts(body: dict) -> list[str | list[int]]:
    prompt = body.get("prompt")
    is_ids = lambda p: isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
    if isinstance(prompt, str) or is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise OpenAIError("'prompt' must be a string, a list of strings, a list of token ids, or a list of those",
                          "prompt")
    if any(p == "" for p in prompts):
        raise OpenAIError("'prompt' is empty", "prompt")
    return prompts


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in _CHAT_ROLES:
            raise OpenAIError(f"{param} must be an object with a role in {sorted(_CHAT_ROLES)}, got {m!r}", param)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise OpenAIError(f"{param}.content: only text parts are supported", f"{param}.content")
            content = "".join(p["text"] for p in content)
        elif content is None and m["role"] == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise OpenAIError(f"{param}.content must be a string or a list of text parts", f"{param}.content")
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        if m["role"] == "assistant" and m.get("tool_calls"):  # an earlier turn's calls, for the template
            msg["tool_calls"] = m["tool_calls"]
        if m["role"] == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out
