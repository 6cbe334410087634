"""Tool-call parsers: the calls in one assistant turn's text, by name (`tools.parser`).

  hermes  Qwen2.5 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
          number per turn. Generation runs to the end of the turn, so a turn's calls arrive
          together and run concurrently.
  simple  asyncrl's own markup `<tool:NAME>ARGUMENT</tool>`: the argument is the text of the
          tool's one parameter. Generation stops at each complete call ("</tool>").

A call the model wrote but that cannot be run still comes back, with `error` saying why
(unparsable JSON, a call not closed by the end of the turn), so that the model gets an
error message as its result and the failure is counted.

vLLM ships a Hermes parser (vllm.tool_parsers.hermes_tool_parser), but it does not fit here:
`extract_tool_calls` is all or nothing (one malformed call drops every call of the turn and
reports no call at all, so neither the good calls run nor the bad one is counted); it takes
an OpenAI `ChatCompletionRequest`; and importing it imports vLLM's OpenAI server stack (15 s
here) into processes that never import vLLM (rollout workers, the env server). Parsing a
turn's text is a regular expression and `json.loads`, as in vLLM's parser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Why a call failed; also the keys of a trajectory's info["tool_errors"] (with those of tools.run_call).
INVALID_JSON = "invalid_json"


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it. `arguments` is a JSON object, or (simple markup) the
    argument's text; `error` is set when the call cannot run (then `detail` says why)."""

    name: str
    arguments: dict[str, Any] | str
    error: str = ""
    detail: str = ""


@dataclass(frozen=True)
class ToolParser:
    """Finds the calls in one assistant turn's text; `stop` are the stop strings that end a
    generation at a complete call (kept in the output); `opening` starts every call (the chat
    endpoint's answer text is what comes before the first)."""

    name: str
    parse: Callable[[str], list[ToolCall]]
    opening: str
    stop: tuple[str, ...] = ()


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)
_SIMPLE_CALL = re.compile(r"<tool:(\w+)>(.*?)</tool>", re.S)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` of the turn, in order; an unclosed one at the end
    of the turn is a call that failed."""
    calls = []
    for closed, unclosed in _HERMES_CALL.findall(text):
        if unclosed:
            calls.append(ToolCall(_name_in(unclosed), {}, INVALID_JSON, "the call is not closed by </tool_call>"))
        else:
            calls.append(_hermes_call(closed))
    return calls


def _hermes_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(_name_in(body), {}, INVALID_JSON, f"the call is not valid JSON: {e}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", {}, INVALID_JSON, 'the call must be a JSON object {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return ToolCall(call["name"], {}, INVALID_JSON, f"the arguments are not valid JSON: {e}")
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], {}, INVALID_JSON, "the arguments must be a JSON object")
    return ToolCall(call["name"], arguments)


def _name_in(body: str) -> str:
    """The tool name of a malformed call, when it can be read (for the error message)."""
    match = re.search(r'"name"\s*:\s*"(\w+)"', body)
    return match.group(1) if match else ""


def parse_simple(text: str) -> list[ToolCall]:
    """Every `<tool:NAME>ARGUMENT</tool>` of the turn, in order."""
    return [ToolCall(name, argument) for name, argument in _SIMPLE_CALL.findall(text)]


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", parse_hermes, "<tool_call>"),
    "simple": ToolParser("simple", parse_simple, "<tool:", stop=("</tool>",)),
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool parser {name!r}; parsers: {', '.join(sorted(TOOL_PARSERS))}") from None
