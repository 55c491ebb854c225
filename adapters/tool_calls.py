"""OpenAI tool calling over the engine's structured output: the engine knows nothing about tools.

A tool call is written by the model as JSON, `{"name": ..., "arguments": {...}}` (a list of them for
several), the format SmolLM2 and Hermes-style models are trained on, inside `<tool_call>...</tool_call>`
when the model chooses to call (`tool_choice: "auto"`).

  * "required": the output is constrained to a non-empty JSON list of calls, each to a listed function
    with arguments valid for its `parameters` (one call when `parallel_tool_calls` is false);
  * a named function: constrained to one call of it;
  * "auto": unconstrained; a `<tool_call>` block naming a listed function becomes `tool_calls`, anything
    else stays content;
  * "none": the tools are not shown to the model and nothing is parsed.

Chat templates that render `tools` get them; templates that ignore them (the bundled SmolLM2's) get
them in a system message in SmolLM2's own tool-calling format.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()


class ToolChoiceError(ValueError):
    """Bad `tools` / `tool_choice`; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolRequest:
    functions: dict[str, dict]  # name -> its `parameters` JSON schema
    tools: list[dict]  # as the request sent them, for the chat template
    choice: str  # "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def structured_outputs(self) -> dict | None:
        """The engine's `structured_outputs` for the constrained choices, None for "auto"."""
        if self.choice == "named":
            return {"json": _call_schema(self.named, self.functions[self.named])}
        if self.choice == "required":
            calls = {"anyOf": [_call_schema(n, p) for n, p in self.functions.items()]}
            return {"json": {"type": "array", "items": calls, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}}
        return None

    def system_prompt(self) -> str:
        """SmolLM2's tool-calling instructions, for templates that do not render `tools` themselves."""
        return ("You are an expert in composing functions. You are given a question and a set of possible functions. "
                "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. "
                "If none of the functions can be used, point it out and do not call any.\n\n"
                f"You have access to the following tools:\n<tools>{json.dumps(self.tools)}</tools>\n\n"
                "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
                f'{TOOL_CALL_START}[{{"name": "func_name1", "arguments": {{"argument1": "value1"}}}}, '
                f'... (more tool calls as required)]{TOOL_CALL_END}')


    def fallback_messages(self, messages: list[dict]) -> list[dict]:
        """`messages` for a template that ignores `tools`: the tools in the system message, earlier
        calls as the model writes them."""
        out = [_as_text(m) for m in messages]
        if out[0]["role"] == "system":
            return [{"role": "system", "content": f"{out[0]['content']}\n\n{self.system_prompt()}"}, *out[1:]]
        return [{"role": "system", "content": self.system_prompt()}, *out]


def _as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return {"role": message["role"], "content": message["content"]}
    written = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}
               for c in calls]
    return {"role": message["role"], "content": f"{message['content']}{TOOL_CALL_START}{json.dumps(written)}{TOOL_CALL_END}"}


