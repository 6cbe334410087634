"""SimEngine (`engine.backend=sim`): EngineActor's interface with a latency model in place of
vLLM, so the real control plane (driver, rollout workers and their request channels, agent
loops, queue, admission, sync coordination) runs at a scale this machine cannot generate at.

The model (engine.sim, in simulated seconds; asyncrl.clock turns them into real ones):
  - continuous batching: requests join the running batch (at most engine.max_num_seqs) at a
    step boundary; a decode step gives every running request one token and takes
    decode_base_s + decode_per_seq_s * batch + decode_per_kv_token_s * (tokens in the batch's
    contexts); a request's prefill (its prompt, or engine.sim.prompt_tokens) is added to the
    step that admits it; with engine.sim.prefix_cache a later turn of a conversation, or a
    response's continuation, prefills only what follows the context's last response token;
  - each response's length is drawn from a distribution (lognormal with a median and a 99th
    percentile, or a histogram), cut at rollout.max_new_tokens ("length"; otherwise "stop");
  - with engine.sim.token_block = k each simulated token stands for k tokens (lengths and costs
    are in tokens, responses in blocks), so long responses cost the control plane k times less;
  - pause("abort") ends every request with the tokens it has so far; pause("keep") freezes them
    until resume(); every token carries the version the engine held when it was produced;
  - a weight update pauses, waits the broadcast's time and engine.sim.load_s, and resumes.

Between events (an arrival, a request finishing, a pause) the engine sleeps for the whole run
of decode steps at once: its cost is per event, not per token.

A response repeats one token, drawn from the vocabulary's last NUM_SIM_TOKENS ids when it starts
(the rewards of simulated runs are not what they measure). That token and the prompt seed its
length, so a response that was aborted and is continued (the prompt then ends with the g tokens
it had: a run of its token no longer than what the request's budget says the loop has used)
gets the same length as if it had not been: interrupted equals uninterrupted, as on the real
engine. Everything in a context from its first response token on (responses, and what a
multi-turn loop appended between them) was made by the loop, in blocks: each costs a block's
tokens of prefill and context.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from pathlib import Path

from asyncrl.clock import Clock
from asyncrl.config.schema import EngineConfig, SimEngineConfig
from asyncrl.engine.pause import check_pause
from asyncrl.inference.channel import ChannelAddress, ChannelServer
from asyncrl.lognormal import lognormal
from asyncrl.messages import EngineActivity, EngineStartInfo, WeightUpdateReport
from asyncrl.types import GenerationResult, SamplingSpec

NUM_SIM_TOKENS = 64  # distinct response tokens: the n samples of a prompt rarely share one (and their length)


class DecodeModel:
    """The time of decode steps over a batch whose size is fixed between events."""

    def __init__(self, c: SimEngineConfig):
        self.c = c

    def steps_s(self, n: int, batch: int, context: int) -> float:
        """Seconds for n decode steps of `batch` requests holding `context` tokens at the first:
        the context grows by `batch` tokens a step."""
        c = self.c
        per_step = c.decode_base_s + c.decode_per_seq_s * batch
        return n * per_step + c.decode_per_kv_token_s * (n * context + batch * n * (n - 1) / 2)

    def steps_within(self, seconds: float, n: int, batch: int, context: int) -> int:
        """The most steps (at most n) that fit in `seconds`."""
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.steps_s(mid, batch, context) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.c.prefill_per_token_s * prompt_tokens


class LengthModel:
    """Response lengths: a lognormal through (median, p99), or a histogram [[tokens, count], ...]."""

    def __init__(self, c: SimEngineConfig):
        self.median, self.p99 = c.length_median, c.length_p99
        self.values = [int(t) for t, _ in c.length_hist]
        counts = [n for _, n in c.length_hist]
        self.cumulative = [sum(counts[:i + 1]) for i in range(len(counts))]

    def draw(self, rng: random.Random) -> int:
        """A response length in tokens."""
        if self.values:
            i = bisect_left(self.cumulative, rng.random() * self.cumulative[-1])
            return max(1, self.values[min(i, len(self.values) - 1)])
        return max(1, round(lognormal(self.median, self.p99, rng)))


@dataclass
class _Request:
    request_id: str
    prefill_tokens: int  # what its prefill costs, in tokens
    context_tokens: int  # its context when admitted, in tokens (decode reads their KV cache)
    target: int  # simulated tokens it will generate unless stopped (blocks: engine.sim.token_block)
    token_id: int
    done: asyncio.Future
    stop: bool  # the response ends before its budget ("stop"), or at it ("length")
    tokens: int = 0
    versions: list[int] = field(default_factory=list)

    def result(self, finish_reason: str) -> GenerationResult:
        return GenerationResult([self.token_id] * self.tokens, [-1.0] * self.tokens, self.versions, finish_reason)


class _Replica:
    """One simulated engine's continuous batch: its waiting and running requests and the task
    that steps them. A SimEngine actor holds engine.sim.replicas of them."""

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.outstanding = 0  # requests given to it and not yet answered
        self.prefill_debt = 0.0  # admitted requests' prefill not yet spent
        self.wake = asyncio.Event()  # an arrival, a pause or a resume
        self.still = asyncio.Event()  # set while it is not stepping
        self.still.set()
        self.task: asyncio.Task | None = None

    async def schedule(self) -> None:
        """Admit, step until the next event, hand out tokens; forever."""
        e = self.engine
        block = e.settings.sim.token_block  # a simulated token is a block of decode steps
        while True:
            if e.paused or not (self.waiting or self.running):
                self.still.set()
                self.wake.clear()
                await self.wake.wait()
                continue
            self.still.clear()
            while self.waiting and len(self.running) < e.settings.max_num_seqs:
                request = self.waiting.pop(0)
                self.prefill_debt += e.decode.prefill_s(request.prefill_tokens)
                self.running.append(request)
            batch = len(self.running)
            context = sum(r.context_tokens + r.tokens * block for r in self.running)
            n = min(r.target - r.tokens for r in self.running)
            t0 = e.clock.now()
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), e.clock.real(
                    self.prefill_debt + e.decode.steps_s(n * block, batch, context)))
                spent = e.clock.now() - t0  # woken early: the steps that fitted
                decode_s = max(0.0, spent - self.prefill_debt)
                self.prefill_debt = max(0.0, self.prefill_debt - spent)
                steps = e.decode.steps_within(decode_s, n * block, batch, context) // block
            except TimeoutError:
                self.prefill_debt = 0.0
                steps = n
            self.advance(steps)

    def advance(self, steps: int) -> None:
        """Every running request gains `steps` tokens of the engine's version; the finished leave."""
        if not steps:
            return
        still = []
        for r in self.running:
            r.tokens += steps
            r.versions += [self.engine.version] * steps
            if r.tokens >= r.target:
                r.done.set_result(r.result("stop" if r.stop else "length"))
            else:
                still.append(r)
        self.running = still

    def abort(self) -> None:
        """End every request with the tokens it has."""
        for r in self.running + self.waiting:
            r.done.set_result(r.result("abort"))
        self.running, self.waiting, self.prefill_debt = [], [], 0.0


