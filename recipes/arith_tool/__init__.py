"""arith_tool recipe: the arith task, where the model may call the calculator.

The loop is `partial_tool`: the model writes `<tool:calculator>EXPR</tool>`, the
environment appends `<result>VALUE</result>` (tokens with loss mask 0), and the model
goes on to its answer ("Answer: 5", as in arith). The base model
(recipes/arith_tool/base_model, built by `python scripts/build_tool_model.py` from the arith
base) learned the call format on a fraction of its demonstrations and answers directly on
the rest, so RL can learn when calling pays.
"""


from recipes.arith import extract_answer  # the text after the last "Answer:"

__all__ = ["extract_answer"]
