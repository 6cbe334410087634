"""Config validation: every key, type and value is checked before any actor starts.

`validate(raw)` merges a composed Hydra config into the typed schema (unknown keys and
wrong types fail there), then checks the values, and raises one `ConfigError` listing
every problem found — each naming the key, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import string
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from asyncrl.config.models import checkpoint_model_type, reward_model_problem, vocab_size
from asyncrl.config.schema import (
    ADVANTAGES,
    AGGREGATIONS,
    CPU_AMX,
    DATA_FORMATS,
    DATA_SOURCES,
    DEVICES,
    DTYPES,
    ENGINE_BACKENDS,
    JUDGE_PARSERS,
    LOG_LEVELS,
    LORA_TARGET_MODULES,
    LOSS_TYPES,
    LR_SCHEDULES,
    MAX_LORA_RANK,
    MOE_MODEL_TYPES,
    PAUSE_MODES,
    PRM_AGGREGATES,
    ROUTING_REPLAYS,
    SANDBOX_ISOLATIONS,
    TOOL_PARSERS,
    TRAINER_BACKENDS,
    WANDB_MODES,
    WEIGHT_SYNC_TRANSPORTS,
    Config,
    ProcessRewardConfig,
)
from asyncrl.cpu_cores import parse_cores


class ConfigError(ValueError):
    """One or more invalid config values; the message lists them all."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config ({len(problems)} problem(s)):\n{lines}")


# Upper bounds on sizes: far above any real run, low enough that a slip (a few extra zeros)
# is refused here instead of exhausting memory, threads or the cluster's scheduler later.
MAX_WORKERS = 1024  # rollout.num_workers, engine.num_engines
MAX_CONCURRENT_LOOPS = 16384  # rollout.max_concurrent_loops, per worker
MAX_GROUP_SIZE = 1024  # algorithm.n_samples_per_prompt, eval.n_samples
MAX_SAMPLES_PER_STEP = 1 << 20  # prompts_per_step x n_samples_per_prompt; trainer.micro_batch_size
MAX_MODEL_LEN = 1 << 20  # engine.max_model_len, in tokens
RECOMPUTE = ("none", "selective", "full")  # trainer.recompute
MAX_NUM_SEQS = 16384  # engine.max_num_seqs
MAX_PARALLEL = 1024  # each of the engine's and the trainer's parallel sizes
MAX_THREADS = 1024  # trainer.torch_threads
MAX_BUFFER_MB = 16384  # trainer.weight_sync_bucket_mb, weight_sync_in_place_mb
MAX_KVCACHE_GIB = 4096  # engine.cpu_kvcache_space_gib
MAX_TIMEOUT_S = 86400.0  # rollout.reward_timeout_s, trainer.dist_timeout_s: a day
MAX_GENERATED_PROBLEMS = 1_000_000  # a reasoning-gym source generates all of train_size and heldout_size


# A further check of a typed config (e.g. names against a registry above the config): its problems.
Check = Callable[[Config], list[str]]


def validate(raw: DictConfig | dict[str, Any], checks: Sequence[Check] = ()) -> Config:
    """Check a composed config and return it as a typed `Config`; raise `ConfigError` if invalid.
    `checks` add problems the schema cannot see (asyncrl.run_config passes the registries')."""
    problems: list[str] = []
    typed = _merge_into_schema(raw, problems)
    if typed is None:
        raise ConfigError(problems)
    _check_values(typed, problems)
    for check in checks:
        problems += check(typed)
    if problems:
        # a NaN or infinite value is reported by every check that sees it: once is enough
        raise ConfigError(list(dict.fromkeys(problems)))
    return typed


def _not_finite(key: str, value: float) -> str:
    return f"{key}={value!r}: must be a finite number"


