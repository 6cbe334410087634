"""Tools with OpenAI function schemas: the schemas a prompt offers, and calls checked against them.

A call runs only once it names a known tool and its arguments pass the tool's JSON Schema
(`jsonschema`); otherwise the model gets an "error: ..." message as the call's result and
the reason is counted (`CallResult.error`, the keys of info["tool_errors"]):
  invalid_json       the call is not a JSON object with a name and arguments (the parser);
  unknown_tool       no tool has that name;
  invalid_arguments  the arguments fail the tool's schema;
  timeout            the tool ran longer than tools.timeout_s;
  tool_exception     the tool raised.
Each tool receives one parameter as text (`ToolSpec.argument`); simple markup
(`<tool:NAME>ARGUMENT</tool>`) fills that parameter with the text between its tags.
"""

from __future__ import annotations

import asyncio
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
    """A tool's OpenAI function schema, and the parameter its function receives as text."""

    schema: dict[str, Any]
    argument: str


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


def tool_schemas(names: list[str] | None = None) -> list[dict[str, Any]]:
    """The OpenAI function schemas of the named tools (all of them by default), for a prompt."""
    return [TOOL_SPECS[name].schema for name in (names if names is not None else sorted(TOOL_SPECS))]


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
    arguments = call.arguments if isinstance(call.arguments, dict) else {spec.argument: call.arguments}
    problem = _schema_problem(call.name, arguments)
    if problem:
        return CallResult(call.name, f"error: arguments of {call.name!r}: {problem}", INVALID_ARGUMENTS)
    output, error = await run_tool(call.name, arguments[spec.argument], tools)
    return CallResult(call.name, output, error)


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
