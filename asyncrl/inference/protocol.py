"""The inference interface agents and agent loops generate through.

Token in, token out: a prompt is token ids; the result carries every sampled token with
its logprob and the policy version that produced it (`GenerationResult`). Agent loops
depend on this, not on `EngineActor`. Implementations:
  - `StickyEngineClient` (asyncrl/rollout/router.py): one EngineActor over its request channel
    (asyncrl/inference/channel.py), in training;
  - `OpenAIInference` (asyncrl/agents/openai_inference.py): any OpenAI-compatible completions
    endpoint over HTTP (`vllm serve`, or a rollout worker's inference gateway).

Agents that are programs of their own talk chat completions instead, each episode in a session
of a `ChatSessionHost` (the rollout worker's gateway: asyncrl/rollout/chat_sessions.py), which
turns the session's turns into trajectories token-exactly.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from asyncrl.types import GenerationResult, SamplingSpec, Trajectory


@dataclass
class Endpoint:
    """Where an OpenAI-compatible completions server is and how to call it; plain data
    (a remote agent sends it to the env server)."""

    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str = ""
    api_key: str = ""


@dataclass(frozen=True)
class SessionTicket:
    """What an episode's agent process is handed: its session's OpenAI base URL and key (valid for
    this session's paths only), where it may post its reward, and the model name to ask for."""

    session_id: str
    base_url: str  # .../sessions/<id>/v1: the OpenAI client's base_url
    api_key: str
    reward_url: str  # POST {"reward": float}
    model: str


@dataclass
class SessionRecord:
    """What a closed session produced: one trajectory per branch (prompt, response segments with
    each sampled token's logprob and version; reward unset), the branch the episode ended on last;
    the reward its agent posted (None: none); its turns and its refused requests by reason."""

    branches: list[Trajectory]
    reward: float | None = None
    turns: int = 0
    refused: dict[str, int] = field(default_factory=dict)


class ChatSessionHost(ABC):
    """Serves chat sessions over HTTP; an episode opens one, its agent process talks to it, the
    episode closes it and takes its record."""

    @abstractmethod
    async def open_session(self, sampling: SamplingSpec) -> SessionTicket:
        """A new session sampling with `sampling` (its temperature and top_p; max_new_tokens bounds
        the tokens it samples over all its turns and branches)."""

    @abstractmethod
    async def rewarded(self, session_id: str) -> float:
        """Returns the reward once the session's agent posted it."""

    @abstractmethod
    def close_session(self, session_id: str) -> SessionRecord:
        """End the session: later requests to it are refused (404). Its record."""

    @abstractmethod
    def count(self, code: str, detail: str = "") -> None:
        """Count a failure of an episode (the host's run keeps the counts)."""


class InferenceInterface(ABC):
    # Capabilities: whether results carry the engine's own token ids and per-token logprobs
    # (training needs both; evaluation needs neither).
    returns_token_ids: bool = True
    returns_logprobs: bool = True
    # Where agents that are programs of their own open chat sessions (a rollout worker's gateway)
    sessions: ChatSessionHost | None = None

    @abstractmethod
    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                        request_id: str) -> GenerationResult:
        """Generate a continuation of `prompt_token_ids`."""

    def generate(self, prompt_token_ids: list[int], sampling: SamplingSpec, request_id: str) -> GenerationResult:
        """`agenerate` for synchronous callers (not from inside a running event loop)."""
        return asyncio.run(self.agenerate(prompt_token_ids, sampling, request_id))
