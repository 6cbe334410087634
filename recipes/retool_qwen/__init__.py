"""retool_qwen recipe (GPU): Qwen2.5-1.5B-Instruct solving math with a Python sandbox,
ReTool-style: each problem is a conversation offering the `python` tool, rendered with
Qwen's own chat template; the model calls it the Hermes way
(`<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>`), the sandbox's
output comes back as the template's tool turn (masked out of the loss), and the final
answer follows "####". Same answer check as gsm8k_qwen.
"""

from recipes.gsm8k_qwen import extract_answer

__all__ = ["extract_answer"]
