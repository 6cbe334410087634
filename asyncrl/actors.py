"""The one place that creates actors from a config: engines, rollout workers, the message
queue, the trainer ranks and the run's RunControl, each with its Ray
options (names for the dashboard, CPUs, GPUs, concurrency) and, in a run, its placement-group bundle.

The driver, `asyncrl eval`, the benchmarks and the tests all build their actors here, so
an actor is started the same way wherever it runs. Every actor is a plain class wrapped
by Ray at this edge; nothing below this module imports Ray's actor machinery for them.

    placement = place(cfg)                                   # one bundle per actor (a run)
    engines = create_engines(cfg, placement.engine)          # not started yet
    infos = start_engines(engines)
    trainer = create_trainer(cfg, placement.trainer); trainer.setup()
    queue = create_queue(cfg)
    workers = create_rollout_workers(cfg, engines, queue, placement.worker)

The weight-sync group between them is the control plane's (asyncrl/control/weight_sync.py
`WeightSync.of`): it is no actor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle

from asyncrl import run_control
from asyncrl.config.models import checkpoint_model_type
from asyncrl.config.schema import MOE_MODEL_TYPES, Config
from asyncrl.engine.engine_actor import EngineActor
from asyncrl.engine.pause import engines_stream
from asyncrl.engine.reward_model import RewardModelActor, RewardModelSettings
from asyncrl.engine.sim_engine import SimEngine
from asyncrl.interfaces import EngineHandle, QueueHandle, ServiceHandle
from asyncrl.messages import EngineStartInfo
from asyncrl.queue.message_queue import MessageQueue
from asyncrl.reward.services import ENGINE, SPECS, Served, served
from asyncrl.rollout.admission import StalenessController
from asyncrl.rollout.worker import RolloutWorker, WorkerSettings, agents_of
from asyncrl.run_control import RunControl
from asyncrl.trainer.safe_checkpoint import ADAPTER_CONFIG_MAX_BYTES, read_checkpoint_json
from asyncrl.trainer.settings import TrainerSettings
from asyncrl.trainer.sim_trainer import SimTrainerRank
from asyncrl.trainer.trainer_group import TrainerGroup
from asyncrl.trainer.trainer_rank import TrainerRank
from asyncrl.types import SamplingSpec

logger = logging.getLogger(__name__)

Options = dict[str, Any]  # extra Ray actor options (a placement-group bundle)
# Handles of the actors with one implementation (the others': asyncrl.interfaces).
RolloutWorkerHandle = ActorHandle[RolloutWorker]
RunControlHandle = ActorHandle[RunControl]


class PlacementError(RuntimeError):
    """The cluster cannot hold this config's actors; the message says what to lower."""


@dataclass
class Placement:
    """Ray options that put each actor in its bundle of one placement group (empty: Ray places it)."""

    engine: list[Options] = field(default_factory=list)
    trainer: list[Options] = field(default_factory=list)
    worker: list[Options] = field(default_factory=list)
    services: dict[str, list[Options]] = field(default_factory=dict)  # each served model's (asyncrl/reward/services.py)
    group: Any = None  # the placement group, removed by `remove_placement`
    names: list[str] = field(default_factory=list)  # each bundle's actor, as the dashboard names it

    def nodes(self) -> dict[str, str]:
        """Each bundle's actor name -> the Ray node (id) its bundle was placed on."""
        if self.group is None:
            return {}
        from ray.util.placement_group import placement_group_table

        where = placement_group_table(self.group)["bundles_to_node_id"]
        return {name: where[i] for i, name in enumerate(self.names) if i in where}


def trainer_world_size(cfg: Config) -> int:
    """Trainer rank actors: one for the simulated trainer, whatever parallelism it stands for."""
    t = cfg.trainer
    if t.backend == "sim":
        return 1
    return t.tensor_parallel_size * t.pipeline_parallel_size * t.data_parallel_size


