"""multi_task recipe: several environments in one run (see config.yaml).

The answer hook is arith's (the tiny base model answers on the line after "Answer: ");
`retry_env` is the multi-turn, reward-only environment.
"""

from recipes.arith import extract_answer

__all__ = ["extract_answer"]
