"""`asyncrl bench chat`: what the chat endpoint costs on top of the token endpoint, on the same engine.

    asyncrl bench chat recipe=arith_openai bench.max_new_tokens=48     # 64 conversations x 3 turns
    ... engine.cpu_cores=0 rollout.cpu_cores=1   # the engine on a core of its own, the rest on the other

In one run, one engine (a Ray actor) behind one rollout gateway in this process (served on
loopback, as a rollout worker serves it), and `bench.num_prompts` concurrent multi-turn
conversations of `bench.chat_turns` turns, each turn at most `bench.max_new_tokens` tokens with
the recipe's sampling, a user message ("Go on.") between turns. The conversations are played by a
client process of their own, as agent programs are (`python -m asyncrl.bench.chat`, which times
them from its first request to its last answer):
  (a) token endpoint: `POST /v1/completions` with token ids over httpx; the client keeps the
      conversation as tokens itself (the template's rendering of each new message appended to
      what was sampled), with the chat endpoint's stops (the end-of-turn token; a tool call's
      end when tools are offered), the best a token-level agent can do;
  (b) chat endpoint: the real `openai` client (`AsyncOpenAI`, one HTTP client shared), one
      session per conversation, resending the whole conversation as messages each turn, as chat
      agents do;
  (c) chat endpoint, plain HTTP: (b)'s requests as JSON over httpx, without the SDK: the endpoint's
      cost apart from the `openai` SDK's in the agent's process.
All sample the same distribution (the chat template's end of turn stops them). `bench.rounds`
rounds rotate which side goes first; a ratio is the median of the per-round ratios of tokens/s
to the token side's. The chat endpoint's own cost per turn (checks, prefix match, rendering, parsing the
answer: everything but generation) is measured inside the endpoint. Last line, one JSON object:
  {"bench": "chat", "token_tok_s", "chat_tok_s", "ratio", "ratio_plain_http", "overhead_ms_per_turn", ...}
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import httpx

from asyncrl.bench.config import BenchConfig
from asyncrl.config import Config
from asyncrl.types import SamplingSpec

USER_TURN = {"role": "user", "content": "Go on."}
SIDES = ("token", "chat", "chat_http")  # (a), (b), (c) of the module docstring


# -- the client process: `python -m asyncrl.bench.chat` < job ------------------------------------

async def _token_conversation(http: httpx.AsyncClient, job: dict[str, Any], chat: Any, conversation: dict) -> int:
    """(a): one conversation over /v1/completions, kept as tokens by the client; tokens generated."""
    from agent_loops.tool_parsers import get_tool_parser

    ids, tokens = chat.prompt(conversation["messages"], conversation["tools"]), 0
    # the chat endpoint's stops: the end of turn, and a tool call's end when tools are offered
    stop = [*chat.end_of_turn.stop, *(get_tool_parser(job["tool_parser"]).stop if conversation["tools"] else ())]
    for turn in range(job["turns"]):
        if turn:
            ids += chat.append_ids([USER_TURN], ids[-len(chat.end_of_turn.closing):])
        body = {"prompt": ids, "max_tokens": job["max_tokens"], "temperature": job["temperature"], "stop": stop,
                "stop_token_ids": list(chat.end_of_turn.stop_token_ids)}
        r = await http.post(job["token_url"], json=body, headers={"Authorization": f"Bearer {job['token_key']}"})
        r.raise_for_status()
        sampled = r.json()["choices"][0]["token_ids"]
        ids, tokens = ids + sampled, tokens + len(sampled)
    return tokens


async def _chat_conversation(http: httpx.AsyncClient, job: dict[str, Any], conversation: dict) -> int:
    """(b): one conversation through the chat endpoint with the `openai` client; tokens generated."""
    import openai

    client = openai.AsyncOpenAI(base_url=conversation["base_url"], api_key=conversation["api_key"], max_retries=0,
                                http_client=http)
    messages, tokens = list(conversation["messages"]), 0
    for turn in range(job["turns"]):
        if turn:
            messages.append(USER_TURN)
        reply = await client.chat.completions.create(model=conversation["model"], messages=messages,
                                                     tools=conversation["tools"] or None,
                                                     max_tokens=job["max_tokens"])
        messages.append(reply.choices[0].message.model_dump())
        tokens += reply.usage.completion_tokens
    return tokens


async def _chat_http_conversation(http: httpx.AsyncClient, job: dict[str, Any], conversation: dict) -> int:
    """(c): (b)'s conversation as JSON over httpx, no SDK; tokens generated."""
    url, key = f"{conversation['base_url']}/chat/completions", conversation["api_key"]
    messages, tokens = list(conversation["messages"]), 0
    for turn in range(job["turns"]):
        if turn:
            messages.append(USER_TURN)
        body = {"model": conversation["model"], "messages": messages, "max_tokens": job["max_tokens"],
                **({"tools": conversation["tools"]} if conversation["tools"] else {})}
        r = await http.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
        r.raise_for_status()
        answer = r.json()
        messages.append(answer["choices"][0]["message"])
        tokens += answer["usage"]["completion_tokens"]
    return tokens


