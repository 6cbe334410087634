"""Agent types by name: configs (and so env-server requests) can only reach these.

An env id in a request selects an agent the server's config built at start; a type
name selects a class from this table; nothing is ever imported because a request
named it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.agents.agent_process import AgentProcessAgent
from asyncrl.agents.api import Agent, AgentSettings
from asyncrl.agents.dataset import DatasetAgent, DatasetParams
from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.agents.remote import RemoteAgent
from asyncrl.agents.reward_only import RewardOnlyAgent
from asyncrl.config.schema import AgentConfig, Config
from asyncrl.config.validate import check_data
from asyncrl.reward.reward_function import load_reward_function

AGENT_TYPES: dict[str, type[Agent]] = {
    "dataset": DatasetAgent,
    "reward_only": RewardOnlyAgent,
    "remote": RemoteAgent,
    "agent_process": AgentProcessAgent,
}


def agent_specs(cfg: Config) -> list[AgentConfig]:
    """The run's agents: `agents`, or else one dataset agent made of the `data` section."""
    if cfg.agents:
        return list(cfg.agents)
    return [AgentConfig(env_id=cfg.recipe.name, type="dataset", weight=1.0, params=dataclasses.asdict(cfg.data))]


def agent_params(spec: AgentConfig) -> Any:
    """The spec's params as its type's dataclass; ValueError naming the bad key or value."""
    if spec.type not in AGENT_TYPES:
        raise ValueError(f"agent type {spec.type!r} is not registered; registered types: {', '.join(AGENT_TYPES)}")
    params_class = AGENT_TYPES[spec.type].params_class
    try:
        merged = OmegaConf.merge(OmegaConf.structured(params_class), spec.params or {})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        raise ValueError(f"params{'.' + key if key else ''}: {str(e).splitlines()[0]}") from None


def check_registered(cfg: Config) -> list[str]:
    """The config's names that must be registered: agent loops (rollout.agent_loop and each
    agent's), the chat template, agent types and their params (a dataset agent's data settings
    included); and each dataset's reward function, loaded (executing its file) so that a bad one
    stops nothing already started."""
    from agent_loops import registered_agent_loops
    from agent_loops.chat import named_templates

    loops = registered_agent_loops()
    problems = []
    if cfg.model.chat_template and cfg.model.chat_template not in named_templates():
        problems.append(f"model.chat_template={cfg.model.chat_template!r}: not a shipped chat template; "
                        f"shipped: {', '.join(named_templates())} (empty: the tokenizer's own)")
    if cfg.rollout.agent_loop not in loops:
        problems.append(f"rollout.agent_loop={cfg.rollout.agent_loop!r}: not a registered agent loop; "
                        f"registered: {', '.join(loops)}")
    for i, spec in enumerate(cfg.agents):
        key = f"agents[{i}]"
        if spec.agent_loop and spec.agent_loop not in loops:
            problems.append(f"{key}.agent_loop={spec.agent_loop!r}: not a registered agent loop; "
                            f"registered: {', '.join(loops)}")
        try:
            params = agent_params(spec)
        except ValueError as e:
            problems.append(f"{key} ({spec.env_id}): {e}")
            continue
        if spec.type in ("dataset", "agent_process"):
            problems += check_data(f"{key}.params", params) + _reward_function_problems(f"{key}.params", params)
    if not cfg.agents:
        problems += _reward_function_problems("data", cfg.data)
    return problems


def _reward_function_problems(key: str, data: Any) -> list[str]:
    if not data.reward_function:
        return []
    try:
        load_reward_function(data.reward_function)
    except ValueError as e:
        return [f"{key}.reward_function={data.reward_function!r}: {e}"]
    return []


def build_agent(spec: AgentConfig, cfg: Config) -> Agent:
    params = agent_params(spec)  # first: it rejects an unregistered type
    return AGENT_TYPES[spec.type](spec, params, AgentSettings.of(cfg))


def build_agents(cfg: Config) -> WeightedMultiTask:
    """Every agent of the run, weighted; errors name the env."""
    agents = []
    for spec in agent_specs(cfg):
        try:
            agents.append(build_agent(spec, cfg))
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith("env ") else f"env {spec.env_id!r}: {msg}") from None
    return WeightedMultiTask(agents, block_size=cfg.algorithm.prompts_per_step, seed=cfg.run.seed)


__all__ = ["AGENT_TYPES", "DatasetParams", "agent_params", "agent_specs", "build_agent", "build_agents",
           "check_registered"]
