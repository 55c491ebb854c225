"""The OpenAI API over an AsyncLLMEngine: JSON bodies in, OpenAI JSON objects or SSE lines out.

Framework-neutral: no web framework is imported here. `OpenAIServing.completions(body)` and
`.chat_completions(body)` take the decoded JSON body and return either a dict (the response) or,
for `stream: true`, an async iterator of SSE strings (`data: {...}\\n\\n` ... `data: [DONE]\\n\\n`).
Bad input raises `OpenAIError` (HTTP status + OpenAI error body) before anything is streamed.
Closing the returned iterator, or cancelling the call, aborts the engine request(s). Beside it:
openai_request.py parses the bodies, openai_models.py serves /v1/models and the LoRA routes,
openai_errors.py maps the engine's refusals to HTTP errors.

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
import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

from pagedcore.adapters.openai_errors import OpenAIError, engine_error, raise_engine_error
from pagedcore.adapters.openai_models import OpenAIServingModels
from pagedcore.adapters.openai_request import (CHAT_FIELDS, COMPLETION_FIELDS, chat_messages, check_fields,
                                               completion_prompts, get_field, named, reject_unsupported,
                                               request_options, sampling_params, stream_options, structured_outputs)
from pagedcore.adapters.tool_calls import ToolCallStream, ToolChoiceError, ToolRequest, parse_tool_calls, tool_request
from pagedcore.lora.request import UnknownLoRAError
from pagedcore.outputs import CompletionOutput, OutputKind, RequestOutput
from pagedcore.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["OpenAIError", "OpenAIServing", "engine_error", "sse"]


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


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
        self.serving_models = OpenAIServingModels(engine, model_name, aliases, allow_lora_updates)
        self._token_text: dict[int, str] = {}

    # ---- models and LoRA adapters (openai_models.py) ------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.serving_models.model_name

    @property
    def allow_lora_updates(self) -> bool:
        return self.serving_models.allow_lora_updates

    @allow_lora_updates.setter
    def allow_lora_updates(self, allow: bool) -> None:
        self.serving_models.allow_lora_updates = allow

    def models(self) -> dict:
        return self.serving_models.models()

    async def load_lora_adapter(self, body: Any) -> dict:
        return await self.serving_models.load_lora_adapter(body)

    async def unload_lora_adapter(self, body: Any) -> dict:
        return await self.serving_models.unload_lora_adapter(body)

    # ---- endpoints --------------------------------------------------------------------------------
    async def completions(self, body: Any) -> dict | AsyncIterator[str]:
        check_fields(body, COMPLETION_FIELDS)
        options = request_options(body)
        model = self.serving_models.check_model(body, options)
        reject_unsupported(body)
        prompts = completion_prompts(body)
        stream = get_field(body, "stream", bool, "a boolean", False)
        include_usage = stream_options(body, stream)
        logprobs = get_field(body, "logprobs", int, "an integer (the number of top logprobs)")
        structured, field = structured_outputs(body, None)
        params = sampling_params(body, get_field(body, "max_tokens", int, "an integer", 16), logprobs,
                                 {"structured_outputs": field}, structured)
        return await self._run("cmpl", "text_completion", prompts, params, stream, include_usage, chat=False,
                               options=options, model=model, field=field)

    async def chat_completions(self, body: Any) -> dict | AsyncIterator[str]:
        check_fields(body, CHAT_FIELDS)
        options = request_options(body)
        model = self.serving_models.check_model(body, options)
        reject_unsupported(body)
        messages = chat_messages(body)
        try:
            tools = tool_request(body)
        except ToolChoiceError as e:
            raise OpenAIError(str(e), e.param) from e
        structured, field = structured_outputs(body, tools)
        stream = get_field(body, "stream", bool, "a boolean", False)
        include_usage = stream_options(body, stream)
        want_logprobs = get_field(body, "logprobs", bool, "a boolean", False)
        top = get_field(body, "top_logprobs", int, "an integer", None)
        if top is not None and not want_logprobs:
            raise OpenAIError("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = get_field(body, max_name, int, "an integer", None)
        params = sampling_params(body, max_tokens, (top or 0) if want_logprobs else None,
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
            raise self.serving_models.not_found(e.lora_name) from e
        except InvalidRequestError as e:
            await _close_all(gens)
            param = ("messages" if chat else "prompt") if e.field == "prompt" else e.field
            param = field if param == "structured_outputs" else param  # the grammar did not compile
            message = named(str(e), param)
            raise OpenAIError(message, param) from e
        except BaseException as e:
            await _close_all(gens)
            raise_engine_error(e)
            raise
        if stream:
            return self._stream(rid, obj + ".chunk" if chat else obj, gens, firsts, params, include_usage, chat, model,
                                tools)
        try:
            finals = [first if first.finished else await _last(g) for g, first in zip(gens, firsts)]
        except Exception as e:
            raise_engine_error(e)
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
