"""The OpenAI API over an AsyncLLMEngine: JSON bodies in, OpenAI JSON objects or SSE lines out.

Framework-neutral: no web framework is imported here. `OpenAIServing.completions(body)` and
`.chat_completions(body)` take the decoded JSON body and return either a dict (the response) or,
for `stream: true`, an async iterator of SSE strings (`data: {...}\\n\\n` ... `data: [DONE]\\n\\n`).
Bad input raises `OpenAIError` (HTTP status + OpenAI error body) before anything is streamed.
Closing the returned iterator, or cancelling the call, aborts the engine request(s).

Choices made where OpenAI leaves room or the engine differs:
  * defaults as OpenAI: temperature 1.0, top_p 1.0, n 1; `max_tokens` 16 for completions,
    unlimited for chat (up to the model's context, which the engine enforces: finish "length").
  * chat: `max_completion_tokens` wins over the deprecated `max_tokens`; `top_logprobs` needs
    `logprobs: true`; role "developer" is sent to the template as "system".
  * engine extras in the body (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
    `stop_token_ids`, `best_of`, `use_beam_search`, `length_penalty`, ...: every SamplingParams
    field without an OpenAI name) go to SamplingParams unchanged.
  * unknown body fields are a 400 naming the field (as OpenAI does); a few OpenAI fields with no
    meaning here (`user`, `metadata`, `store`, ...) are accepted and ignored; unsupported
    features (`functions`, `echo`, `suffix`) are a 400.
  * structured output: `response_format` (`json_object`, `json_schema`) and the engine extra
    `structured_outputs` (vLLM's) constrain the output (the engine's grammar); `logit_bias` as OpenAI's
    (token id strings -> [-100, 100]).
  * tools (chat): `tools` + `tool_choice` ("auto", "none", "required", a named function) through
    tool_calls.py: `required` / named are constrained to calls whose arguments fit the function's
    `parameters`; streamed as `delta.tool_calls`; `finish_reason` "tool_calls" when the model called.
  * `timeout` (seconds, an extra): the request's deadline; past it the request is aborted (408, or
    an error event mid-stream). Engine limits (README "Limits and failure behaviour") map to 400
    (too long, too many), 429 + Retry-After (overload), 503 + Retry-After (shutting down, unhealthy).
  * LoRA adapters (engine started with enable_lora): `model` names the base model or a held adapter
    (404 `model_not_found` for anything else); /v1/models lists both, adapters with `parent` the base.
    `load_lora_adapter` / `unload_lora_adapter` (vLLM's routes and bodies) change the held adapters
    at run time, only when the door allows it (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: reading
    any path the server can see is not for every client), else 403.
  * `usage.completion_tokens` counts every generated token of the returned choices, the final
    EOS or stop token included; `prompt_tokens` is the tokenized prompt (chat: after the template).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

from pagedcore.adapters.tool_calls import ToolCallStream, ToolChoiceError, ToolRequest, parse_tool_calls, tool_request
from pagedcore.limits import OverloadedError, RequestFailedError, RequestTimeoutError
from pagedcore.lora.request import LoRARequest, UnknownLoRAError
from pagedcore.outputs import CompletionOutput, OutputKind, RequestOutput
from pagedcore.sampling_params import InvalidRequestError, SamplingParams


class OpenAIError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def engine_error(e: Exception) -> OpenAIError | None:
    """The client's view of an engine refusal or failure (None: not one of the engine's)."""
    if isinstance(e, OverloadedError):
        unavailable = e.reason == "unavailable"
        return OpenAIError(str(e), status=503 if unavailable else 429, code=e.reason,
                           type="service_unavailable" if unavailable else "overloaded_error",
                           headers={"Retry-After": str(max(1, round(e.retry_after)))})
    if isinstance(e, RequestTimeoutError):
        return OpenAIError(str(e), "timeout", status=408, type="timeout_error", code="request_timeout")
    if isinstance(e, RequestFailedError):
        return OpenAIError(str(e), status=500, type="server_error", code="generation_failed")
    return None


def _raise_engine_error(e: BaseException) -> None:
    mapped = engine_error(e) if isinstance(e, Exception) else None
    if mapped is not None:
        raise mapped from e


# ---- request parsing ------------------------------------------------------------------------------

def _get(body: dict, name: str, kind: type | tuple, what: str, default: Any = None) -> Any:
    """body[name] if of `kind` (null means absent); bools are never numbers."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise OpenAIError(f"'{name}' must be {what}, got {value!r}", name)
    return value


