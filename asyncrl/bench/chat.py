"""`asyncrl bench chat`: what the chat endpoint costs on top of the token endpoint, on the same engine.

    asyncrl bench chat recipe=arith_openai bench.max_new_tokens=48     # 64 sessions x 3 turns

In one run, one engine (a Ray actor) behind one rollout gateway in this process (served on
loopback, as a rollout worker serves it), and `bench.num_prompts` concurrent multi-turn
conversations of `bench.chat_turns` turns, each turn at most `bench.max_new_tokens` tokens with
the recipe's sampling, a user message ("Go on.") between turns:
  (a) token endpoint: `POST /v1/completions` with token ids over httpx; the client keeps the
      conversation as tokens itself (the template's rendering of each new message appended to
      what was sampled), the best a token-level agent can do;
  (b) chat endpoint: the real `openai` client (`AsyncOpenAI`), one session per conversation,
      resending the whole conversation as messages each turn, as chat agents do.
Both sample the same distribution (the chat template's end of turn stops both). `bench.rounds`
rounds alternate which side goes first; the ratio is the median of the per-round ratios of
tokens/s. The chat endpoint's own cost per turn (checks, prefix match, rendering, parsing the
answer: everything but generation) is measured inside the endpoint. Last line, one JSON object:
  {"bench": "chat", "token_tok_s", "chat_tok_s", "ratio", "overhead_ms_per_turn", ...}
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import replace
from typing import Any

import httpx
import ray

from asyncrl import actors
from asyncrl.bench.config import BenchConfig
from asyncrl.config import Config
from asyncrl.types import SamplingSpec

USER_TURN = {"role": "user", "content": "Go on."}


async def _token_conversation(http: httpx.AsyncClient, url: str, key: str, chat: Any, messages: list[dict],
                              tools: list[dict], turns: int, max_tokens: int, temperature: float) -> int:
    """(a): one conversation over /v1/completions, kept as tokens by the client; tokens generated."""
    eot = chat.end_of_turn
    ids, tokens = chat.prompt(messages, tools), 0
    for turn in range(turns):
        if turn:
            ids += chat.append_ids([USER_TURN], ids[-len(eot.closing):])
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": temperature}
        r = await http.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
        r.raise_for_status()
        sampled = r.json()["choices"][0]["token_ids"]
        ids, tokens = ids + sampled, tokens + len(sampled)
    return tokens


async def _chat_conversation(http: httpx.AsyncClient, sessions: Any, sampling: SamplingSpec, messages: list[dict],
                             tools: list[dict], turns: int, max_tokens: int) -> int:
    """(b): one conversation through the chat endpoint with the `openai` client (over the side's one
    HTTP client, as the example agents share theirs); tokens generated."""
    import openai

    ticket = await sessions.open_session(sampling)
    client = openai.AsyncOpenAI(base_url=ticket.base_url, api_key=ticket.api_key, max_retries=0, http_client=http)
    tokens = 0
    try:
        messages = list(messages)
        for turn in range(turns):
            if turn:
                messages.append(USER_TURN)
            reply = await client.chat.completions.create(model=ticket.model, messages=messages, tools=tools,
                                                         max_tokens=max_tokens)
            messages.append(reply.choices[0].message.model_dump())
            tokens += reply.usage.completion_tokens
    finally:
        sessions.close_session(ticket.session_id)
    return tokens


async def measure(gateway: Any, problems: list[Any], sampling: SamplingSpec, turns: int, max_tokens: int,
                  rounds: int, warmup_rounds: int = 0, settle_s: float = 0.0) -> dict[str, Any]:
    """Both sides on `gateway` (chat sessions on, served), `rounds` times (module docstring)."""
    from agent_loops.chat import chat_format

    endpoint, sessions = await gateway.serve(), gateway.sessions
    chat = chat_format(gateway.tokenizer)
    limits = httpx.Limits(max_connections=len(problems), max_keepalive_connections=len(problems))

    async def side(name: str) -> tuple[int, float]:
        t0 = time.monotonic()
        async with httpx.AsyncClient(limits=limits, timeout=600) as http:
            if name == "token":
                jobs = [_token_conversation(http, f"{endpoint.base_url}/completions", endpoint.api_key, chat,
                                            p.messages, p.tools, turns, max_tokens, sampling.temperature)
                        for p in problems]
            else:
                jobs = [_chat_conversation(http, sessions, sampling, p.messages, p.tools, turns, max_tokens)
                        for p in problems]
            tokens = sum(await asyncio.gather(*jobs))
        return tokens, time.monotonic() - t0

    for _ in range(warmup_rounds):
        await side("token")
        await side("chat")
    rates: dict[str, list[float]] = {"token": [], "chat": []}
    sessions.turns, sessions.overhead_s = 0, 0.0
    for r in range(rounds):
        for name in ("token", "chat") if r % 2 == 0 else ("chat", "token"):
            await asyncio.sleep(settle_s)  # the engine's processes have stopped polling
            tokens, seconds = await side(name)
            rates[name].append(tokens / seconds)
        print(f"round {r}: token endpoint {rates['token'][-1]:.0f} tok/s, chat endpoint "
              f"{rates['chat'][-1]:.0f} tok/s", flush=True)
    ratios = [c / t for t, c in zip(rates["token"], rates["chat"])]
    return {
        "bench": "chat",
        "token_tok_s": round(statistics.median(rates["token"]), 1),
        "chat_tok_s": round(statistics.median(rates["chat"]), 1),
        "ratio": round(statistics.median(ratios), 3),
        "round_ratios": [round(x, 3) for x in ratios],
        "overhead_ms_per_turn": round(1e3 * sessions.overhead_s / max(1, sessions.turns), 3),
        "chat_turns": sessions.turns,
        "sessions": len(problems),
        "turns": turns,
        "max_tokens_per_turn": max_tokens,
        "rounds": rounds,
    }


async def _chat_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from asyncrl.agents.registry import build_agents
    from asyncrl.rollout.chat_sessions import ChatSettings
    from asyncrl.rollout.gateway import InferenceGateway
    from asyncrl.rollout.router import EngineRouter

    agent = next(iter(build_agents(cfg).agents.values()))
    one = replace(cfg, engine=replace(cfg.engine, num_engines=1))
    (engine,) = actors.create_engines(one, stream=False)
    await engine.start.remote()
    gateway = InferenceGateway(EngineRouter([engine]).client, agent.tokenizer,
                               chat=ChatSettings(cfg.tools.parser, cfg.engine.max_model_len, cfg.reward.max_abs))
    turns, max_tokens = bench.chat_turns, bench.max_new_tokens
    sampling = SamplingSpec(max_new_tokens=turns * max_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p)
    try:
        return await measure(gateway, agent.problems("heldout")[: bench.num_prompts], sampling, turns, max_tokens,
                             bench.rounds, bench.warmup_rounds, bench.settle_s)
    finally:
        await gateway.stop()
        ray.kill(engine)


def run_chat_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    actors.start_local_ray(cfg, dashboard=False, log_to_driver=False)
    try:
        return asyncio.run(_chat_bench(cfg, bench))
    finally:
        ray.shutdown()
