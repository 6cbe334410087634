"""arith_tool recipe: the arith task as a chat, where the model may call the calculator.

The loop is `chat_tool`: each problem is a conversation offering the calculator (data.tools),
rendered with the model's own chat template; the model calls it the Hermes way, the
environment appends the template's tool turn (tokens with loss mask 0), and the model goes
on to its answer ("Answer: 5", as in arith). The base model (recipes/arith_tool/base_model,
built by `python scripts/build_tool_model.py` from the arith base; recipes/arith_tool/tool_sft.py)
learned the call format on a fraction of its demonstrations and answers directly on the
rest, so RL can learn when calling pays. It also writes asyncrl's `<tool:calculator>` markup
on a plain prompt (the partial_tool loop).
"""


from recipes.arith import extract_answer  # the text after the last "Answer:"

__all__ = ["extract_answer"]
