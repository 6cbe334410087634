"""retool_qwen recipe (GPU): Qwen2.5-1.5B-Instruct solving math with a Python sandbox,
ReTool-style: the model writes `<tool:python>code</tool>`, the sandbox's output comes
back as `<result>...</result>` (masked out of the loss), and the final answer follows
"####". Same answer check as gsm8k_qwen.
"""

from recipes.gsm8k_qwen import extract_answer

__all__ = ["extract_answer"]
