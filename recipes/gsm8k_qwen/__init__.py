"""gsm8k_qwen recipe (GPU): Qwen2.5-Instruct on GSM8K from a local file the user gives.

The model is asked to end with "#### <number>"; the reward is 1 when that number (or,
without the marker, the last number in the response) equals the reference.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(response: str) -> str:
    """The number after the last "####", else the last number in the response."""
    tail = response.rsplit("####", 1)[1] if "####" in response else response
    numbers = NUMBER.findall(tail)
    if not numbers:
        return ""
    return (numbers[0] if "####" in response else numbers[-1]).replace(",", "")
