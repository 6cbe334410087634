"""Stop strings across a pause: a request continued after `pause("abort")` ends where the
uninterrupted one would have.

A pause can land inside a stop string ("</to" generated, "ol>" not yet). The engine
matches stop strings only in the text the current request generates, so the continuing
request, given "...</to" as prompt, writes on past "ol>". `cut_at_split_stop` cuts its
tokens where a stop string ends that began in the tokens before it, as the engine would
have stopped. Agent loops (resuming a snapshot) and the inference gateway (continuing a
request across a sync) both continue requests this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncrl.types import GenerationResult


def cut_at_split_stop(before: list[int], result: GenerationResult, stop: Sequence[str], tokenizer: Any,
                      forwarded: int) -> GenerationResult:
    """`result` cut after the token that completes a stop string begun in `before` (the tokens
    the same generation produced before the pause), finish "stop"; else `result` itself.
    `forwarded` is the length of the request's input (its routes cover it and k - 1 tokens).
    Decodes at most one token per character of the longest stop string."""
    stop = [s for s in stop if len(s) > 1]  # a single character cannot be split
    if not stop or not before or not result.token_ids:
        return result
    longest = max(len(s) for s in stop)
    before = before[-longest:]
    head = tokenizer.decode(before)
    if not any(head.endswith(s[:j]) for s in stop for j in range(1, len(s))):
        return result
    for k in range(1, min(len(result.token_ids), longest) + 1):
        text = tokenizer.decode(before + result.token_ids[:k])
        if any(s in text[max(0, len(head) - len(s) + 1):] for s in stop):
            routes = result.routes.prefix(forwarded + k - 1) if result.routes is not None else None
            return GenerationResult(result.token_ids[:k], result.logprobs[:k], result.versions[:k], "stop", routes)
    return result