def _check_fields(body: Any, allowed: set[str]) -> None:
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


def _sampling_params(body: dict, max_tokens: int | None, logprobs: int | None,
                     rename: dict[str, str], structured: dict | None = None) -> SamplingParams:
    num = (int, float)
    kw: dict[str, Any] = dict(
        n=_get(body, "n", int, "an integer", 1),
        temperature=_get(body, "temperature", num, "a number", 1.0),
        top_p=_get(body, "top_p", num, "a number", 1.0),
        presence_penalty=_get(body, "presence_penalty", num, "a number", 0.0),
        frequency_penalty=_get(body, "frequency_penalty", num, "a number", 0.0),
        seed=_get(body, "seed", int, "an integer"),
        stop=_stop(body), max_tokens=max_tokens, logprobs=logprobs)
    kw.update({k: v for k, v in body.items() if k in ENGINE_EXTRAS and v is not None})
    kw["logit_bias"] = _logit_bias(body)
    if structured is not None:
        kw["structured_outputs"] = structured
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        param = rename.get(e.field, e.field)
        raise OpenAIError(_named(str(e).replace(f"{e.field} ", f"'{param}' ", 1), param), param) from e
    except TypeError as e:  # a wrongly typed extra reaching a comparison
        raise OpenAIError(f"invalid sampling parameters: {e}") from e


def _stream_options(body: dict, stream: bool) -> bool:
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


def _named(message: str, param: str) -> str:
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


def _structured_outputs(body: dict, tools: ToolRequest | None) -> tuple[dict | None, str]:
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


def _reject_unsupported(body: dict) -> None:
    if body.get("echo"):
        raise OpenAIError("'echo' is not supported", "echo")
    if body.get("suffix"):
        raise OpenAIError("'suffix' is not supported", "suffix")
    if body.get("functions") or body.get("function_call"):
        raise OpenAIError("'functions' is deprecated and not supported: use 'tools'", "functions")


def _timeout(body: dict) -> float | None:
    timeout = _get(body, "timeout", (int, float), "a number of seconds")
    if timeout is not None and timeout <= 0:
        raise OpenAIError(f"'timeout' must be > 0 seconds, got {timeout!r}", "timeout")
    return timeout


def _request_options(body: dict) -> dict:
    """vLLM's per-request extras, checked by the engine (priority needs the "priority" policy)."""
    return {"timeout": _timeout(body), "priority": _get(body, "priority", int, "an integer", 0),
            "cache_salt": _get(body, "cache_salt", str, "a string")}


def _completion_prompts(body: dict) -> list[str | list[int]]:
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


def _chat_messages(body: dict) -> list[dict]:
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


# ---- responses --------------------------------------------------------------------------------------

@dataclass
class _Choice:
    """One choice's state while streaming."""

    index: int
    num_tokens: int = 0
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    finish_reason: str | None = None
    started: bool = False  # chat: the role chunk was sent
    tool_stream: ToolCallStream | None = None  # chat with tools: content or tool_calls deltas


