"""The models a run serves beside the policy, never trained, one row each.

A served model is named once here: its config section, the kind of actor that serves it, the
client a rollout worker asks it through (asyncrl/reward/clients.py), whether its score joins
the reward, and the restart budget its replacements are charged to. Everything else reads
this table: the placement (one bundle per replica), the actors' construction (asyncrl/actors.py
`create_service`), the control plane's ServicePool (health probes and replacement), the
rollout workers (one client per row in the run) and the fault records (the row's name).

Adding a served model is one row here, its config section (config/schema.py) and, when no
client fits, one client.

Kinds of actor:
- ENGINE: a vLLM EngineActor on the section's model with the run's engine settings, never in a
  weight sync (so never paused); `num_engines` of them, `num_cpus_per_engine` each.
- HF_MODEL: a RewardModelActor (asyncrl/engine/reward_model.py), a Hugging Face classifier
  scoring batches; `num_actors` replicas, `num_cpus_per_actor` each (and a GPU on GPUs).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from asyncrl.config.schema import Config
from asyncrl.reward.clients import Client, JudgeClient, RewardModelClient, TeacherClient

ENGINE, HF_MODEL = "engine", "hf_model"


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # the dashboard's actors `<name>-<i>`, the fault kind, the counters `<name>_error` / `_timeout`
    section: str  # its config section; the service runs when the section's model path is set
    kind: str  # ENGINE | HF_MODEL
    client: type[Client]  # built by each rollout worker as client(name, actors, section)
    weighted: bool  # its score joins a sample's reward by the section's `weight` (else: per-token, kept apart)
    restarts: str  # its replacements count against run.max_<restarts>_restarts
    path_key: str = "path"  # the section's field naming the model

    @property
    def actor(self) -> str:
        """Its replicas' name on the dashboard and in the logs: `<actor>-<i>`."""
        return self.name.replace("_", "-")


SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec("reward_model", "reward.model", HF_MODEL, RewardModelClient, weighted=True, restarts="reward"),
    ServiceSpec("prm", "reward.prm", HF_MODEL, RewardModelClient, weighted=True, restarts="reward"),
    ServiceSpec("judge", "reward.judge", ENGINE, JudgeClient, weighted=True, restarts="reward"),
    ServiceSpec("teacher", "algorithm.distill", ENGINE, TeacherClient, weighted=False, restarts="teacher",
                path_key="teacher_path"),
)
SPECS = {spec.name: spec for spec in SERVICES}


@dataclass(frozen=True)
class Served:
    """One service of this run, as its section configures it."""

    name: str
    section: Any  # its config section (the client's and the actor's settings)
    path: str
    replicas: int
    cpus: float  # each replica's
    weight: float | None  # in the reward; None: not a score (the teacher's logprobs)

    @property
    def spec(self) -> ServiceSpec:
        return SPECS[self.name]


def served(cfg: Config) -> tuple[Served, ...]:
    """The services this run serves, in the table's order."""
    out = []
    for spec in SERVICES:
        section = operator.attrgetter(spec.section)(cfg)
        if not (path := getattr(section, spec.path_key)):
            continue
        replicas, cpus = ((section.num_engines, section.num_cpus_per_engine) if spec.kind == ENGINE
                          else (section.num_actors, section.num_cpus_per_actor))
        out.append(Served(spec.name, section, path, replicas, cpus, section.weight if spec.weighted else None))
    return tuple(out)


def restart_setting(name: str) -> str:
    """The run setting that bounds service `name`'s replacements."""
    return f"max_{SPECS[name].restarts}_restarts"
