"""arith recipe: reasoning-gym arithmetic for the tiny base model.

Data: the `data` section of config.yaml (reasoning-gym's basic_arithmetic, fixed seeds,
a 500-problem held-out split). Reward: reasoning-gym's own scorer on the extracted
answer. Base model: recipes/arith/base_model, built by scripts/build_base_model.py.
"""


def extract_answer(response: str) -> str:
    """The model answers on the line after "Answer: "; anything after a newline is ignored."""
    return response.split("\n", 1)[0].strip()