class OpenAIServing:
    """Completions, chat completions and models over one AsyncLLMEngine."""

    def __init__(self, engine, model_name: str, aliases: tuple[str, ...] = (), allow_lora_updates: bool = False):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.accepted_names = {model_name, *aliases}
        self.allow_lora_updates = allow_lora_updates
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    def models(self) -> dict:
        base = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedcore"}
        loras = [{"id": a.name, "object": "model", "created": self.created, "owned_by": "pagedcore",
                  "root": a.path, "parent": self.model_name} for a in self.engine.list_loras()]
        return {"object": "list", "data": [base, *loras]}

    # ---- LoRA adapters at run time (vLLM's routes) -------------------------------------------------
    async def load_lora_adapter(self, body: Any) -> dict:
        self._check_lora_updates(body, {"lora_name", "lora_path", "lora_int_id"})
        name = _get(body, "lora_name", str, "a string")
        path = _get(body, "lora_path", str, "a string")
        int_id = _get(body, "lora_int_id", int, "an integer") or self.engine.engine.next_lora_int_id()
        if not name or not path:
            raise OpenAIError("'lora_name' and 'lora_path' are required", "lora_name" if not name else "lora_path")
        if name in self.accepted_names:
            raise OpenAIError(f"'lora_name' {name!r} is the base model's name", "lora_name")
        try:  # reads the adapter's files: off the event loop
            await asyncio.to_thread(self.engine.add_lora, LoRARequest(name, int_id, path))
        except ValueError as e:  # LoRALoadError (an InvalidRequestError), or LoRARequest's own checks
            raise OpenAIError(str(e), "lora_path") from e
        return {"object": "lora_adapter", "id": name, "loaded": True}

    async def unload_lora_adapter(self, body: Any) -> dict:
        self._check_lora_updates(body, {"lora_name", "lora_int_id"})
        name = _get(body, "lora_name", str, "a string")
        if not self.engine.remove_lora(name or ""):
            raise OpenAIError(f"LoRA adapter {name!r} is not loaded", "lora_name", status=404, code="model_not_found")
        return {"object": "lora_adapter", "id": name, "loaded": False}

    def _check_lora_updates(self, body: Any, fields: set[str]) -> None:
        if not self.allow_lora_updates:
            raise OpenAIError("loading and unloading LoRA adapters at run time is off on this server (start it "
                              "with PAGEDCORE_ALLOW_RUNTIME_LORA_UPDATING=true)", status=403, type="permission_error")
        if not self.engine.config.enable_lora:
            raise OpenAIError("this server runs without LoRA (start it with PAGEDCORE_ENABLE_LORA=true)")
        _check_fields(body, fields)

    # ---- endpoints --------------------------------------------------------------------------------
    async def completions(self, body: Any) -> dict | AsyncIterator[str]:
        _check_fields(body, COMPLETION_FIELDS)
        options = _request_options(body)
        model = self._check_model(body, options)
        _reject_unsupported(body)
        prompts = _completion_prompts(body)
        stream = _get(body, "stream", bool, "a boolean", False)
        include_usage = _stream_options(body, stream)
        logprobs = _get(body, "logprobs", int, "an integer (the number of top logprobs)")
        structured, field = _structured_outputs(body, None)
        params = _sampling_params(body, _get(body, "max_tokens", int, "an integer", 16), logprobs,
                                  {"structured_outputs": field}, structured)
        return await self._run("cmpl", "text_completion", prompts, params, stream, include_usage, chat=False,
                               options=options, model=model, field=field)

    async def chat_completions(self, body: Any) -> dict | AsyncIterator[str]:
        _check_fields(body, CHAT_FIELDS)
        options = _request_options(body)
        model = self._check_model(body, options)
        _reject_unsupported(body)
        messages = _chat_messages(body)
        try:
            tools = tool_request(body)
        except ToolChoiceError as e:
            raise OpenAIError(str(e), e.param) from e
        structured, field = _structured_outputs(body, tools)
        stream = _get(body, "stream", bool, "a boolean", False)
        include_usage = _stream_options(body, stream)
        want_logprobs = _get(body, "logprobs", bool, "a boolean", False)
        top = _get(body, "top_logprobs", int, "an integer", None)
        if top is not None and not want_logprobs:
            raise OpenAIError("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _get(body, max_name, int, "an integer", None)
        params = _sampling_params(body, max_tokens, (top or 0) if want_logprobs else None,
                                  {"logprobs": "top_logprobs", "max_tokens": max_name, "structured_outputs": field},
                                  structured)
        try:
            prompt = self._chat_prompt(messages, tools)
        except Exception as e:  # the template itself refuses (e.g. role order)
            raise OpenAIError(f"the chat template rejected 'messages': {e}", "messages") from e
        return await self._run("chatcmpl", "chat.completion", [prompt], params, stream, include_usage, chat=True,
                               options=options, model=model, field=field, tools=tools)

    def _chat_prompt(self, messages: list[dict], tools: ToolRequest | None) -> list[int]:
        """The template's token ids; with tools, rendered by the template or, where it ignores them, put in
        a system message (tool_calls.py), earlier calls written as the model writes them."""
        render = lambda msgs, **kw: list(self.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=False, **kw))
        if tools is None:
            return render(messages)
        with_tools = render(messages, tools=tools.tools)
        if with_tools != render(messages):
            return with_tools
        return render(tools.fallback_messages(messages))

    # ---- the engine side ----------------------------------------------------------------------------
    def _check_model(self, body: dict, options: dict) -> str:
        """The model name the response carries; an adapter's name sets options["lora_request"]."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise OpenAIError("'model' must be a string", "model")
        if model is None or model in self.accepted_names:
            return self.model_name
        loras = [a.name for a in self.engine.list_loras()]
        if model not in loras:
            raise _model_not_found(model, [self.model_name, *loras])
        options["lora_request"] = model
        return model

    async def _run(self, prefix: str, obj: str, prompts: list, params: SamplingParams, stream: bool,
                   include_usage: bool, chat: bool, options: dict, model: str, field: str = "structured_outputs",
                   tools: ToolRequest | None = None) -> dict | AsyncIterator[str]:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        gens = [self.engine.generate(p, params, f"{rid}-{i}", kind, **options) for i, p in enumerate(prompts)]
        try:
            # Start every request now: invalid input (e.g. a prompt over the context) raises here,
            # before a streamed response has begun.
            firsts = [await g.__anext__() for g in gens]
        except UnknownLoRAError as e:  # unloaded since _check_model
            await _close_all(gens)
            raise _model_not_found(e.lora_name, [self.model_name, *(a.name for a in self.engine.list_loras())]) from e
        except InvalidRequestError as e:
            await _close_all(gens)
            param = ("messages" if chat else "prompt") if e.field == "prompt" else e.field
            param = field if param == "structured_outputs" else param  # the grammar did not compile
            message = _named(str(e), param)
            raise OpenAIError(message, param) from e
        except BaseException as e:
            await _close_all(gens)
            _raise_engine_error(e)
            raise
        if stream:
            return self._stream(rid, obj + ".chunk" if chat else obj, gens, firsts, params, include_usage, chat, model,
                                tools)
        try:
            finals = [first if first.finished else await _last(g) for g, first in zip(gens, firsts)]
        except Exception as e:
            _raise_engine_error(e)
            raise
        finally:
            await _close_all(gens)
        return self._response(rid, obj, finals, params, chat, model, tools)

    def _response(self, rid: str, obj: str, finals: list[RequestOutput], params: SamplingParams, chat: bool,
                  model: str, tools: ToolRequest | None = None) -> dict:
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                index = i * params.n + c.index
                lps = self._logprobs(c, params, chat, 0)
                if chat:
                    message, finish = _message(c, tools)
                    choices.append({"index": index, "message": message, "logprobs": lps, "finish_reason": finish})
                else:
                    choices.append({"index": index, "text": c.text, "logprobs": lps, "finish_reason": _finish(c)})
        return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
                "choices": choices, "usage": _usage(finals, sum(len(c.token_ids) for o in finals for c in o.outputs))}

    async def _stream(self, rid: str, obj: str, gens: list, firsts: list[RequestOutput], params: SamplingParams,
                      include_usage: bool, chat: bool, model: str, tools: ToolRequest | None = None
                      ) -> AsyncIterator[str]:
        created = int(time.time())
        choices: dict[int, _Choice] = {}
        prompt_outputs: dict[int, RequestOutput] = {}

        def chunk(choice_list: list[dict], usage: dict | None = None) -> str:
            out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choice_list}
            if include_usage:
                out["usage"] = usage
            return sse(out)

        try:
            async with aclosing(_merge(gens, firsts)) as merged:
                async for i, out in merged:
                    prompt_outputs[i] = out
                    batch = []
                    for c in out.outputs:
                        index = i * params.n + c.index
                        st = choices.setdefault(index, _Choice(index))
                        if st.finish_reason is not None:
                            continue  # a finished choice reappears (empty) while its siblings run
                        st.num_tokens += len(c.token_ids)
                        lps = self._logprobs(c, params, chat, st.text_offset) if c.token_ids else None
                        if lps is not None and not chat:
                            st.text_offset += sum(len(t) for t in lps["tokens"])
                        st.finish_reason = _finish(c)
                        if not (c.text or lps or st.finish_reason or (chat and not st.started)):
                            continue
                        if chat:
                            delta = _delta(st, c.text, tools)
                            if not st.started:
                                delta = {"role": "assistant", **({"content": ""} if not delta else delta)}
                            st.started = True
                            if st.finish_reason is not None and st.tool_stream is not None \
                                    and st.tool_stream.called:
                                st.finish_reason = "tool_calls"
                            if not (delta or lps or st.finish_reason):
                                continue
                            batch.append({"index": index, "delta": delta, "logprobs": lps,
                                          "finish_reason": st.finish_reason})
                        else:
                            batch.append({"index": index, "text": c.text, "logprobs": lps,
                                          "finish_reason": st.finish_reason})
                    if batch:
                        yield chunk(batch)
            if include_usage:
                finals = [prompt_outputs[i] for i in sorted(prompt_outputs)]
                yield chunk([], _usage(finals, sum(st.num_tokens for st in choices.values())))
        except InvalidRequestError as e:  # refused by the engine thread after the first output
            yield sse(OpenAIError(str(e), e.field).body())
        except Exception as e:  # the engine ended this request (timeout, a failed step): tell the client, end
            yield sse((engine_error(e) or OpenAIError(f"generation failed: {e}", type="server_error", status=500)).body())
        finally:
            await _close_all(gens)
        yield sse("[DONE]")

    # ---- logprobs -------------------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprobs(self, c: CompletionOutput, params: SamplingParams, chat: bool, text_offset: int) -> dict | None:
        if params.logprobs is None or c.logprobs is None:
            return None
        if chat:
            content = []
            for tid, step in zip(c.token_ids, c.logprobs):
                ranked = sorted((lp.rank, t, lp.logprob) for t, lp in step.items() if lp.rank is not None)
                content.append({**self._lp_entry(tid, step[tid].logprob),
                                "top_logprobs": [self._lp_entry(t, lp) for _, t, lp in ranked[:params.logprobs]]})
            return {"content": content}
        tokens, offsets = [self._token(t) for t in c.token_ids], []
        for tok in tokens:
            offsets.append(text_offset)
            text_offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)],
                "top_logprobs": [{self._token(t): lp.logprob for t, lp in step.items()} for step in c.logprobs],
                "text_offset": offsets}

    def _lp_entry(self, token_id: int, logprob: float) -> dict:
        tok = self._token(token_id)
        return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8", errors="replace"))}


def _message(c: CompletionOutput, tools: ToolRequest | None) -> tuple[dict, str | None]:
    """A chat choice's message and finish reason: its tool calls, if it made any."""
    if tools is None:
        return {"role": "assistant", "content": c.text}, _finish(c)
    content, calls = parse_tool_calls(c.text, tools)
    if not calls:
        return {"role": "assistant", "content": content}, _finish(c)
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def _delta(st: _Choice, text: str, tools: ToolRequest | None) -> dict:
    """A streamed chat choice's delta: its text, or with tools, its content / tool_calls pieces."""
    if tools is None:
        return {"content": text} if text else {}
    if st.tool_stream is None:
        st.tool_stream = ToolCallStream(tools)
    return st.tool_stream.feed(text, st.finish_reason is not None)


def _model_not_found(name: str, available: list[str]) -> OpenAIError:
    return OpenAIError(f"The model `{name}` does not exist. Available: {', '.join(available)}", "model",
                       status=404, code="model_not_found")


def _finish(c: CompletionOutput) -> str | None:
    return c.finish_reason if c.finish_reason in (None, "stop", "length") else "stop"


def _usage(finals: list[RequestOutput], completion_tokens: int) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for last in gen:
        pass
    return last


async def _close_all(gens: list) -> None:
    for g in gens:
        await g.aclose()  # aborts the engine request if it is unfinished


async def _merge(gens: list, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several engine streams as they come; `firsts` already read."""
    for i, first in enumerate(firsts):
        yield i, first
    live = [i for i, first in enumerate(firsts) if not first.finished]
    if len(live) == 1:  # the usual case: no tasks needed
        async with aclosing(gens[live[0]]) as g:
            async for out in g:
                yield live[0], out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in gens[i]:
                await queue.put((i, out, None))
        except Exception as e:
            await queue.put((i, None, e))
        await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i)) for i in live]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
