"""What a trainer rank reads of the run's config: its sections, not the whole `Config`
(`TrainerSettings.of`; asyncrl/actors.py makes it for every rank)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config.schema import AlgorithmConfig, Config, ModelConfig, SimEngineConfig, TrainerConfig


@dataclass(frozen=True)
class TrainerSettings:
    model: ModelConfig
    trainer: TrainerConfig
    algorithm: AlgorithmConfig
    device: str  # cluster.device
    seed: int  # run.seed
    temperature: float  # rollout.temperature: the engines sample at it, so logprobs are taken at it
    time_scale: float  # cluster.time_scale (the simulated trainer's clock)
    sim_engine: SimEngineConfig  # engine.sim: the token blocks the simulated engines generate (the simulated trainer)

    @classmethod
    def of(cls, cfg: Config) -> TrainerSettings:
        return cls(cfg.model, cfg.trainer, cfg.algorithm, cfg.cluster.device, cfg.run.seed, cfg.rollout.temperature,
                   cfg.cluster.time_scale, cfg.engine.sim)
