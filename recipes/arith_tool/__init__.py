"""arith_tool recipe: the arith task, where the model may call the calculator.

The loop is `partial_tool`: the model writes `<tool:calculator>EXPR</tool>`, the
environment appends `<result>VALUE</result>` (tokens with loss mask 0), and the model
goes on to its answer. The base model (recipes/arith_tool/base_model, built by
`python scripts/build_tool_model.py`) learned the call format on a fraction of its
demonstrations and answers directly on the rest, so RL can learn when calling pays.
"""


def extract_answer(response: str) -> str:
    """The text after the last tool result, up to the end of its line."""
    return response.rsplit("</result>", 1)[-1].split("\n", 1)[0].strip()