class SimEngine:
    """An engine of simulated time with EngineActor's methods (asyncrl.interfaces.EngineInterface:
    the driver, the workers' routers and WeightSync cannot tell them apart). With
    engine.sim.replicas = r one actor stands for r engines (each a batch of its own; a request goes
    to the least loaded): a Ray actor process costs about 1 % of a core even idle, so a scenario's
    hundreds of engines would not fit here."""

    def __init__(self, engine_id: int, model_path: str, tokenizer_path: str, engine: EngineConfig, device: str,
                 stream_outputs: bool = True, time_scale: float = 1.0, receive_s: float = 0.0,
                 max_new_tokens: int = 1 << 20):
        self.engine_id = engine_id
        self.settings = engine  # the engine section
        self.stream_outputs = stream_outputs
        self.clock = Clock(time_scale)
        self.receive_s = receive_s  # the trainer's broadcast, as this engine waits for it
        self.decode = DecodeModel(engine.sim)
        self.rng = random.Random(engine.sim.seed * 1_000_003 + engine_id)
        self.lengths = LengthModel(engine.sim)
        self.max_new_tokens = max_new_tokens  # a response's whole budget (rollout.max_new_tokens)
        vocab = _vocab_size(model_path)
        self.sim_tokens = range(max(1, vocab - NUM_SIM_TOKENS), vocab)
        self.version = 0
        self.replicas = [_Replica(self) for _ in range(engine.sim.replicas)]
        self.paused = False
        self._accepting = asyncio.Event()
        self._accepting.set()
        self._activity = EngineActivity(0.0, 0.0)
        self._activity_at = self.clock.now()
        self._channel: ChannelServer | None = None
        self._channel_address: ChannelAddress | None = None

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> EngineStartInfo:
        for replica in self.replicas:
            replica.task = asyncio.ensure_future(replica.schedule())
        return EngineStartInfo(start_s=0.0, rss_gib=0.0, cpu_cores=[], vllm_processes=[],
                               model_in_engine_core=False, plain_weights=False)

    async def open_channel(self) -> ChannelAddress:
        if self._channel_address is None:
            import ray

            self._channel = ChannelServer(self.generate, f"engine-{self.engine_id}")
            self._channel_address = await self._channel.start(ray.util.get_node_ip_address())
        return self._channel_address

    async def health(self) -> float:
        for replica in self.replicas:
            if replica.task is not None and replica.task.done():
                replica.task.result()  # raises what stopped it
        return 0.0

    async def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
        for replica in self.replicas:
            if replica.task is not None:
                replica.task.cancel()

    # -- generation --------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingSpec, request_id: str) -> GenerationResult:
        await self._accepting.wait()
        token_id, had, length = self._response(prompt_token_ids, sampling.max_new_tokens)
        block = self.settings.sim.token_block
        left = max(0, -(-length // block) - had)  # in blocks
        context, prefill = self._context_tokens(prompt_token_ids)
        request = _Request(request_id, prefill, context, min(left, sampling.max_new_tokens), token_id,
                           asyncio.get_running_loop().create_future(), stop=left < sampling.max_new_tokens)
        if not request.target:
            return request.result("stop" if request.stop else "length")
        replica = min(self.replicas, key=lambda r: r.outstanding)
        self._account()
        replica.outstanding += 1
        replica.waiting.append(request)
        replica.wake.set()
        try:
            return await request.done
        finally:
            self._account()
            replica.outstanding -= 1

    def _response(self, prompt: list[int], budget: int) -> tuple[int, int, int]:
        """(its token, tokens it already had, its whole length) for the response this request
        continues: one that was aborted after g tokens, or a new one."""
        used = self.max_new_tokens - budget  # the loop's tokens so far: every turn's, and what came between
        had = 0
        if used > 0 and prompt and prompt[-1] in self.sim_tokens:
            while had < min(used, len(prompt)) and prompt[-1 - had] == prompt[-1]:
                had += 1
        if had:
            token_id, head = prompt[-1], prompt[:-had]
        else:
            token_id, head = self.rng.choice(self.sim_tokens), prompt
        length = self.lengths.draw(random.Random(hash((tuple(head), token_id, self.settings.sim.seed))))
        return token_id, had, length

    def _context_tokens(self, prompt: list[int]) -> tuple[int, int]:
        """(the context's tokens, those its prefill costs): the prompt's own (or engine.sim.prompt_tokens),
        then a block for every simulated token from the first response token on."""
        sim = self.settings.sim
        first = next((i for i, t in enumerate(prompt) if t in self.sim_tokens), len(prompt))
        context = (sim.prompt_tokens or first) + (len(prompt) - first) * sim.token_block
        if not sim.prefix_cache or first == len(prompt):
            return context, context
        after_last = next(i for i, t in enumerate(reversed(prompt)) if t in self.sim_tokens)
        return context, after_last * sim.token_block  # cached up to the last response token

    def num_outstanding(self) -> int:
        return sum(r.outstanding for r in self.replicas)

    def _account(self) -> None:
        """Add the time since the last change to the activity totals: busy seconds are the mean over
        the replicas (an actor of r engines with one busy is busy 1/r of the time)."""
        now = self.clock.now()
        dt = now - self._activity_at
        busy = sum(1 for r in self.replicas if r.outstanding) / len(self.replicas)
        self._activity = EngineActivity(self._activity.busy_s + busy * dt,
                                        self._activity.request_s + self.num_outstanding() * dt)
        self._activity_at = now

    def activity(self) -> EngineActivity:
        self._account()
        return replace(self._activity, cpu_s=time.process_time())

    def get_version(self) -> int:
        return self.version

    # -- weight updates ----------------------------------------------------------

    async def pause(self, mode: str = "abort") -> float:
        """`abort`: every request ends now with its tokens so far; `keep`: they wait for resume()."""
        check_pause(mode, self.stream_outputs, self.engine_id)
        t0 = self.clock.now()
        self._accepting.clear()
        self.paused = True
        for replica in self.replicas:
            replica.wake.set()
        for replica in self.replicas:  # each handed out the tokens of the steps it was in
            await replica.still.wait()
        if mode == "abort":
            for replica in self.replicas:
                replica.abort()
        return self.clock.now() - t0

    async def resume(self) -> None:
        self.paused = False
        self._accepting.set()
        for replica in self.replicas:
            replica.wake.set()

    async def load_weights(self, state_dict: dict, version: int) -> float:
        await self.clock.asleep(self.settings.sim.load_s)
        self.version = version
        return self.settings.sim.load_s

    def num_workers(self) -> int:
        return 1

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                                secret: str, plan_wire: list, timeout_s: float,
                                adapter_config: dict | None = None) -> None:
        """Nothing to join: the broadcast is a wait of its simulated time."""

    async def update_weights(self, version: int, pause_mode: str = "abort") -> WeightUpdateReport:
        """pause -> the broadcast's time -> load_s -> become `version` -> resume."""
        t0 = self.clock.now()
        pause_s = await self.pause(pause_mode)
        await self.clock.asleep(self.receive_s + self.settings.sim.load_s)
        self.version = version
        t1 = self.clock.now()
        await self.resume()
        t2 = self.clock.now()
        return WeightUpdateReport(pause_s=pause_s, broadcast_load_s=t1 - t0 - pause_s, receive_s=self.receive_s,
                                  load_s=self.settings.sim.load_s, resume_s=t2 - t1, paused_s=t2 - t0, load_path="sim",
                                  in_place_bytes=0, checksums={})


def _vocab_size(model_path: str) -> int:
    """The model's vocabulary (its config.json), for token ids the tokenizer knows."""
    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    except (OSError, KeyError, ValueError):
        return 32000
