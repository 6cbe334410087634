"""The benchmarks' own settings (`bench.*`), kept out of the training config: only
`asyncrl bench` accepts and validates them.

    asyncrl bench rollout recipe=arith bench.rounds=7 bench.max_new_tokens=16
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.config import ConfigError
from asyncrl.config.schema import LOSS_TYPES, PAUSE_MODES
from asyncrl.reward.services import SPECS

PREFIX = "bench."


# The trainer bench's random models (bench.model_shape): Qwen3's layout at these sizes.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=True),
    "qwen3_0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3_1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3_4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}


@dataclass
class BenchConfig:
    num_prompts: int = 64
    n_samples: int = 8
    max_new_tokens: int = 64
    ignore_eos: bool = True  # every request generates exactly max_new_tokens: equal work on both paths
    pause_requests: int = 64  # requests in flight when pause/resume is timed
    rounds: int = 3  # raw and framework rounds alternate; medians are reported (the machine is noisy)
    # Untimed full rounds first: the first round through fresh Ray actors runs slower.
    warmup_rounds: int = 1
    # Pause before each timed rollout round: vLLM's processes keep polling for 1 s after their
    # last request, and the idle engine's polling would take CPU from the other path's round.
    settle_s: float = 1.5
    chat_turns: int = 3  # chat bench: turns of each conversation
    trainer_steps: int = 3  # weight-sync bench: timed train steps for the trainer's tokens/s
    # sync-vs-async bench: each mode trains for this many seconds (equal wall time).
    train_s: float = 180.0
    repeats: int = 1  # sync-vs-async bench: (sync, async) pairs run one after the other
    # sync-vs-async bench: evaluate every this many steps (0: only after training), and the
    # held-out accuracy whose time to reach each mode reports (0: none)
    curve_every: int = 0
    target_accuracy: float = 0.0
    # faults bench: after these steps it kills an engine's vLLM core, a rollout worker, a trainer
    # rank, then the whole run (increasing; the last two after a checkpoint).
    fault_steps: list[int] = field(default_factory=lambda: [3, 5, 9, 13])
    # faults bench with served models (asyncrl/reward/services.py): served model -> the step after
    # which it kills that model's replica 0 (an engine's vLLM core, a reward model's process), e.g.
    # bench.service_fault_steps.judge=6; each before the whole run's kill, at a step no other fault takes
    service_fault_steps: dict[str, int] = field(default_factory=dict)
    checkpoint_every: int = 4  # faults bench: trainer.checkpoint_every, unless the overrides set it
    # elastic bench: after each step s it asks the run for n engines ([[s, n], ...], s increasing;
    # empty: engine.num_engines + 1 after step 2, engine.num_engines after step 4)
    engine_schedule: list[list[int]] = field(default_factory=list)
    steps_after_scale: int = 3  # elastic bench: steps after the last change, then `asyncrl stop`
    # staleness bench: the grid (staleness held exactly at each k; every loss; every seed), the
    # steps of every run, its evaluations, and the pause modes of free-running runs (none: none).
    staleness: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8])
    losses: list[str] = field(default_factory=lambda: ["grpo", "decoupled_ppo", "tis"])
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    steps: int = 20
    eval_every: int = 2
    pause_modes: list[str] = field(default_factory=list)
    # simulate bench (asyncrl simulate): steps per run are bench.steps; the first warmup_steps are
    # left out of the means; sweeps of the async run (each empty: the scenario's value).
    warmup_steps: int = 2
    sweep_engine_devices: list[int] = field(default_factory=list)
    sweep_max_staleness: list[int] = field(default_factory=list)
    sweep_partial_rollout: list[bool] = field(default_factory=list)
    # calibrate bench: requests at once, and the two response lengths (tokens) each decode batch
    # and train step is timed at; the run(s) whose response lengths the scenario takes (a run
    # directory or a bench's; empty: sample the base model); where it writes the scenario (empty:
    # conf/recipe/sim_cpu_RECIPE.yaml).
    calibrate_batches: list[int] = field(default_factory=lambda: [1, 16, 64, 256])
    calibrate_tokens: list[int] = field(default_factory=lambda: [8, 72])
    lengths_from: str = ""
    scenario_out: str = ""
    # trainer bench: a random model of this shape (SHAPES, below), trained on
    # train_groups x n_samples trajectories of seq_len tokens a step, for trainer_steps timed steps
    model_shape: str = "tiny"
    seq_len: int = 1024
    train_groups: int = 16


def split_bench_overrides(args: list[str]) -> tuple[list[str], list[str]]:
    """Command-line arguments -> (`bench.*` overrides, everything else for Hydra)."""
    bench = [a for a in args if a.startswith(PREFIX)]
    return bench, [a for a in args if not a.startswith(PREFIX)]


def parse_bench_config(overrides: list[str]) -> BenchConfig:
    """`bench.key=value` overrides over the defaults, checked; ConfigError names every problem."""
    problems: list[str] = []
    node = OmegaConf.structured(BenchConfig)
    for o in overrides:
        try:
            node = OmegaConf.merge(node, OmegaConf.from_dotlist([o[len(PREFIX):]]))
        except OmegaConfBaseException as e:
            problems.append(f"{o}: {str(e).splitlines()[0]} (valid keys: "
                            f"{', '.join(PREFIX + k for k in BenchConfig.__dataclass_fields__)})")
    if problems:
        raise ConfigError(problems)
    b: BenchConfig = OmegaConf.to_object(node)
    for name in ("num_prompts", "n_samples", "max_new_tokens", "pause_requests", "rounds", "trainer_steps", "repeats"):
        if getattr(b, name) < 1:
            problems.append(f"bench.{name}={getattr(b, name)!r}: must be >= 1")
    for name in ("warmup_rounds", "settle_s"):
        if getattr(b, name) < 0:
            problems.append(f"bench.{name}={getattr(b, name)!r}: must be >= 0")
    if len(b.fault_steps) != 4 or any(s < 1 for s in b.fault_steps) or sorted(set(b.fault_steps)) != b.fault_steps:
        problems.append(f"bench.fault_steps={b.fault_steps!r}: must be 4 increasing steps >= 1 "
                        "(engine, rollout worker, trainer rank, whole run)")
    taken = list(b.fault_steps)
    for name, r in b.service_fault_steps.items():
        if name not in SPECS:
            problems.append(f"bench.service_fault_steps.{name}: no served model of that name "
                            f"(one of {', '.join(SPECS)})")
        elif r < 1 or r in taken or (len(b.fault_steps) == 4 and r > b.fault_steps[3]):
            problems.append(f"bench.service_fault_steps.{name}={r}: must be a step >= 1 before the whole run's "
                            "kill that no other fault takes")
        taken.append(r)
    steps = [x[0] for x in b.engine_schedule if len(x) == 2]
    if (len(steps) != len(b.engine_schedule) or sorted(set(steps)) != steps
            or any(s < 1 or n < 1 for s, n in b.engine_schedule)):
        problems.append(f"bench.engine_schedule={b.engine_schedule!r}: [[step, engines], ...] with increasing "
                        "steps >= 1 and engines >= 1")
    if b.steps_after_scale < 1:
        problems.append(f"bench.steps_after_scale={b.steps_after_scale!r}: must be >= 1")
    if b.checkpoint_every < 1:
        problems.append(f"bench.checkpoint_every={b.checkpoint_every!r}: must be >= 1")
    if not b.staleness or any(k < 0 for k in b.staleness) or len(set(b.staleness)) != len(b.staleness):
        problems.append(f"bench.staleness={b.staleness!r}: must be distinct versions >= 0")
    if any(x not in LOSS_TYPES for x in b.losses):
        problems.append(f"bench.losses={b.losses!r}: each must be one of {list(LOSS_TYPES)}")
    if not b.losses and not b.pause_modes:
        problems.append("bench.losses=[] and bench.pause_modes=[]: no run to make")
    if any(m not in PAUSE_MODES for m in b.pause_modes):
        problems.append(f"bench.pause_modes={b.pause_modes!r}: each must be one of {list(PAUSE_MODES)}")
    if not b.seeds:
        problems.append("bench.seeds=[]: at least one seed")
    for name in ("steps", "eval_every"):
        if getattr(b, name) < 1:
            problems.append(f"bench.{name}={getattr(b, name)!r}: must be >= 1")
    if b.warmup_steps < 0 or b.warmup_steps >= b.steps:
        problems.append(f"bench.warmup_steps={b.warmup_steps!r}: must be in [0, bench.steps={b.steps})")
    if any(d < 1 for d in b.sweep_engine_devices) or any(k < 0 for k in b.sweep_max_staleness):
        problems.append(f"bench.sweep_engine_devices={b.sweep_engine_devices!r} / bench.sweep_max_staleness="
                        f"{b.sweep_max_staleness!r}: devices >= 1, staleness >= 0")
    if b.curve_every < 0:
        problems.append(f"bench.curve_every={b.curve_every!r}: must be >= 0")
    if not 0 <= b.target_accuracy <= 1:
        problems.append(f"bench.target_accuracy={b.target_accuracy!r}: must be in [0, 1]")
    if len(set(b.calibrate_batches)) < 2 or any(n < 1 for n in b.calibrate_batches) or max(b.calibrate_batches) < 16:
        problems.append(f"bench.calibrate_batches={b.calibrate_batches!r}: at least two distinct batches >= 1, "
                        "one of them >= 16 (prefill is timed on those)")
    if len(b.calibrate_tokens) != 2 or not 1 <= b.calibrate_tokens[0] < b.calibrate_tokens[1]:
        problems.append(f"bench.calibrate_tokens={b.calibrate_tokens!r}: two lengths, 1 <= shorter < longer")
    if b.model_shape not in SHAPES:
        problems.append(f"bench.model_shape={b.model_shape!r}: must be one of {list(SHAPES)}")
    for name in ("seq_len", "train_groups"):
        if getattr(b, name) < (16 if name == "seq_len" else 1):
            problems.append(f"bench.{name}={getattr(b, name)!r}: must be >= {16 if name == 'seq_len' else 1}")
    if b.train_s < 1:
        problems.append(f"bench.train_s={b.train_s!r}: must be >= 1")
    if problems:
        raise ConfigError(problems)
    return b