def _checkers(problems: list[str]) -> tuple[Callable, Callable, Callable, Callable]:
    """need(ok, key, value, valid), at_least(key, value, low, why), one_of(key, value, choices),
    within(key, value, low, high, why): each appends one problem naming the key, the value and
    what would be valid. A NaN or infinite value fails whatever the check."""
    def need(ok: bool, key: str, value: Any, valid: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(_not_finite(key, value))
        elif not ok:
            problems.append(f"{key}={value!r}: {valid}")

    def one_of(key: str, value: Any, choices: tuple[str, ...]) -> None:
        need(value in choices, key, value, f"must be one of {', '.join(choices)}")

    def at_least(key: str, value: float, low: float, why: str = "") -> None:
        need(value >= low, key, value, f"must be >= {low}" + (f" ({why})" if why else ""))

    def within(key: str, value: float, low: float, high: float, why: str = "") -> None:
        need(low <= value <= high, key, value, f"must be in [{low}, {high}]" + (f" ({why})" if why else ""))

    return need, at_least, one_of, within


def check_data(key: str, data: Any) -> list[str]:
    """A dataset agent's data settings (a DataConfig: the `data` section, or an agent's params)."""
    problems: list[str] = []
    _check_data(key, data, problems)
    return problems


def _merge_into_schema(raw: DictConfig | dict[str, Any], problems: list[str]) -> Config | None:
    """Key and type checks, one section at a time so that all sections report."""
    if not isinstance(raw, DictConfig):
        raw = OmegaConf.create(raw)
    schema = OmegaConf.structured(Config)
    for key in raw:
        if key not in schema:
            valid = ", ".join(schema.keys())
            problems.append(f"{key}: unknown config section; valid sections are {valid}")
            continue
        try:
            schema[key] = OmegaConf.merge(schema[key], raw[key])
        except OmegaConfBaseException as e:
            problems.append(_describe_omegaconf_error(e, key))
    if problems:
        return None
    try:
        return OmegaConf.to_object(schema)
    except MissingMandatoryValue as e:
        problems.append(f"{e.full_key}: required but not set (give it on the command line: {e.full_key}=...)")
    except OmegaConfBaseException as e:
        problems.append(_describe_omegaconf_error(e, ""))
    return None


def _describe_omegaconf_error(e: OmegaConfBaseException, section: str) -> str:
    full_key = getattr(e, "full_key", None) or section
    if section and not full_key.startswith(section):
        full_key = f"{section}.{full_key}"
    msg = getattr(e, "msg", str(e)).splitlines()[0]
    return f"{full_key}: {msg}"


def _check_values(c: Config, problems: list[str]) -> None:
    # every float, checked by a rule below or not (weights, coefficients, limits)
    problems += [_not_finite(key, value) for key, value in _floats("", c) if not math.isfinite(value)]
    checkers = _checkers(problems)
    for check in (_check_model, _check_run, _check_agents_or_data, _check_engine, _check_eval, _check_trainer,
                  _check_algorithm, _check_rollout, _check_reward, _check_judge, _check_distill, _check_tools,
                  _check_cluster):
        check(c, problems, *checkers)
    _check_across(c, problems, *checkers)


def _check_model(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    _check_checkpoint_dir("model.path", c.model.path, problems)
    if c.model.tokenizer_path:
        _check_checkpoint_dir("model.tokenizer_path", c.model.tokenizer_path, problems, "tokenizer_config.json")


def _check_run(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    at_least("run.max_train_s", c.run.max_train_s, 0, "0: no limit")
    for key in ("max_engine_restarts", "max_worker_restarts", "max_trainer_restarts", "max_reward_restarts",
                "max_teacher_restarts"):
        at_least(f"run.{key}", getattr(c.run, key), 0, "0: the first such fault ends the run")
    need(0 < c.run.health_timeout_s <= MAX_TIMEOUT_S, "run.health_timeout_s", c.run.health_timeout_s,
         f"seconds in (0, {MAX_TIMEOUT_S:g}]")
    if c.run.resume_from == "latest":
        if not c.run.output_dir or latest_checkpoint(Path(c.run.output_dir)) is None:
            problems.append(f"run.resume_from=latest: no checkpoint in run.output_dir={c.run.output_dir!r} "
                            "(expected RUN_DIR/checkpoints/step_N)")
    elif c.run.resume_from and not (Path(c.run.resume_from) / "trainer_state.json").is_file():
        problems.append(f"run.resume_from={c.run.resume_from!r}: not an asyncrl checkpoint "
                        "(expected RUN_DIR/checkpoints/step_N with trainer_state.json)")


def _check_agents_or_data(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    """The `agents`, or the one dataset agent the `data` section makes."""
    if c.agents:
        _check_agents(c, need, at_least)
    else:
        _check_data("data", c.data, problems)


def cpu_dtype_problem(dtype: str, cpu_amx: str) -> str | None:
    """Why a vLLM-CPU engine of `dtype` (engine.dtype) cannot run on this CPU with `cpu_amx`
    (engine.cpu_amx), in one line; None if it can (the kernels vLLM-CPU picks by CPU feature:
    asyncrl/engine/vllm_compat.py)."""
    if dtype not in ("bfloat16", "float16") or cpu_amx == "off":
        return None
    if cpu_amx == "assume":
        return (f"engine.dtype={dtype} with engine.cpu_amx=assume: vLLM-CPU would run its AMX kernels, "
                "whatever the CPU has; assume is for float32 engines")
    from asyncrl.torch_compat import cpu_has_amx  # imports torch: only for the dtypes that need it

    if not cpu_has_amx():
        return None
    return (f"engine.dtype={dtype} on a CPU with AMX (amx_tile in lscpu's flags): vLLM-CPU packs its weights "
            "for AMX kernels that asyncrl's weight sync is not checked against; set engine.cpu_amx=off "
            "(vLLM's AVX-512 kernels) or engine.dtype=float32")


def _check_engine(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    e = c.engine
    one_of("engine.backend", e.backend, ENGINE_BACKENDS)
    one_of("engine.dtype", e.dtype, DTYPES)
    one_of("engine.cpu_amx", e.cpu_amx, CPU_AMX)
    within("engine.num_engines", e.num_engines, 1, MAX_WORKERS)
    within("engine.tensor_parallel_size", e.tensor_parallel_size, 1, MAX_PARALLEL)
    a = e.autoscale
    if a.enabled:
        within("engine.autoscale.min_engines", a.min_engines, 1, MAX_WORKERS)
        within("engine.autoscale.max_engines", a.max_engines, a.min_engines, MAX_WORKERS,
               "from engine.autoscale.min_engines")
        within("engine.num_engines", e.num_engines, a.min_engines, a.max_engines,
               "the engines a run starts with, between engine.autoscale.min_engines and max_engines")
        within("engine.autoscale.grow_when_trainer_idle", a.grow_when_trainer_idle, 0.0, 1.0)
        within("engine.autoscale.shrink_when_engines_idle", a.shrink_when_engines_idle, 0.0, 1.0)
        within("engine.autoscale.window_steps", a.window_steps, 1, 1000)
        at_least("engine.autoscale.cooldown_steps", a.cooldown_steps, 0)
    need(e.max_model_len <= MAX_MODEL_LEN, "engine.max_model_len", e.max_model_len,
         f"must be <= {MAX_MODEL_LEN} tokens")
    within("engine.max_num_seqs", e.max_num_seqs, 1, MAX_NUM_SEQS)
    within("engine.cpu_kvcache_space_gib", e.cpu_kvcache_space_gib, 1, MAX_KVCACHE_GIB, "vLLM-CPU needs a KV cache")
    need(re.fullmatch(r"auto|nobind|[0-9,\-|]+", e.cpu_threads_bind) is not None, "engine.cpu_threads_bind",
         e.cpu_threads_bind, 'must be "auto", "nobind" or a core list such as "0" or "0-3"')
    if c.cluster.device == "cpu" and e.backend == "vllm":  # this machine's CPU; each engine checks its own
        why = cpu_dtype_problem(e.dtype, e.cpu_amx)
        need(why is None, "engine.dtype", e.dtype, why or "")
    need(0 < e.gpu_memory_utilization <= 1, "engine.gpu_memory_utilization", e.gpu_memory_utilization,
         "must be in (0, 1]")
    need(e.num_cpus_per_engine > 0, "engine.num_cpus_per_engine", e.num_cpus_per_engine, "must be > 0")


def _check_eval(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    v = c.eval
    at_least("eval.max_concurrent", v.max_concurrent, 1)
    at_least("eval.max_deferred_syncs", v.max_deferred_syncs, 0, "0: training waits for an evaluation "
             "at the next weight sync")
    at_least("eval.periodic_num_problems", v.periodic_num_problems, 0, "0: eval.num_problems")
    at_least("eval.periodic_pass_k_problems", v.periodic_pass_k_problems, 0, "0: all the periodic problems")
    need(not v.adapter or os.path.isfile(os.path.join(v.adapter, "adapter_config.json")),
         "eval.adapter", v.adapter, "not a PEFT adapter directory (no adapter_config.json)")
    at_least("eval.every_steps", v.every_steps, 0, "0: only before and after training")
    need(1 <= v.num_problems <= c.data.heldout_size, "eval.num_problems", v.num_problems,
         f"must be in [1, data.heldout_size={c.data.heldout_size}]")
    within("eval.n_samples", v.n_samples, 1, MAX_GROUP_SIZE)
    for i, k in enumerate(v.pass_k if v.n_samples >= 1 else []):
        need(1 <= k <= v.n_samples, f"eval.pass_k[{i}]", k, f"must be in [1, eval.n_samples={v.n_samples}]")
    at_least("eval.temperature", v.temperature, 0)


def _check_trainer(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    t = c.trainer
    one_of("trainer.backend", t.backend, TRAINER_BACKENDS)
    need(t.expert_parallel_size >= 1 and t.data_parallel_size % t.expert_parallel_size == 0,
         "trainer.expert_parallel_size", t.expert_parallel_size,
         f"must divide trainer.data_parallel_size={t.data_parallel_size} (experts are split over data-parallel ranks)")
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        within(f"trainer.{name}", getattr(t, name), 1, MAX_PARALLEL)
    within("trainer.micro_batch_size", t.micro_batch_size, 0, MAX_SAMPLES_PER_STEP, "0: no limit but the tokens")
    within("trainer.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch, 1, MAX_MODEL_LEN * 64)
    one_of("trainer.recompute", t.recompute, RECOMPUTE)
    for name in ("mini_batches_per_step", "total_steps"):
        at_least(f"trainer.{name}", getattr(t, name), 1)
    need(0 < t.lr <= 1, "trainer.lr", t.lr, "must be in (0, 1] (e.g. 1e-4; a checkpoint holds no other)")
    if math.isfinite(t.lr):  # a bad lr is reported once, above
        need(0 <= t.min_lr <= t.lr, "trainer.min_lr", t.min_lr, f"must be in [0, trainer.lr={t.lr}]")
    one_of("trainer.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    at_least("trainer.warmup_steps", t.warmup_steps, 0)
    within("trainer.weight_decay", t.weight_decay, 0, 10, "a checkpoint holds no other")
    at_least("trainer.grad_clip", t.grad_clip, 0, "0 disables clipping")
    at_least("trainer.checkpoint_every", t.checkpoint_every, 0, "0: only at the end")
    need(t.num_cpus_per_rank > 0, "trainer.num_cpus_per_rank", t.num_cpus_per_rank, "must be > 0")
    within("trainer.torch_threads", t.torch_threads, 0, MAX_THREADS, "0: max(1, int(trainer.num_cpus_per_rank))")
    one_of("trainer.weight_sync_transport", t.weight_sync_transport, WEIGHT_SYNC_TRANSPORTS)
    for name in ("weight_sync_bucket_mb", "weight_sync_in_place_mb"):
        need(0 < getattr(t, name) <= MAX_BUFFER_MB, f"trainer.{name}", getattr(t, name),
             f"must be in (0, {MAX_BUFFER_MB}] MB")
    need(0 < t.dist_timeout_s <= MAX_TIMEOUT_S, "trainer.dist_timeout_s", t.dist_timeout_s,
         f"must be in (0, {MAX_TIMEOUT_S:g}] seconds")
    for name in ("adam_beta1", "adam_beta2"):
        need(0 <= getattr(t, name) < 1, f"trainer.{name}", getattr(t, name), "must be in [0, 1)")
    need(t.adam_eps > 0, "trainer.adam_eps", t.adam_eps, "must be > 0")


def _check_algorithm(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    a = c.algorithm
    need(a.n_samples_per_prompt >= 2 or a.advantage == "gae", "algorithm.n_samples_per_prompt",
         a.n_samples_per_prompt, "must be >= 2: group-relative advantages compare samples of the same prompt")
    need(a.n_samples_per_prompt <= MAX_GROUP_SIZE, "algorithm.n_samples_per_prompt", a.n_samples_per_prompt,
         f"must be <= {MAX_GROUP_SIZE}")
    at_least("algorithm.prompts_per_step", a.prompts_per_step, 1)
    at_least("algorithm.max_staleness", a.max_staleness, 0, "0 = synchronous on-policy")
    if a.max_staleness >= 0:  # (a negative one is reported on its own)
        need(0 <= a.policy_lag <= a.max_staleness, "algorithm.policy_lag", a.policy_lag,
             f"must be in [0, algorithm.max_staleness={a.max_staleness}] (no token may be staler than that)")
    at_least("algorithm.sync_every_steps", a.sync_every_steps, 1)
    one_of("algorithm.pause_mode", a.pause_mode, PAUSE_MODES)
    one_of("algorithm.routing_replay", a.routing_replay, ROUTING_REPLAYS)
    samples = a.prompts_per_step * a.n_samples_per_prompt
    need(samples <= MAX_SAMPLES_PER_STEP or a.n_samples_per_prompt > MAX_GROUP_SIZE, "algorithm.prompts_per_step",
         a.prompts_per_step,
         f"times algorithm.n_samples_per_prompt={a.n_samples_per_prompt} must be <= {MAX_SAMPLES_PER_STEP} "
         "samples per step")
    loss = a.loss
    one_of("algorithm.loss.type", loss.type, LOSS_TYPES)
    need(0 <= loss.clip_eps_low < 1, "algorithm.loss.clip_eps_low", loss.clip_eps_low, "must be in [0, 1)")
    at_least("algorithm.loss.clip_eps_high", loss.clip_eps_high, 0)
    at_least("algorithm.loss.importance_cap", loss.importance_cap, 1)
    at_least("algorithm.loss.kl_coef", loss.kl_coef, 0)
    at_least("algorithm.loss.entropy_coef", loss.entropy_coef, 0)
    one_of("algorithm.loss.aggregation", loss.aggregation, AGGREGATIONS)
    one_of("algorithm.advantage", a.advantage, ADVANTAGES)
    if a.advantage == "gae":
        _check_critic(c, problems, need, at_least)
    if loss.type == "gspo":  # its objective is a sequence's: a token mean would weight it by length
        need(loss.aggregation == "sequence", "algorithm.loss.aggregation", loss.aggregation,
             "gspo's ratio and objective are per sequence: needs algorithm.loss.aggregation=sequence")
        # one rule for every per-token advantage term under its one ratio per sequence
        per_token = [name for name, on in (("algorithm.advantage=gae", a.advantage == "gae"),
                                           ("algorithm.distill.teacher_path", bool(c.algorithm.distill.teacher_path)))
                     if on]
        need(not per_token, "algorithm.loss.type", loss.type,
             f"gspo takes one advantage per sequence; {' and '.join(per_token)} give(s) one per token")
    need(0 <= loss.seq_clip_eps_low < 1, "algorithm.loss.seq_clip_eps_low", loss.seq_clip_eps_low, "must be in [0, 1)")
    at_least("algorithm.loss.seq_clip_eps_high", loss.seq_clip_eps_high, 0)
    need(0 < loss.icepop_low <= 1 <= loss.icepop_high, "algorithm.loss.icepop_low", loss.icepop_low,
         f"must be in (0, 1], with algorithm.loss.icepop_high={loss.icepop_high} >= 1 (the band holds ratio 1)")


def _check_critic(c: Config, problems: list[str], need, at_least) -> None:
    cr = c.algorithm.critic
    if cr.path:
        _check_checkpoint_dir("algorithm.critic.path", cr.path, problems)
    need(c.trainer.pipeline_parallel_size == 1, "trainer.pipeline_parallel_size", c.trainer.pipeline_parallel_size,
         "must be 1 with algorithm.advantage=gae (the critic is not built for pipeline stages yet)")
    at_least("algorithm.critic.lr", cr.lr, 0, "0 = trainer.lr")
    need(0 < cr.gamma <= 1, "algorithm.critic.gamma", cr.gamma, "must be in (0, 1]")
    need(0 <= cr.lam <= 1, "algorithm.critic.lam", cr.lam, "must be in [0, 1]")
    need(cr.value_clip > 0, "algorithm.critic.value_clip", cr.value_clip, "must be > 0")


def _check_rollout(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    r = c.rollout
    within("rollout.num_workers", r.num_workers, 1, MAX_WORKERS)
    within("rollout.max_concurrent_loops", r.max_concurrent_loops, 1, MAX_CONCURRENT_LOOPS, "per worker")
    at_least("rollout.max_new_tokens", r.max_new_tokens, 1)
    need(r.temperature > 0, "rollout.temperature", r.temperature, "must be > 0 for RL sampling")
    need(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
    need(0 < r.reward_timeout_s <= MAX_TIMEOUT_S, "rollout.reward_timeout_s", r.reward_timeout_s,
         f"must be in (0, {MAX_TIMEOUT_S:g}] seconds")
    need(r.num_cpus_per_worker > 0, "rollout.num_cpus_per_worker", r.num_cpus_per_worker, "must be > 0")


def _check_reward(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    within("reward.max_abs", c.reward.max_abs, 1e-6, 1e12, "|reward| past it is a failure: 1e200 overflows "
           "a group's variance")
    for key, m in (("reward.model", c.reward.model), ("reward.prm", c.reward.prm)):
        if not m.path:
            continue
        _check_checkpoint_dir(f"{key}.path", m.path, problems)
        process = isinstance(m, ProcessRewardConfig)
        if problem := reward_model_problem(m.path, process):
            problems.append(f"{key}.path={m.path!r}: {problem}")
        within(f"{key}.num_actors", m.num_actors, 1, MAX_WORKERS)
        need(m.num_cpus_per_actor > 0, f"{key}.num_cpus_per_actor", m.num_cpus_per_actor, "must be > 0")
        within(f"{key}.max_batch", m.max_batch, 1, 4096)
        within(f"{key}.max_length", m.max_length, 8, 1 << 20, "tokens")
        if process:
            need(m.step_separator != "", f"{key}.step_separator", m.step_separator, "must not be empty")
            one_of(f"{key}.aggregate", m.aggregate, PRM_AGGREGATES)


def _check_distill(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    d, r = c.algorithm.distill, c.rollout
    if not d.teacher_path:
        return
    _check_checkpoint_dir("algorithm.distill.teacher_path", d.teacher_path, problems)
    within("algorithm.distill.num_engines", d.num_engines, 1, MAX_WORKERS)
    need(d.num_cpus_per_engine > 0, "algorithm.distill.num_cpus_per_engine", d.num_cpus_per_engine, "must be > 0")
    need(d.coef > 0, "algorithm.distill.coef", d.coef, "must be > 0 (no teacher: leave teacher_path empty)")
    # the teacher's logprobs are at temperature 1 over the whole vocabulary: the student's must be too
    need(r.temperature == 1 and r.top_p == 1, "rollout.temperature", r.temperature,
         f"must be 1 with rollout.top_p=1 (is {r.top_p}) for on-policy distillation: the reverse KL compares "
         "the distribution the student samples from with the teacher's")
    need(c.algorithm.advantage != "gae", "algorithm.advantage", c.algorithm.advantage,
         "gae with a distillation teacher is not built: use grpo, rloo or reinforce_pp")
    student, teacher = vocab_size(c.model.path), vocab_size(d.teacher_path)
    need(student is None or teacher is None or student == teacher, "algorithm.distill.teacher_path", d.teacher_path,
         f"has vocab_size {teacher}, the policy {student}: the teacher scores the student's token ids")


def _check_judge(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    j = c.reward.judge
    if not j.path:
        return
    _check_checkpoint_dir("reward.judge.path", j.path, problems)
    within("reward.judge.num_engines", j.num_engines, 1, MAX_WORKERS)
    need(j.num_cpus_per_engine > 0, "reward.judge.num_cpus_per_engine", j.num_cpus_per_engine, "must be > 0")
    one_of("reward.judge.parser", j.parser, JUDGE_PARSERS)
    need(j.min_score < j.max_score, "reward.judge.max_score", j.max_score,
         f"must be > reward.judge.min_score ({j.min_score})")
    within("reward.judge.max_new_tokens", j.max_new_tokens, 1, 4096)
    at_least("reward.judge.temperature", j.temperature, 0)
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(j.prompt_template) if f is not None}
    except ValueError:  # an unmatched brace
        fields = set()
    need(fields <= {"prompt", "response"} and ("response" in fields or j.parser == "match"),
         "reward.judge.prompt_template", j.prompt_template,
         "must hold {response} (and may hold {prompt}; with reward.judge.parser=match it may hold {prompt} alone), "
         "no other format field; a literal brace is written twice")


def _check_tools(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    t, sb = c.tools, c.tools.sandbox
    within("tools.max_calls", t.max_calls, 0, 1024)
    need(0 < t.timeout_s <= MAX_TIMEOUT_S, "tools.timeout_s", t.timeout_s, f"must be in (0, {MAX_TIMEOUT_S:g}] seconds")
    one_of("tools.parser", t.parser, TOOL_PARSERS)
    one_of("tools.sandbox.isolation", sb.isolation, SANDBOX_ISOLATIONS)
    need(sb.isolation != "none" or sb.allow_unisolated, "tools.sandbox.isolation", sb.isolation,
         "runs model-written code without isolation: also set tools.sandbox.allow_unisolated=true to accept that")
    within("tools.sandbox.cpu_s", sb.cpu_s, 1, 3600)
    need(0 < sb.wall_s <= 3600, "tools.sandbox.wall_s", sb.wall_s, "must be in (0, 3600] seconds")
    within("tools.sandbox.memory_mb", sb.memory_mb, 64, 1 << 20)
    within("tools.sandbox.max_file_mb", sb.max_file_mb, 0, 1 << 20)
    within("tools.sandbox.disk_mb", sb.disk_mb, 1, 1 << 20)
    within("tools.sandbox.max_processes", sb.max_processes, 1, 4096)
    within("tools.sandbox.max_output_bytes", sb.max_output_bytes, 1, 1 << 24)


def _check_cluster(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    """The cluster and logging sections."""
    one_of("cluster.device", c.cluster.device, DEVICES)
    at_least("cluster.num_gpus", c.cluster.num_gpus, 0)
    if c.cluster.num_cpus is not None:
        at_least("cluster.num_cpus", c.cluster.num_cpus, 1)
    one_of("logging.level", c.logging.level, LOG_LEVELS)
    one_of("logging.wandb.mode", c.logging.wandb.mode, WANDB_MODES)


def _check_across(c: Config, problems: list[str], need, at_least, one_of, within) -> None:
    """Rules that tie sections together."""
    a, t = c.algorithm, c.trainer
    need(c.engine.max_model_len > c.rollout.max_new_tokens, "engine.max_model_len", c.engine.max_model_len,
         f"must exceed rollout.max_new_tokens={c.rollout.max_new_tokens} to leave room for the prompt")
    for key, spec in (("engine.cpu_cores", c.engine.cpu_cores), ("rollout.cpu_cores", c.rollout.cpu_cores),
                      ("trainer.cpu_cores", c.trainer.cpu_cores)):
        _check_cores(key, spec, c.cluster.address, problems)
    _check_sim(c, need, at_least)
    _check_lora(c, need, within)
    need(a.pause_mode != "none" or t.lora.rank > 0, "algorithm.pause_mode", a.pause_mode,
         "none switches LoRA adapters without pausing: needs trainer.lora.rank > 0")
    if a.routing_replay == "r3":
        need(c.engine.backend == "vllm" and t.backend == "megatron", "algorithm.routing_replay", a.routing_replay,
             "needs engine.backend=vllm and trainer.backend=megatron (vLLM returns routes, megatron replays them)")
        model_type = checkpoint_model_type(c.model.path)
        need(model_type is None or model_type in MOE_MODEL_TYPES, "algorithm.routing_replay", a.routing_replay,
             f"needs a mixture-of-experts model ({', '.join(MOE_MODEL_TYPES)}); model.path is {model_type!r}")
    samples = a.prompts_per_step * a.n_samples_per_prompt
    need(1 <= t.mini_batches_per_step <= samples, "trainer.mini_batches_per_step", t.mini_batches_per_step,
         f"must be in [1, {samples}] (the samples per step: algorithm.prompts_per_step x n_samples_per_prompt)")


def _check_sim(c: Config, need: Callable, at_least: Callable) -> None:
    """Simulated backends come as a pair (the simulated broadcast carries no weights a real side could
    use), and only they may run on a scaled clock."""
    sim_engine, sim_trainer = c.engine.backend == "sim", c.trainer.backend == "sim"
    need(sim_engine == sim_trainer, "engine.backend", c.engine.backend,
         f"must be sim exactly when trainer.backend is (trainer.backend={c.trainer.backend}): use engine=sim "
         "trainer=sim together")
    need(c.cluster.time_scale > 0, "cluster.time_scale", c.cluster.time_scale, "must be > 0")
    need(c.cluster.time_scale == 1 or (sim_engine and sim_trainer), "cluster.time_scale", c.cluster.time_scale,
         "must be 1 unless engine.backend and trainer.backend are sim (real engines run in real time)")
    e = c.engine.sim
    for key in ("decode_base_s", "decode_per_seq_s", "decode_per_kv_token_s", "prefill_per_token_s", "load_s"):
        at_least(f"engine.sim.{key}", getattr(e, key), 0)
    at_least("engine.sim.prompt_tokens", e.prompt_tokens, 0, "0: the prompt's own length")
    at_least("engine.sim.length_median", e.length_median, 1)
    at_least("engine.sim.token_block", e.token_block, 1)
    need(1 <= e.replicas <= MAX_WORKERS, "engine.sim.replicas", e.replicas, f"must be in [1, {MAX_WORKERS}]")
    need(e.length_p99 >= e.length_median, "engine.sim.length_p99", e.length_p99,
         f"must be >= engine.sim.length_median={e.length_median}")
    need(all(len(row) == 2 and row[0] >= 1 and row[1] >= 0 for row in e.length_hist)
         and (not e.length_hist or sum(row[1] for row in e.length_hist) > 0),
         "engine.sim.length_hist", e.length_hist, "must be [[tokens >= 1, count >= 0], ...] with some count > 0")
    need(e.decode_base_s + e.decode_per_seq_s > 0 or not sim_engine, "engine.sim.decode_base_s",
         e.decode_base_s, "a decode step must take time (or engine.sim.decode_per_seq_s > 0)")
    s = c.trainer.sim
    for key in ("train_per_token_s", "logprob_per_token_s", "optimizer_s", "setup_s"):
        at_least(f"trainer.sim.{key}", getattr(s, key), 0)
    at_least("trainer.sim.weight_bytes", s.weight_bytes, 0)
    need(s.broadcast_bytes_per_s > 0, "trainer.sim.broadcast_bytes_per_s", s.broadcast_bytes_per_s, "must be > 0")
    need(0 < s.trained_share <= 1, "trainer.sim.trained_share", s.trained_share, "must be in (0, 1]")
    need(c.rollout.agent_loop != "sim_agent" or sim_engine, "rollout.agent_loop", c.rollout.agent_loop,
         "simulates tool-calling episodes on simulated engines: use it with engine=sim trainer=sim")
    ts = c.tools.sim
    for name, unit in (("calls", ""), ("latency", "_s"), ("result_tokens", "")):
        median, p99 = getattr(ts, f"{name}_median{unit}"), getattr(ts, f"{name}_p99{unit}")
        at_least(f"tools.sim.{name}_median{unit}", median, 0)
        need(p99 >= median, f"tools.sim.{name}_p99{unit}", p99, f"must be >= tools.sim.{name}_median{unit}={median}")
    overrides = c.simulate.sync_overrides
    need(not overrides or sim_engine, "simulate.sync_overrides", overrides,
         "only a scenario (engine=sim trainer=sim) has a simulated sync baseline")
    for o in overrides:
        key = o.split("=", 1)[0]
        need("=" in o and not key.startswith("simulate"), "simulate.sync_overrides", o,
             "each must be key=value on a section other than simulate")
    if overrides and all("=" in o for o in overrides):
        try:
            OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(list(overrides)))
        except OmegaConfBaseException as e:
            need(False, "simulate.sync_overrides", overrides, _describe_omegaconf_error(e, ""))


def with_overrides(c: Config, overrides: Sequence[str]) -> Config:
    """`c` with key=value overrides (as on the command line) applied, and checked again."""
    return validate(OmegaConf.merge(OmegaConf.structured(c), OmegaConf.from_dotlist(list(overrides))))


def _check_cores(key: str, spec: str, cluster_address: str, problems: list[str]) -> None:
    if not spec:
        return
    try:
        cores = parse_cores(spec)
    except ValueError as e:
        problems.append(f"{key}={spec!r}: {e}")
        return
    usable = os.sched_getaffinity(0)  # the cores this process (and an embedded cluster) may run on
    if not cluster_address and not cores <= usable:
        problems.append(f"{key}={spec!r}: cores {sorted(cores - usable)} are not available here "
                        f"(this machine offers {sorted(usable)})")


def _floats(key: str, value: Any) -> Iterator[tuple[str, float]]:
    """(key, value) of every float in a config: dataclass fields, list items and dict values."""
    if isinstance(value, float):
        yield key, value
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _floats(f"{key}.{f.name}" if key else f.name, getattr(value, f.name))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _floats(f"{key}.{k}", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _floats(f"{key}[{i}]", v)


def _check_lora(c: Config, need, within) -> None:
    lora = c.trainer.lora
    within("trainer.lora.rank", lora.rank, 0, MAX_LORA_RANK, "0: full fine-tuning")
    if lora.rank <= 0:
        return
    need(lora.alpha > 0, "trainer.lora.alpha", lora.alpha, "must be > 0 (adapters' outputs are scaled by alpha / rank)")
    need(0 <= lora.dropout < 1, "trainer.lora.dropout", lora.dropout, "must be in [0, 1)")
    targets = list(lora.target_modules)
    need(bool(targets) and set(targets) <= set(LORA_TARGET_MODULES) and len(set(targets)) == len(targets),
         "trainer.lora.target_modules", targets, f"distinct names among {list(LORA_TARGET_MODULES)}, at least one")
    need(c.trainer.backend == "megatron", "trainer.lora.rank", lora.rank,
         f"LoRA trains on the megatron trainer (trainer.backend={c.trainer.backend})")
    need(c.trainer.pipeline_parallel_size == 1, "trainer.lora.rank", lora.rank,
         "LoRA with trainer.pipeline_parallel_size > 1 is not supported yet")
    need(c.algorithm.pause_mode != "keep", "algorithm.pause_mode", c.algorithm.pause_mode,
         "with trainer.lora: abort or none (a kept request would go on with the old adapter under the new "
         "version; none lets it finish on its own adapter)")


def _check_data(key: str, d: Any, problems: list[str]) -> None:
    """A dataset agent's data settings (the `data` section, or an agent's params)."""
    need, at_least, one_of, within = _checkers(problems)
    one_of(f"{key}.source", d.source, DATA_SOURCES)
    if d.source == "reasoning_gym":
        need(len(d.tasks) > 0, f"{key}.tasks", [], "give at least one task, e.g. [{name: basic_arithmetic}]")
        known_tasks = _reasoning_gym_task_names()
        for i, task in enumerate(d.tasks):
            need(task.name in known_tasks, f"{key}.tasks[{i}].name", task.name,
                 "not a reasoning-gym task; e.g. basic_arithmetic, chain_sum, gsm_symbolic"
                 " (python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))' lists all)")
            at_least(f"{key}.tasks[{i}].weight", task.weight, 0)
        if d.tasks and all(t.weight >= 0 for t in d.tasks):
            need(sum(t.weight for t in d.tasks) > 0, f"{key}.tasks[*].weight", 0, "at least one weight must be > 0")
    elif d.source == "file":
        need(bool(d.path) and os.path.exists(d.path), f"{key}.path", d.path,
             "source=file needs an existing local .jsonl/.json/.parquet/.arrow file or datasets directory")
        need(not d.heldout_path or os.path.exists(d.heldout_path), f"{key}.heldout_path", d.heldout_path,
             "no such file")
        if d.answer_regex:
            try:
                need(re.compile(d.answer_regex).groups >= 1, f"{key}.answer_regex", d.answer_regex,
                     "needs a group: group 1 is the reference answer")
            except re.error as e:
                need(False, f"{key}.answer_regex", d.answer_regex, f"not a regular expression: {e}")
    if d.source == "reasoning_gym":  # generated up front, all of them
        for name in ("train_size", "heldout_size"):
            within(f"{key}.{name}", getattr(d, name), 1, MAX_GENERATED_PROBLEMS, "problems generated")
    else:  # at most this many rows of a file
        at_least(f"{key}.train_size", d.train_size, 1)
        at_least(f"{key}.heldout_size", d.heldout_size, 1)
    one_of(f"{key}.format", d.format, DATA_FORMATS)
    need(d.format != "verl" or d.source == "file", f"{key}.format", d.format,
         f"reads rows of a local file: needs {key}.source=file (not {d.source})")
    if d.format != "verl":  # verl rows bring their prompt as messages
        _check_prompt_template(f"{key}.prompt_template", d.prompt_template, d.source, need)
    # d.reward_function is loaded by asyncrl.agents.registry.check_registered (executing the file)
    for i, name in enumerate(d.tools):  # registered by name when the recipe's module is imported
        need(name.isidentifier(), f"{key}.tools[{i}]", name, "must be a tool's name (an identifier)")


def _check_prompt_template(key: str, template: str, source: str, need: Any) -> None:
    try:
        placeholders = [(f, spec, conversion) for _, f, spec, conversion in string.Formatter().parse(template)
                        if f is not None]
    except ValueError as e:
        need(False, key, template, f"not a format string: {e} (write {{{{ for a literal {{)")
        return
    # `{question.__class__}` would read attributes, `{question:>999999999}` pad without bound
    if not all(f.isidentifier() and not spec and conversion is None for f, spec, conversion in placeholders):
        need(False, key, template, "placeholders must be plain names such as {question}: "
                                   "no attributes, indexes, conversions or format specs")
        return
    fields = {f for f, _, _ in placeholders}
    if source == "reasoning_gym":  # {question} or fields of the task's metadata, checked when generating
        need(bool(fields), key, template,
             "needs a placeholder: {question}, or a field of the task's metadata such as chain_sum's {expression}")
    else:
        need(fields == {"question"}, key, template, "must contain the placeholder {question} and no other")


def _check_agents(c: Config, need: Any, at_least: Any) -> None:
    """What the schema can check of the `agents` list; their types, params and loops are checked
    against the registries (asyncrl.agents.registry.check_registered)."""
    seen: set[str] = set()
    for i, spec in enumerate(c.agents):
        key = f"agents[{i}]"
        need(spec.env_id not in seen, f"{key}.env_id", spec.env_id, "duplicate: each agent needs its own env_id")
        need(bool(spec.env_id) and "/" not in spec.env_id and ":" not in spec.env_id, f"{key}.env_id",
             spec.env_id, "must be a non-empty name without '/' or ':'")
        seen.add(spec.env_id)
        at_least(f"{key}.weight", spec.weight, 0, "0: evaluation only")
    weighted = [s for s in c.agents if s.weight > 0]
    need(bool(weighted), "agents[*].weight", [s.weight for s in c.agents],
         "at least one agent needs a weight > 0 (weight 0: evaluation only)")
    need(len(weighted) <= c.algorithm.prompts_per_step, "algorithm.prompts_per_step", c.algorithm.prompts_per_step,
         f"must be >= the number of training agents ({len(weighted)}): each gets at least one group per step")


# A Hugging Face Hub id ("Qwen/Qwen2.5-0.5B-Instruct"): vLLM and the trainer download it at start.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _check_checkpoint_dir(key: str, path: str, problems: list[str], marker: str = "config.json") -> None:
    if not os.path.exists(path) and _HUB_ID.fullmatch(path):
        return
    if not os.path.isdir(path):
        problems.append(f"{key}={path!r}: no such directory; give a Hugging Face checkpoint directory or Hub id "
                        "(config.json, safetensors, tokenizer files). The tiny base model is rebuilt by "
                        "`python scripts/build_base_model.py`")
    elif not os.path.isfile(os.path.join(path, marker)):
        problems.append(f"{key}={path!r}: the directory has no {marker}; give a Hugging Face checkpoint directory")


def _reasoning_gym_task_names() -> set[str]:
    import reasoning_gym.factory  # imported here: it takes ~1 s and only validation needs it

    return set(reasoning_gym.factory.DATASETS)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory (`run.resume_from=latest`)."""
    done = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / "run_state.json").is_file()]
    return max(done, key=lambda p: p.name) if done else None
