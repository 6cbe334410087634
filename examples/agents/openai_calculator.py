"""A calculator agent written with the plain `openai` client: no asyncrl import.

It answers one problem a run (its JSON on stdin: prompt, messages, tools) by chatting with the
model behind OPENAI_BASE_URL (the `openai` client reads it and OPENAI_API_KEY from the
environment), running the calculator the model calls and sending back its results, turn after
turn, until the model answers without a call. It posts no reward: the run scores the answer.

    asyncrl train recipe=arith_openai     # asyncrl runs one of these per episode
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

from openai import OpenAI

MAX_TURNS = 4
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, or "error: ..."."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        result = value(ast.parse(expression.strip()[:200], mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, RecursionError) as e:
        return f"error: {e}"
    return str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)


def main() -> None:
    problem = json.load(sys.stdin)
    client = OpenAI()
    messages = list(problem["messages"]) or [{"role": "user", "content": problem["prompt"]}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=os.environ.get("ASYNCRL_MODEL", "asyncrl"), messages=messages,
                                               tools=problem["tools"] or None)
        message = reply.choices[0].message
        messages.append(message.model_dump())  # the whole message back, as most agents keep it
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            output = calculator(str(arguments.get("expression", ""))) if call.function.name == "calculator" \
                else f"error: no tool {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    print(json.dumps({"answer": messages[-1].get("content"), "turns": len(messages)}))


if __name__ == "__main__":
    main()
