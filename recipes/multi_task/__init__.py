"""multi_task recipe: several environments in one run (see config.yaml).

Every env prompts "...\\nAnswer: ", so the answer is the response's first line;
`retry_env` is the multi-turn, reward-only environment.
"""


def extract_answer(response: str) -> str:
    """The model answers right after the prompt's "Answer: "; anything after a newline is ignored."""
    return response.split("\n", 1)[0].strip()
