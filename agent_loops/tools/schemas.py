"""Tools with OpenAI function schemas: the schemas a prompt offers, and calls checked against them.

A call runs only once it names a known tool and its arguments pass the tool's JSON Schema
(`jsonschema`); otherwise the model gets an "error: ..." message as the call's result and
the reason is counted (`CallResult.error`, the keys of info["tool_errors"]):
  invalid_json       the call is not a JSON object with a name and arguments (the parser);
  unknown_tool       no tool has that name;
  invalid_arguments  the arguments fail the tool's schema;
  timeout            the tool ran longer than tools.timeout_s;
  tool_exception     the tool raised.
The built-in tools receive one parameter as text (`ToolSpec.argument`); simple markup
(`<tool:NAME>ARGUMENT</tool>`) fills that parameter with the text between its tags. A tool of
your own (`register_tool`) receives its arguments as keyword arguments; in simple markup the
text between the tags is then its JSON object of arguments.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from agent_loops.tool_parsers import ToolCall
from agent_loops.tools import TOOLS, run_tool, unknown_tool
from asyncrl.config.schema import ToolsConfig

UNKNOWN_TOOL = "unknown_tool"
INVALID_ARGUMENTS = "invalid_arguments"


@dataclass(frozen=True)
class ToolSpec:
    """A tool's OpenAI function schema, and the parameter its function receives as text ("":
    the function takes every argument as a keyword, `register_tool`)."""

    schema: dict[str, Any]
    argument: str = ""


def _function(name: str, description: str, parameter: str, parameter_description: str) -> ToolSpec:
    schema = {"type": "function", "function": {
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {parameter: {"type": "string", "description": parameter_description}},
            "required": [parameter],
            "additionalProperties": False,
        },
    }}
    return ToolSpec(schema, parameter)


TOOL_SPECS: dict[str, ToolSpec] = {
    "calculator": _function("calculator", "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                            "expression", "The expression, e.g. (17 - 5) * 3"),
    "python": _function("python", "Run a Python program in a sandbox and return what it prints.",
                        "code", "The program; print the values you need"),
}
BUILTIN_TOOLS = frozenset(TOOL_SPECS)


def tool_schemas(names: list[str] | None = None) -> list[dict[str, Any]]:
    """The OpenAI function schemas of the named tools (all of them by default), for a prompt."""
    unknown = [name for name in names or [] if name not in TOOL_SPECS]
    if unknown:
        raise KeyError(f"unknown tool(s) {unknown}; registered: {', '.join(sorted(TOOL_SPECS))}")
    return [TOOL_SPECS[name].schema for name in (names if names is not None else sorted(TOOL_SPECS))]


def register_tool(schema: dict[str, Any], function: Callable[..., Any]) -> None:
    """Offer a tool of your own: its OpenAI function schema and the Python function that runs a
    call. The function gets the call's arguments as keyword arguments, already checked against
    the schema's `parameters` (JSON Schema), and returns the text the model sees; an async
    function is awaited, a plain one runs in a thread. Every call is bounded by tools.timeout_s,
    and an exception becomes an error result for the model (counted as tool_exception). Call it
    when your recipe's module (`recipe.module`) is imported: rollout workers and env servers
    import that module before they run a loop.

        register_tool({"type": "function", "function": {"name": "lookup", "description": "...",
                       "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                      "required": ["key"]}}}, lookup)
    """
    function_schema = schema.get("function") if isinstance(schema, dict) else None
    name = function_schema.get("name") if isinstance(function_schema, dict) else None
    if not isinstance(name, str) or not name.isidentifier() or schema.get("type") != "function":
        raise ValueError('a tool schema is {"type": "function", "function": {"name": IDENTIFIER, "description": ..., '
                         '"parameters": {...}}}')
    if name in BUILTIN_TOOLS:
        raise ValueError(f"{name!r} is a built-in tool; give yours another name")
    parameters = function_schema.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f"tool {name!r}: its parameters must be a JSON Schema of type object")
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.exceptions.SchemaError as e:
        raise ValueError(f"tool {name!r}: its parameters are not a valid JSON Schema: {e.message}") from None
    if not callable(function):
        raise ValueError(f"tool {name!r}: {function!r} is not callable")

    async def run(argument: str, sandbox: Any) -> str:  # TOOLS' signature: the arguments as JSON text
        arguments = json.loads(argument) if argument.strip() else {}
        if not isinstance(arguments, dict):
            raise ValueError("the arguments must be a JSON object")
        if inspect.iscoroutinefunction(function):
            return str(await function(**arguments))
        return str(await asyncio.to_thread(function, **arguments))

    TOOLS[name] = run
    TOOL_SPECS[name] = ToolSpec({"type": "function", "function": {**function_schema, "parameters": parameters}})


@dataclass(frozen=True)
class CallResult:
    """What the model gets back for one call, and why it failed ("" when it ran)."""

    name: str
    output: str
    error: str = ""


async def run_call(call: ToolCall, tools: ToolsConfig) -> CallResult:
    """Check `call` and run it under tools.timeout_s; every failure becomes an error result."""
    if call.error:
        return CallResult(call.name, f"error: {call.detail}", call.error)
    spec = TOOL_SPECS.get(call.name)
    if spec is None or call.name not in TOOLS:
        return CallResult(call.name, unknown_tool(call.name), UNKNOWN_TOOL)
    arguments = call.arguments
    if not isinstance(arguments, dict):  # simple markup: the one parameter's text, or the arguments as JSON
        arguments = {spec.argument: arguments} if spec.argument else _json_object(arguments)
        if arguments is None:
            return CallResult(call.name, f"error: arguments of {call.name!r}: not a JSON object", INVALID_ARGUMENTS)
    problem = _schema_problem(call.name, arguments)
    if problem:
        return CallResult(call.name, f"error: arguments of {call.name!r}: {problem}", INVALID_ARGUMENTS)
    text = arguments[spec.argument] if spec.argument else json.dumps(arguments)
    output, error = await run_tool(call.name, text, tools)
    return CallResult(call.name, output, error)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


async def run_calls(calls: list[ToolCall], tools: ToolsConfig) -> list[CallResult]:
    """Every call of one turn, concurrently; results in the calls' order."""
    return list(await asyncio.gather(*(run_call(call, tools) for call in calls)))


def _schema_problem(name: str, arguments: dict[str, Any]) -> str:
    """What is wrong with the arguments ("" when they pass the schema)."""
    error = jsonschema.exceptions.best_match(_validator(name).iter_errors(arguments))
    if error is None:
        return ""
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


def _validator(name: str) -> jsonschema.protocols.Validator:
    parameters = TOOL_SPECS[name].schema["function"]["parameters"]
    return jsonschema.validators.validator_for(parameters)(parameters)