def engine_concurrency(cfg: Config, engines: int | None = None) -> int:
    """The most requests one of `engines` (default engine.num_engines) engines can be running: what
    the workers' loops can send it, at most its own batch (the denominator of the engines' utilization)."""
    sent = -(-cfg.rollout.num_workers * cfg.rollout.max_concurrent_loops // (engines or cfg.engine.num_engines))
    batch = cfg.engine.max_num_seqs * (cfg.engine.sim.replicas if cfg.engine.backend == "sim" else 1)
    return max(1, min(batch, sent))


# -- placement ------------------------------------------------------------------------

def start_ray(cfg: Config) -> bool:
    """Join the cluster of `ray job submit` (or `cluster.address`), or start one of our own even
    where `ray start` left one running. Returns whether this call started Ray."""
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    start_local_ray(cfg)
    return True


def start_local_ray(cfg: Config, dashboard: bool | None = None, log_to_driver: bool = True) -> None:
    """An embedded single-node cluster (`dashboard`: default cluster.dashboard), this user's
    alone: what Ray writes while it starts (its token, the session's port files) is created
    private, the dashboard answers on loopback, and Ray's metrics exporter, which listens on
    every interface without authentication, runs only with cluster.ray_metrics (ray 2.60: the
    raylet reads RayConfig's enable_metrics_collection from RAY_*)."""
    if not cfg.cluster.ray_metrics:
        os.environ.setdefault("RAY_enable_metrics_collection", "0")
    umask = os.umask(0o077)
    try:
        ray.init(address="local", num_cpus=cfg.cluster.num_cpus, num_gpus=cfg.cluster.num_gpus or None,
                 include_dashboard=cfg.cluster.dashboard if dashboard is None else dashboard,
                 dashboard_host="127.0.0.1", log_to_driver=log_to_driver)
    finally:
        os.umask(umask)
    private_ray_token()


def private_ray_token() -> None:
    """Ray's token file (~/.ray/auth_token: whoever reads it controls every cluster that uses it)
    0600 and its directory 0700, however an earlier Ray made them."""
    token = Path.home() / ".ray" / "auth_token"
    for path, mode in ((token.parent, 0o700), (token, 0o600)):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            if path.lstat().st_uid == os.getuid() and not path.is_symlink():
                path.chmod(mode)


def engine_resources(cfg: Config) -> dict[str, float]:
    """One engine's placement-group bundle."""
    return {"CPU": cfg.engine.num_cpus_per_engine, **cfg.engine.resources,
            **({"GPU": cfg.engine.tensor_parallel_size} if cfg.cluster.device == "cuda" else {})}


def _roles(cfg: Config, engines: int | None = None) -> list[tuple[str, dict[str, float]]]:
    """Each bundle of the run's placement group, with its role: the engines', the trainer ranks',
    the rollout workers', then each served model's replicas' (by its name)."""
    gpu = {"GPU": 1} if cfg.cluster.device == "cuda" else {}
    t = cfg.trainer
    return ([("engine", engine_resources(cfg))] * (cfg.engine.num_engines if engines is None else engines)
            + [("trainer", {"CPU": t.num_cpus_per_rank, **t.resources, **gpu})] * trainer_world_size(cfg)
            + [("worker", {"CPU": cfg.rollout.num_cpus_per_worker, **cfg.rollout.resources})]
            * cfg.rollout.num_workers
            + [(s.name, {"CPU": s.cpus, **gpu}) for s in served(cfg) for _ in range(s.replicas)])


def resources_needed(cfg: Config, engines: int | None = None) -> dict[str, float]:
    """What the run's actors take of the cluster, with `engines` engines (default engine.num_engines)."""
    need: dict[str, float] = {}
    for _, bundle in _roles(cfg, engines):
        for k, v in bundle.items():
            need[k] = need.get(k, 0) + v
    return need


def place(cfg: Config, timeout_s: float = 120) -> Placement:
    """One placement group (PACK): a bundle per engine, trainer rank, rollout worker and replica of
    each served model.
    Raises PlacementError when the cluster lacks the resources, naming what to lower."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    roles = _roles(cfg)
    need = resources_needed(cfg)
    have = ray.cluster_resources()
    short = {k: (v, have.get(k, 0)) for k, v in need.items() if v > have.get(k, 0) + 1e-9}
    if short:
        raise PlacementError("not enough cluster resources for this config: " + ", ".join(
            f"{k} needs {v:g}, cluster has {h:g}" for k, (v, h) in short.items())
            + " (lower engine.num_cpus_per_engine, trainer.num_cpus_per_rank, rollout.num_cpus_per_worker, "
            + "".join(f"{s.spec.section}.{'num_cpus_per_engine' if s.spec.kind == ENGINE else 'num_cpus_per_actor'}, "
                      for s in served(cfg))
            + "or the number of engines / workers / ranks; custom resources "
              "of engine/trainer/rollout.resources come from the nodes' `ray start --resources`)")
    pg = placement_group([b for _, b in roles], strategy="PACK", name="asyncrl")
    ray.get(pg.ready(), timeout=timeout_s)
    placement = Placement(group=pg)
    for i, (role, _) in enumerate(roles):
        slots = getattr(placement, role) if role in ("engine", "trainer", "worker") \
            else placement.services.setdefault(role, [])
        actor = {"engine": "engine", "worker": "rollout-worker", "trainer": "trainer-rank"}.get(role) \
            or SPECS[role].actor
        placement.names.append(_name(actor, len(slots), 0))
        slots.append({"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)})
    return placement


def engine_bundle(cfg: Config) -> tuple[Options, Any]:
    """A placement group of its own for one engine added to a running job: its actor options and
    the group (`remove_bundle`). Not waited for: the engine starts once the cluster has room
    (with Ray's autoscaler, possibly on a new node)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = engine_resources(cfg)
    pg = placement_group([bundle], strategy="PACK")
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                    placement_group_bundle_index=0)}, pg