def _call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_request(body: dict) -> ToolRequest | None:
    """The request's tools and tool choice, checked; None when no tool can be called."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolChoiceError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolChoiceError("'tools' must be a list of {type: function, function: {...}} objects", "tools")
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolChoiceError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                  f"\"parameters\": {{...}}}}}} (only function tools are supported)", "tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions[fn["name"]] = params
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else bool(parallel)
    if choice in (None, "auto"):
        return ToolRequest(functions, tools, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolRequest(functions, tools, "required", parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        else None
    if not isinstance(name, str):
        raise ToolChoiceError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
    if name not in functions:
        raise ToolChoiceError(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                              f"({', '.join(functions)})", "tool_choice")
    return ToolRequest(functions, tools, "named", named=name, parallel=parallel)


# ---- reading the calls out of the text ---------------------------------------------------------------

@dataclass
class ParsedCall:
    name: str | None = None
    arguments: str = ""  # the arguments' JSON text so far
    complete: bool = False


def scan_calls(text: str) -> list[ParsedCall]:
    """The calls in `text`, a prefix of one call object or a list of them: each call's name once it is
    complete, and its arguments' text as far as it goes (so a stream can send it as it grows)."""
    calls: list[ParsedCall] = []
    i = _ws(text, 0)
    if text[i:i + 1] == "[":
        i += 1
    while True:
        i = _ws(text, i, ",")
        if text[i:i + 1] != "{":
            return calls
        call = ParsedCall()
        calls.append(call)
        i = _ws(text, i + 1, ",")
        while text[i:i + 1] != "}":
            try:
                key, i = _DECODER.raw_decode(text, i)
            except ValueError:
                return calls
            i = _ws(text, i)
            if text[i:i + 1] != ":":
                return calls
            i = _ws(text, i + 1)
            try:
                value, end = _DECODER.raw_decode(text, i)
            except ValueError:
                if key in ("arguments", "parameters"):
                    call.arguments = text[i:].rstrip()
                return calls
            if key == "name" and isinstance(value, str):
                call.name = value
            elif key in ("arguments", "parameters"):
                call.arguments = text[i:end]
            i = _ws(text, end, ",")
        call.complete = call.name is not None
        i += 1


def _ws(text: str, i: int, also: str = "") -> int:
    while i < len(text) and (text[i].isspace() or text[i] in also):
        i += 1
    return i


def tool_call_text(text: str, req: ToolRequest) -> str | None:
    """The part of the output that holds the calls (None: it is content): the whole output when the
    calls were constrained; for "auto", a `<tool_call>` block's inside."""
    if req.constrained:
        return text
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return None
    inside = text[start + len(TOOL_CALL_START):]
    return inside.split(TOOL_CALL_END, 1)[0]


def parse_tool_calls(text: str, req: ToolRequest) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output, OpenAI's shapes. An "auto" output whose calls do not
    parse, or name a function not in `tools`, is content."""
    inside = tool_call_text(text, req)
    calls = scan_calls(inside) if inside is not None else []
    good = [c for c in calls if c.complete and c.name in req.functions and _is_object(c.arguments)]
    if not good or (not req.constrained and len(good) != len(calls)):
        return text, []
    content = None if req.constrained else (text[:text.find(TOOL_CALL_START)].strip() or None)
    return content, [_call(c.name, c.arguments) for c in good]


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolCallStream:
    """One streamed choice: turns its growing text into `delta.content` or `delta.tool_calls` pieces
    (a call's id, type and name first, then its arguments as they are generated)."""

    req: ToolRequest
    text: str = ""
    sent_content: int = 0  # characters of `text` sent as content
    sent_args: list[int] = field(default_factory=list)  # per call: characters of its arguments sent

    def feed(self, new_text: str, finished: bool) -> dict:
        """The delta for `new_text` ({} when there is nothing to send yet)."""
        self.text += new_text
        inside = tool_call_text(self.text, self.req)
        if inside is None:
            if not finished and self._may_start_call():
                return {}  # hold what may be the start of "<tool_call>"
            content, self.sent_content = self.text[self.sent_content:], len(self.text)
            return {"content": content} if content else {}
        deltas = []
        for i, call in enumerate(scan_calls(inside)):
            if call.name not in self.req.functions:
                break  # not yet complete (or not a listed function: it is never sent)
            piece = call.arguments[self.sent_args[i]:] if i < len(self.sent_args) else call.arguments
            if i == len(self.sent_args):
                self.sent_args.append(0)
                deltas.append({"index": i, **_call(call.name, piece)})
            elif piece:
                deltas.append({"index": i, "function": {"arguments": piece}})
            self.sent_args[i] = len(call.arguments)
        return {"tool_calls": deltas} if deltas else {}

    def _may_start_call(self) -> bool:
        tail = self.text[self.sent_content:].lstrip()
        return not self.sent_content and TOOL_CALL_START.startswith(tail)

    @property
    def called(self) -> bool:
        return bool(self.sent_args)