async def _play(job: dict[str, Any]) -> dict[str, float]:
    """A side's conversations, all at once; the tokens they generated and the seconds they took."""
    chat = None
    if job["side"] == "token":
        from agent_loops.chat import chat_format
        from asyncrl.agents.api import load_tokenizer

        chat = chat_format(load_tokenizer(job["tokenizer_path"], job["chat_template"]))
    n = len(job["conversations"])
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        t0 = time.monotonic()
        play = {"token": functools.partial(_token_conversation, chat=chat), "chat": _chat_conversation,
                "chat_http": _chat_http_conversation}[job["side"]]
        jobs = [play(http, job, conversation=c) for c in job["conversations"]]
        cpu0 = time.process_time()
        tokens = sum(await asyncio.gather(*jobs))
        return {"tokens": tokens, "seconds": time.monotonic() - t0, "cpu_s": time.process_time() - cpu0}


# -- the benchmark --------------------------------------------------------------------------------

async def _side(job: dict[str, Any]) -> tuple[int, float, float]:
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "asyncrl.bench.chat", stdin=pipe, stdout=pipe,
                                                stderr=pipe)
    out, err = await proc.communicate(json.dumps(job).encode())
    if proc.returncode != 0:
        raise RuntimeError(f"the {job['side']} side's client failed ({proc.returncode}): {err.decode()[-2000:]}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    return result["tokens"], result["seconds"], result["cpu_s"]


async def measure(gateway: Any, problems: list[Any], sampling: SamplingSpec, turns: int, max_tokens: int,
                  rounds: int, tokenizer_path: str, chat_template: str = "", warmup_rounds: int = 0,
                  settle_s: float = 0.0) -> dict[str, Any]:
    """Both sides on `gateway` (chat sessions on), `rounds` times (module docstring)."""
    endpoint, sessions = await gateway.serve(), gateway.sessions
    base = {"turns": turns, "max_tokens": max_tokens, "temperature": sampling.temperature,
            "tokenizer_path": tokenizer_path, "chat_template": chat_template,
            "tool_parser": sessions.settings.tool_parser,
            "token_url": f"{endpoint.base_url}/completions", "token_key": endpoint.api_key}

    async def side(name: str) -> tuple[int, float, float]:
        if name == "token":
            return await _side({**base, "side": name, "conversations": [
                {"messages": p.messages, "tools": p.tools} for p in problems]})
        tickets = [await sessions.open_session(sampling) for _ in problems]
        try:
            return await _side({**base, "side": name, "conversations": [
                {"messages": p.messages, "tools": p.tools, "base_url": t.base_url, "api_key": t.api_key,
                 "model": t.model} for p, t in zip(problems, tickets)]})
        finally:
            for t in tickets:
                sessions.close_session(t.session_id)

    for _ in range(warmup_rounds):
        for name in SIDES:
            await side(name)
    rates: dict[str, list[float]] = {name: [] for name in SIDES}
    # CPU seconds per 1000 tokens of the client process and of this one (the gateway's), per side
    client_cpu: dict[str, list[float]] = {name: [] for name in SIDES}
    gateway_cpu: dict[str, list[float]] = {name: [] for name in SIDES}
    sessions.turns, sessions.overhead_s = 0, 0.0
    for r in range(rounds):
        for name in SIDES[r % 3:] + SIDES[:r % 3]:
            await asyncio.sleep(settle_s)  # the engine's processes have stopped polling
            cpu0 = time.process_time()
            tokens, seconds, cpu_s = await side(name)
            rates[name].append(tokens / seconds)
            client_cpu[name].append(1e3 * cpu_s / tokens)
            gateway_cpu[name].append(1e3 * (time.process_time() - cpu0) / tokens)
        print(f"round {r}: token endpoint {rates['token'][-1]:.0f} tok/s, chat endpoint "
              f"{rates['chat'][-1]:.0f} tok/s (plain HTTP {rates['chat_http'][-1]:.0f})", flush=True)
    ratios = [c / t for t, c in zip(rates["token"], rates["chat"])]
    http_ratios = [c / t for t, c in zip(rates["token"], rates["chat_http"])]
    return {
        "bench": "chat",
        "token_tok_s": round(statistics.median(rates["token"]), 1),
        "chat_tok_s": round(statistics.median(rates["chat"]), 1),
        "chat_http_tok_s": round(statistics.median(rates["chat_http"]), 1),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_plain_http": round(statistics.median(http_ratios), 3),
        "round_ratios": [round(x, 3) for x in ratios],
        "overhead_ms_per_turn": round(1e3 * sessions.overhead_s / max(1, sessions.turns), 3),
        "client_cpu_s_per_1k_tokens": {k: round(statistics.median(v), 3) for k, v in client_cpu.items()},
        "gateway_cpu_s_per_1k_tokens": {k: round(statistics.median(v), 3) for k, v in gateway_cpu.items()},
        "chat_turns": sessions.turns,
        "sessions": len(problems),
        "turns": turns,
        "max_tokens_per_turn": max_tokens,
        "rounds": rounds,
    }


async def _chat_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    import ray

    from asyncrl import actors
    from asyncrl.agents.registry import build_agents
    from asyncrl.cpu_cores import bind_this_process
    from asyncrl.rollout.chat_sessions import ChatSettings
    from asyncrl.rollout.gateway import InferenceGateway
    from asyncrl.rollout.router import EngineRouter

    agent = next(iter(build_agents(cfg).agents.values()))
    one = replace(cfg, engine=replace(cfg.engine, num_engines=1))
    (engine,) = actors.create_engines(one, stream=False)
    await engine.start.remote()
    # the gateway (this process) and the client process on rollout.cpu_cores: with engine.cpu_cores,
    # cores of their own, as agents and a GPU's engine have (what the endpoint's CPU then costs is latency)
    bind_this_process(cfg.rollout.cpu_cores)
    gateway = InferenceGateway(EngineRouter([engine]).client, agent.tokenizer,
                               chat=ChatSettings(cfg.tools.parser, cfg.engine.max_model_len, cfg.reward.max_abs))
    turns, max_tokens = bench.chat_turns, bench.max_new_tokens
    sampling = SamplingSpec(max_new_tokens=turns * max_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p)
    try:
        return await measure(gateway, agent.problems("heldout")[: bench.num_prompts], sampling, turns, max_tokens,
                             bench.rounds, cfg.model.tokenizer_path or cfg.model.path, cfg.model.chat_template,
                             bench.warmup_rounds, bench.settle_s)
    finally:
        await gateway.stop()
        ray.kill(engine)


def run_chat_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    import ray

    from asyncrl import actors

    actors.start_local_ray(cfg, dashboard=False, log_to_driver=False)
    try:
        return asyncio.run(_chat_bench(cfg, bench))
    finally:
        ray.shutdown()


if __name__ == "__main__":  # the client process
    print(json.dumps(asyncio.run(_play(json.loads(sys.stdin.read())))))