def remove_bundle(group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


def remove_placement(placement: Placement) -> None:
    if placement.group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(placement.group)


def slot(slots: list[Options] | None, i: int) -> Options:
    return slots[i] if slots else {}


# -- engines --------------------------------------------------------------------------

def _name(role: str, index: int, restart: int) -> str:
    """The dashboard name: a replacement (restart n) carries `.rN` (the dead actor's name may not be free yet)."""
    return f"{role}-{index}" + (f".r{restart}" if restart else "")


def engine_options(cfg: Config, engine_id: int, restart: int = 0) -> Options:
    """Named for the dashboard, sized by config, many concurrent calls (generate is async)."""
    return {"name": _name("engine", engine_id, restart), "num_cpus": cfg.engine.num_cpus_per_engine,
            "max_concurrency": 10_000}


def create_engines(cfg: Config, slots: list[Options] | None = None, stream: bool | None = None,
                   engine_class: type | None = None) -> list[EngineHandle]:
    """`engine.num_engines` engines, not started yet (`start_engines`). `stream`: whether
    they stream per-token outputs (default: as `algorithm.pause_mode` needs)."""
    return [create_engine(cfg, i, slot(slots, i), stream, engine_class) for i in range(cfg.engine.num_engines)]


def create_engine(cfg: Config, engine_id: int, slot: Options | None = None, stream: bool | None = None,
                  engine_class: type | None = None, restart: int = 0) -> EngineHandle:
    """One engine, `engine-<engine_id>` on the dashboard, not started yet: an EngineActor (vLLM), a
    SimEngine (engine.backend=sim) or `engine_class`."""
    stream = engines_stream(cfg.algorithm.pause_mode) if stream is None else stream
    engine_class = engine_class or (SimEngine if cfg.engine.backend == "sim" else EngineActor)
    extra = {}
    if issubclass(engine_class, SimEngine):  # simulated time, and the broadcast's from the trainer's model
        t = cfg.trainer.sim
        extra = {"time_scale": cfg.cluster.time_scale, "receive_s": t.weight_bytes / t.broadcast_bytes_per_s,
                 "max_new_tokens": cfg.rollout.max_new_tokens}
    elif cfg.algorithm.routing_replay == "r3" or checkpoint_model_type(cfg.model.path) in MOE_MODEL_TYPES:
        # MoE: the engines return routes, for the trainer to replay (r3) or to compare its own with
        extra = {"return_routes": True}
    if not issubclass(engine_class, SimEngine) and cfg.trainer.lora.rank:
        extra["lora_rank"] = cfg.trainer.lora.rank  # the policy arrives as LoRA adapters
        # pause mode none: each request finishes on its adapter, within the staleness window
        extra["lora_versions"] = cfg.algorithm.max_staleness + 1 if cfg.algorithm.pause_mode == "none" else 1
    return (ray.remote(engine_class).options(**engine_options(cfg, engine_id, restart), **(slot or {}))
            .remote(engine_id, cfg.model.path, cfg.model.tokenizer_path, cfg.engine, cfg.cluster.device, stream,
                    **extra))


def start_engines(engines: list[EngineHandle]) -> list[EngineStartInfo]:
    """Start vLLM in every engine at once; returns each engine's start report."""
    return ray.get([e.start.remote() for e in engines])


def create_local_engine(cfg: Config, stream: bool = False) -> EngineActor:
    """An EngineActor as a plain object in this process (no Ray): `asyncrl eval`. Not started."""
    rank = 0
    if cfg.eval.adapter:  # served as a LoRA adapter of model.path, read by vLLM from its directory
        rank = int(read_checkpoint_json(Path(cfg.eval.adapter) / "adapter_config.json", ADAPTER_CONFIG_MAX_BYTES)["r"])
    return EngineActor(0, cfg.model.path, cfg.model.tokenizer_path, cfg.engine, cfg.cluster.device,
                       stream_outputs=stream, lora_rank=rank, adapter_path=cfg.eval.adapter)


# -- queue and rollout workers ----------------------------------------------------------

def create_queue(cfg: Config, capacity: int | None = None, restart: int = 0) -> QueueHandle:
    """The message queue, `message-queue` on the dashboard; it holds no CPU (it only waits)."""
    name = "message-queue" + (f".r{restart}" if restart else "")
    return ray.remote(MessageQueue).options(name=name, num_cpus=0, max_concurrency=1000).remote(
        capacity or StalenessController.of(cfg.algorithm).queue_capacity())


def rollout_worker_options(cfg: Config, worker_id: int, restart: int = 0) -> Options:
    return {"name": _name("rollout-worker", worker_id, restart), "num_cpus": cfg.rollout.num_cpus_per_worker,
            "max_concurrency": 1000}


def create_rollout_workers(cfg: Config, engines: list[EngineHandle | None], queue: QueueHandle | None,
                           slots: list[Options] | None = None, sampling: SamplingSpec | None = None,
                           restart: int = 0, services: dict[str, list] | None = None) -> list[RolloutWorkerHandle]:
    """`rollout.num_workers` RolloutWorkers over these engines, emitting groups to `queue`
    (None: each keeps its groups for `take_groups`), scoring with the run's served models too
    (`services`: name -> its actors, as ServicePool.handles gives them)."""
    return [create_rollout_worker(cfg, i, engines, queue, slot(slots, i), sampling, restart, services)
            for i in range(cfg.rollout.num_workers)]


def create_rollout_worker(cfg: Config, worker_id: int, engines: list[EngineHandle | None], queue: QueueHandle | None,
                          slot: Options | None = None, sampling: SamplingSpec | None = None,
                          restart: int = 0, services: dict[str, list] | None = None) -> RolloutWorkerHandle:
    """One RolloutWorker, `rollout-worker-<worker_id>` on the dashboard (a replacement: `.rN`)."""
    return (ray.remote(RolloutWorker).options(**rollout_worker_options(cfg, worker_id, restart), **(slot or {}))
            .remote(worker_id, WorkerSettings.of(cfg), engines, agents_of(cfg), queue, sampling, services=services))


# -- served models (asyncrl/reward/services.py) -------------------------------------------

def create_service(cfg: Config, service: Served, index: int, slot: Options | None = None,
                   restart: int = 0) -> ServiceHandle:
    """Replica `index` of served model `service`, `<name>-<index>` on the dashboard, in its bundle
    `slot`, not ready yet (`start_services`): an EngineActor with the run's engine settings, never
    in a weight sync (so never paused), or a RewardModelActor (and a GPU on GPUs)."""
    opts: Options = {"name": _name(service.spec.actor, index, restart), "num_cpus": service.cpus}
    if service.spec.kind == ENGINE:
        return (ray.remote(EngineActor).options(**opts, max_concurrency=10_000, **(slot or {}))
                .remote(index, service.path, "", cfg.engine, cfg.cluster.device, False))
    gpu = {"num_gpus": 1} if cfg.cluster.device == "cuda" else {}
    return (ray.remote(RewardModelActor).options(**opts, max_concurrency=1000, **gpu, **(slot or {}))
            .remote(RewardModelSettings.of(service.section, cfg.cluster.device)))


def start_services(service: Served, replicas: list[ServiceHandle], first: int = 0) -> None:
    """Wait until these replicas of `service` (indices from `first`) serve: engines started, models loaded."""
    name = service.spec.actor
    if service.spec.kind != ENGINE:
        t0 = time.monotonic()
        for i, pid in enumerate(ray.get([r.pid.remote() for r in replicas]), first):  # answered once loaded
            logger.info("%s-%d: started in %.0fs, pid %d", name, i, time.monotonic() - t0, pid)
        return
    for i, info in enumerate(start_engines(replicas), first):
        logger.info("%s-%d: started in %.0fs, %.2f GiB resident, pid %d", name, i, info.start_s, info.rss_gib,
                    info.pid)


# -- trainer and weight sync -------------------------------------------------------------

def trainer_rank_options(cfg: Config, rank: int, restart: int = 0) -> Options:
    """Named for the dashboard; one GPU per rank on GPUs."""
    opts: Options = {"name": _name("trainer-rank", rank, restart), "num_cpus": cfg.trainer.num_cpus_per_rank}
    if cfg.cluster.device == "cuda":
        opts["num_gpus"] = 1
    return opts


def create_trainer(cfg: Config, slots: list[Options] | None = None, rank_class: type | None = None,
                   restart: int = 0) -> TrainerGroup:
    """The trainer's ranks as Ray actors, behind one TrainerGroup (not set up yet: `setup()`).
    `rank_class`: a TrainerRank subclass (benchmarks and tests add their own probes); by default
    TrainerRank, or one SimTrainerRank with trainer.backend=sim."""
    world = trainer_world_size(cfg)
    rank_class = rank_class or (SimTrainerRank if cfg.trainer.backend == "sim" else TrainerRank)
    ranks = [ray.remote(rank_class).options(**trainer_rank_options(cfg, r, restart), **slot(slots, r))
             .remote(TrainerSettings.of(cfg), r, world) for r in range(world)]
    return TrainerGroup(ranks)


# -- the run's mailbox -------------------------------------------------------------------

def create_run_control(run_dir: Path) -> RunControlHandle:
    """The run's RunControl (`asyncrl scale`, `asyncrl stop`) in a namespace of the run's own,
    announced in RUN_DIR/control.json; it holds no CPU (it only keeps a request)."""
    where = run_control.control_address()
    handle = ray.remote(RunControl).options(name=where["name"], namespace=where["namespace"], num_cpus=0).remote()
    run_control.announce(run_dir, where)
    return handle
