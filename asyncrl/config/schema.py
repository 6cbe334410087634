"""The typed config schema: one dataclass per Hydra config group.

The YAML files in `conf/` and each recipe's `config.yaml` fill these in; `validate()`
(in `validate.py`) merges the composed Hydra config into them, so every key and type
is checked, then checks the values. What the rest of asyncrl receives is a `Config`
instance: plain dataclasses, picklable, safe to hand to actors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

# The choices of the string-valued settings (validate.py checks them; the code that
# acts on a setting imports its choices from here).
ENGINE_BACKENDS = ("vllm", "sim")  # sim: asyncrl/engine/sim_engine.py
TRAINER_BACKENDS = ("megatron", "sim")  # sim: asyncrl/trainer/sim_trainer.py
DEVICES = ("cpu", "cuda")
DATA_SOURCES = ("reasoning_gym", "file")
DATA_FORMATS = ("qa", "verl")  # the row layout of a source=file dataset (DataConfig.format)
LOSS_TYPES = ("grpo", "decoupled_ppo", "tis", "gspo", "cispo", "icepop")
ADVANTAGES = ("grpo", "rloo", "reinforce_pp", "gae")
# auto: shared memory (CPU) or CUDA IPC (GPU) where every engine is on trainer rank 0's host or
# GPU, else the broadcast (asyncrl/sync/shared_buckets.py)
WEIGHT_SYNC_TRANSPORTS = ("auto", "broadcast", "shared_memory")
PAUSE_MODES = ("abort", "keep", "none")  # none: trainer.lora only, adapters switched without a pause
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron's names
MAX_LORA_RANK = 256  # vLLM's largest but one (max_lora_rank: 1, 8, 16, 32, 64, 128, 256, 320, 512)
ROUTING_REPLAYS = ("none", "r3")  # r3: rollout routing replay (docs/moe.md)
# the mixture-of-experts model types the megatron trainer loads (qwen2_moe: with a shared expert;
# deepseek_v3: multi-head latent attention, shared experts, a sigmoid router with group top-k;
# glm4_moe: DeepSeek-V3's router and shared expert under GQA attention with QKV bias and partial rope)
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe", "qwen3_5_moe_text")
AGGREGATIONS = ("token", "sequence")
LR_SCHEDULES = ("constant", "cosine")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_AMX = ("auto", "off", "assume")
DEFAULT_MAX_ABS_REWARD = 1e6  # reward.max_abs
WANDB_MODES = ("offline", "online", "disabled")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SANDBOX_ISOLATIONS = ("bwrap", "none")
TOOL_PARSERS = ("hermes", "simple")  # agent_loops.tool_parsers


@dataclass
class RunConfig:
    name: str = "asyncrl"
    seed: int = 0
    # Where metrics, checkpoints and the exported policy go. Empty: Hydra's run dir.
    output_dir: str = ""
    # A checkpoint directory (RUN_DIR/checkpoints/step_N) to continue from: trainer state,
    # queue contents, prompt ledger, problem stream and the snapshot of every loop that was
    # running (each continues where it stopped). "latest": the newest checkpoint in run.output_dir.
    resume_from: str = ""
    # Faults survived before the run stops (a dead engine or rollout worker is replaced; a dead
    # trainer rank restarts the trainer from the newest checkpoint of this run).
    max_engine_restarts: int = 4
    max_worker_restarts: int = 4
    max_trainer_restarts: int = 2
    # of each scoring service (asyncrl/reward/services.py): reward.model's and reward.prm's replicas,
    # reward.judge's engines
    max_reward_restarts: int = 4
    max_teacher_restarts: int = 4  # of the distillation teacher's engines (algorithm.distill)
    # An engine or rollout worker that does not answer a health check within this many
    # seconds counts as dead (it hangs).
    health_timeout_s: float = 120.0
    # Stop training after this many seconds of training (setup and every evaluation not
    # counted), even before trainer.total_steps; 0: no limit.
    max_train_s: float = 0.0


@dataclass
class ModelConfig:
    # A Hugging Face checkpoint directory (config.json, safetensors, tokenizer files).
    path: str = MISSING
    # Tokenizer directory; empty means `path`.
    tokenizer_path: str = ""
    # The chat template problems given as messages are rendered with: empty means the
    # tokenizer's own; otherwise the name of one shipped in agent_loops/chat_templates/.
    chat_template: str = ""


@dataclass
class TaskConfig:
    """One reasoning-gym task: its generator name, mixing weight and generator settings."""

    name: str = MISSING
    weight: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """Where a dataset agent's problems come from (the `data` section is the recipe's
    default agent; each entry of `agents` with type dataset has its own in `params`)."""

    source: str = "reasoning_gym"  # reasoning_gym | file
    # source=reasoning_gym: the generators, mixed by weight.
    tasks: list[TaskConfig] = field(default_factory=list)
    # source=file: a local .jsonl / .json / .parquet / .arrow file (or a `datasets.save_to_disk`
    # directory), read with Hugging Face `datasets`; nothing is downloaded.
    path: str = ""
    # The rows' layout. qa: a question and an answer field (question_field, answer_field, and
    # optionally `messages`). verl: verl's RL parquet layout: `prompt` (chat messages, the
    # conversation), `reward_model.ground_truth` (the answer), `data_source`, `extra_info`
    # (question_field, answer_field, answer_regex and prompt_template are not used).
    format: str = "qa"
    # A separate held-out file; empty: the last `heldout_size` rows of `path` (after a seeded
    # shuffle) are held out.
    heldout_path: str = ""
    question_field: str = "question"
    answer_field: str = "answer"
    # A regex whose group 1 is the reference answer inside the answer field (GSM8K: "####\s*(.+)$");
    # empty: the whole field.
    answer_regex: str = ""
    train_size: int = 20000  # reasoning_gym: problems generated; file: at most this many rows
    heldout_size: int = 500
    # Train and held-out problems come from different seeds; held-out questions that
    # also occur in the train split are removed from the train split.
    train_seed: int = 1
    heldout_seed: int = 2
    # `{question}` is replaced by the task's question text; reasoning-gym tasks may also use
    # fields of their metadata (chain_sum: `{expression}`).
    prompt_template: str = "{question}"
    # Chat: with a system prompt or tools, each problem is a conversation (the system prompt,
    # then the formatted prompt as the user's message) rendered with the model's chat template
    # (model.chat_template), offering `tools` (names of registered tools, agent_loops/tools).
    # A file row with a `messages` field (OpenAI chat messages) is that conversation instead.
    system_prompt: str = ""
    tools: list[str] = field(default_factory=list)
    # A reward function with verl's signature, compute_score(data_source, solution_str,
    # ground_truth, extra_info=None) -> float | {"score": float, ...}, in a Python file:
    # "path/to/score.py::compute_score" (the name defaults to compute_score; a relative path is
    # relative to the directory the command runs in). It replaces the recipe's reward for this
    # dataset. Empty: the recipe module's reward.
    reward_function: str = ""


@dataclass
class AgentConfig:
    """One environment a recipe trains or evaluates on (see asyncrl/agents/)."""

    env_id: str = MISSING  # unique; tags its trajectories and its evaluation metrics
    type: str = "dataset"  # a registered agent type: dataset | reward_only | remote
    weight: float = 1.0  # share of the training groups; 0: evaluation only
    agent_loop: str = ""  # empty: rollout.agent_loop
    # The type's own settings, checked against its params dataclass at validation:
    # dataset: the keys of DataConfig (+ module); reward_only: module, max_turns, ...;
    # remote: url, remote_env_id, token_env.
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class SimEngineConfig:
    """engine.backend=sim: an engine that runs no model but takes the time one would, in
    simulated seconds (asyncrl/engine/sim_engine.py; conf/engine/sim.yaml)."""

    # One decode step of the running batch (continuous batching, every running request gains a
    # token): decode_base_s + decode_per_seq_s x requests + decode_per_kv_token_s x their tokens so far.
    decode_base_s: float = 0.01
    decode_per_seq_s: float = 0.0
    decode_per_kv_token_s: float = 0.0
    prefill_per_token_s: float = 0.0  # a request's prompt, added to the step that admits it
    # Prefill this many tokens per request; 0: the request's own prompt.
    prompt_tokens: int = 0
    # Response lengths: lognormal with this median and 99th percentile (tokens), cut at the
    # request's max_new_tokens; or, when `length_hist` is given ([[tokens, count], ...]), drawn from it.
    length_median: int = 512
    length_p99: int = 4096
    length_hist: list[list[int]] = field(default_factory=list)
    load_s: float = 1.0  # loading new weights once received
    # One simulated token stands for this many: lengths above are in tokens, a response gets one
    # simulated token per block (rollout.max_new_tokens and engine.max_model_len count blocks),
    # and each costs a block's decode steps here and a block's tokens in the simulated trainer.
    # Long responses (28K tokens) then cost the control plane blocks, not tokens.
    token_block: int = 1
    # A conversation's later turns, and a response's continuation, prefill only what follows the
    # context's last response token (vLLM's prefix cache holds the rest); off: the whole context.
    prefix_cache: bool = False
    # Simulated engines (each engine.tensor_parallel_size devices) per engine actor: the scenario
    # has engine.num_engines x replicas of them. A Ray actor process costs this machine about 1 %
    # of a core even idle: a hundred engine processes would saturate two cores.
    replicas: int = 1
    seed: int = 0


@dataclass
class AutoscaleConfig:
    """engine.autoscale: grow the engines when the trainer waits for data, shrink them when they
    idle (asyncrl/control/elastic.py; docs/scale.md). Each rule looks at the mean of the last
    `window_steps` steps; after a change none fires for `cooldown_steps` steps."""

    enabled: bool = False
    min_engines: int = 1
    max_engines: int = 4
    # add an engine while the trainer waited for groups this share of its steps (idle/trainer) ...
    grow_when_trainer_idle: float = 0.3
    # ... remove one while the engines were idle this share of theirs (idle/engines) and the trainer was not waiting
    shrink_when_engines_idle: float = 0.5
    window_steps: int = 3
    cooldown_steps: int = 5


@dataclass
class EngineConfig:
    backend: str = "vllm"
    num_engines: int = 1
    tensor_parallel_size: int = 1
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    max_model_len: int = 256
    max_num_seqs: int = 256
    seed: int = 0
    enforce_eager: bool = True
    cpu_kvcache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE; vLLM-CPU fails to start without it
    # VLLM_CPU_OMP_THREADS_BIND: "auto" (engine.cpu_cores if set, else vLLM's: every core of the
    # NUMA node), "nobind", or cores such as "0" or "0-3". Binding the engine to fewer cores than
    # the machine has keeps its OpenMP threads from fighting the trainer's when both run at once.
    cpu_threads_bind: str = "auto"
    # CPU only: the cores the engine actor and every vLLM process it starts may run on ("0",
    # "0-3"; "" = any). With rollout.cpu_cores and trainer.cpu_cores this splits the machine into
    # a generation side and a training side, for fully async runs where both work at once.
    cpu_cores: str = ""
    # CPU, one worker (tensor_parallel_size=1): run the model inside vLLM's engine-core process
    # (vLLM's single-process executor) instead of a separate worker process that the engine core
    # busy-polls through shared memory: per engine 0.5 GiB, a busy-polling process and its
    # import of vLLM (~29 CPU-s a start on a 2-vCPU EPYC) less, and faster weight syncs
    # (docs/benchmarks.md). false: vLLM-CPU's officially supported layout (a worker process).
    cpu_model_in_engine_core: bool = True
    # CPU: vLLM-CPU packs each linear weight for oneDNN, and must pack again after every
    # weight sync (most of a sync's time here). false keeps the plain weights and multiplies
    # with torch's linear: a sync is then a copy in place, generation the same speed on the
    # tiny models, 6-12 % slower at hidden 512 (docs/benchmarks.md).
    cpu_prepack_weights: bool = True
    # CPU: the AMX kernels of vLLM-CPU (Sapphire Rapids and newer). "auto": where the CPU has AMX;
    # they serve bf16/fp16 only, and fp32 runs the same kernels either way. "off": AMX hidden from
    # vLLM (a bf16/fp16 engine on an AMX CPU needs it). "assume": an AMX CPU's choices on any CPU,
    # for tests of them (fp32 only). asyncrl/engine/vllm_compat.py lists the choices.
    cpu_amx: str = "auto"
    gpu_memory_utilization: float = 0.85
    num_cpus_per_engine: float = 1.0
    # Custom Ray resources each engine's placement bundle needs, to put engines on the nodes that
    # offer them (`ray start --resources='{"engine_node": 8}'`; docs/scale.md, multi-node).
    resources: dict[str, float] = field(default_factory=dict)
    sim: SimEngineConfig = field(default_factory=SimEngineConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)


@dataclass
class SimTrainerConfig:
    """trainer.backend=sim: one actor that trains nothing but takes the time the configured
    trainer (tensor x pipeline x data parallel ranks) would, in simulated seconds
    (asyncrl/trainer/sim_trainer.py; conf/trainer/sim.yaml)."""

    # Forward + backward per token (prompt and response) on one model replica (tp x pp devices);
    # data parallelism divides the tokens.
    train_per_token_s: float = 1e-5
    # A forward-only pass per token where the loss needs one (decoupled_ppo with several
    # mini-batches: the proximal logprobs; kl_coef > 0: the reference's).
    logprob_per_token_s: float = 3e-6
    optimizer_s: float = 1.0  # per optimizer update
    weight_bytes: int = 2 * 10**9  # the policy as broadcast to the engines
    broadcast_bytes_per_s: float = 1e10  # trainer -> engines
    setup_s: float = 0.0
    # The share of the generated samples the real trainer would train: simulated rewards carry no
    # signal, so every group reaches this trainer, which pays for this share of their tokens
    # (e.g. 0.72 where a real run filters 28 % of its samples in uniform groups).
    trained_share: float = 1.0


@dataclass
class LoRAConfig:
    """trainer.lora: train low-rank adapters on the frozen base model (docs/lora.md)."""
    rank: int = 0  # 0: full fine-tuning
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0
    # megatron's layer names (as Megatron-Bridge's LoRA): linear_qkv (q, k, v), linear_proj (o),
    # linear_fc1 (gate, up), linear_fc2 (down)
    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1",
                                                                 "linear_fc2"])


@dataclass
class TrainerConfig:
    backend: str = "megatron"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # MoE: experts split over this many of the data-parallel ranks (megatron's expert parallelism).
    expert_parallel_size: int = 1
    # A micro-batch (one forward/backward on one data-parallel rank) packs trajectories up to this
    # many tokens (a longer trajectory is trained alone): memory is linear in it (docs/trainer.md).
    max_tokens_per_micro_batch: int = 8192
    micro_batch_size: int = 0  # and at most this many trajectories (0: no limit but the tokens)
    # Activation recomputation: none | selective (the MLPs' activations, recomputed in backward) | full
    # (each layer's, keeping only its input)
    recompute: str = "none"
    mini_batches_per_step: int = 1  # optimizer updates per train step (>1: PPO-style, pi_prox != pi_theta)
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    total_steps: int = 100
    checkpoint_every: int = 0  # 0: only at the end
    num_cpus_per_rank: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per rank: see engine.resources
    cpu_cores: str = ""  # CPU only: cores the trainer ranks run on ("" = any); see engine.cpu_cores
    torch_threads: int = 0  # intra-op threads per rank; 0: max(1, int(num_cpus_per_rank))
    weight_sync_bucket_mb: float = 16.0  # the broadcast to the engines packs tensors into buffers of this size
    # Tensors of at least this size travel alone, so that engines can receive them straight into their parameters.
    weight_sync_in_place_mb: float = 1.0
    weight_sync_transport: str = "auto"  # auto | broadcast | shared_memory (WEIGHT_SYNC_TRANSPORTS)
    dist_timeout_s: float = 600.0  # collectives that wait longer fail instead of hanging
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    sim: SimTrainerConfig = field(default_factory=SimTrainerConfig)


@dataclass
class LossConfig:
    # grpo: PPO-clip against the behaviour logprobs; decoupled_ppo: against recomputed
    # proximal logprobs with a truncated behaviour weight; tis: truncated IS REINFORCE; gspo:
    # PPO-clip of a sequence-level ratio; cispo: REINFORCE with a clipped, stop-gradient IS
    # weight on every token; icepop: decoupled PPO whose behaviour weight is 0 outside a band
    # instead of truncated (asyncrl/algorithm/losses.py has the formulas).
    type: str = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28  # also cispo's IS weight bound: min(pi / mu, 1 + clip_eps_high)
    importance_cap: float = 5.0  # C: truncation of pi_prox / mu (decoupled_ppo, tis)
    # gspo's clip of the sequence ratio: the GSPO paper's 3e-4 below, 4e-4 above
    seq_clip_eps_low: float = 3e-4
    seq_clip_eps_high: float = 4e-4
    # icepop: a token's weight is pi_prox / mu inside [icepop_low, icepop_high], 0 outside (the paper's band)
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    kl_coef: float = 0.0  # k3 KL to the reference policy; 0 disables the reference model
    entropy_coef: float = 0.0
    aggregation: str = "token"  # token | sequence
    normalize_adv_std: bool = True
    # drop groups whose rewards are all equal; null: by the advantage (grpo, rloo: yes; reinforce_pp: no,
    # its batch statistics count them): asyncrl/algorithm/advantages.py filters_uniform_groups
    filter_uniform_groups: bool | None = None
    # DAPO's overlong filtering: a response cut at max_new_tokens still counts in its group's
    # advantages but is not trained on (its reward says nothing about its tokens).
    mask_truncated: bool = False


@dataclass
class CriticConfig:
    # algorithm.advantage=gae: PPO's value model, trained in the trainer ranks beside the policy
    # (asyncrl/trainer/critic.py): the backbone of `path` with a scalar head (zeros at the start:
    # every value is 0 until it learns), its own Adam at `lr` (constant), its own checkpoint entries.
    path: str = ""  # a causal LM checkpoint with the policy's tokenizer; "" = model.path
    lr: float = 0.0  # 0 = trainer.lr
    gamma: float = 1.0  # discount per trained token
    lam: float = 1.0  # GAE's lambda: 1 = Monte Carlo returns minus the values, 0 = one-step TD
    value_clip: float = 0.5  # PPO's clip of the new value around the value the step started with


@dataclass
class DistillConfig:
    # On-policy distillation: a teacher on vLLM engines of its own (never trained) scores every
    # token of each training sample; each trained token's advantage gains
    # coef x (log teacher(token) - log mu(token)), minus the per-token reverse KL (docs/algorithms.md).
    teacher_path: str = ""  # "" = no distillation; a causal LM with the policy's vocabulary
    coef: float = 1.0
    num_engines: int = 1
    num_cpus_per_engine: float = 0.5


@dataclass
class AlgorithmConfig:
    n_samples_per_prompt: int = 8
    prompts_per_step: int = 32  # B
    # eta: a token may be at most this many policy versions older than the trainer.
    max_staleness: int = 1
    # Controlled staleness: the engines run the policy this many versions behind the trainer (a
    # sync to version v gives them version v - policy_lag, kept by trainer rank 0), and admission
    # runs max_staleness - policy_lag versions ahead. With partial_rollout=false and
    # max_staleness = policy_lag every trained token is exactly policy_lag versions old (once
    # that many versions exist). 0: the engines get the trainer's newest weights.
    policy_lag: int = 0
    sync_every_steps: int = 1  # weight sync every k trainer steps
    partial_rollout: bool = True
    pause_mode: str = "abort"  # abort | keep
    # MoE models: r3 makes the trainer route each token to the experts the engine chose for it
    # (docs/moe.md). none: the trainer's router decides. The engines return the routes of an MoE
    # model's tokens either way (the trainer reports how often its router agrees).
    routing_replay: str = "none"
    # grpo: (r - group mean) / group std (loss.normalize_adv_std); rloo: r minus the mean of the
    # group's other rewards; reinforce_pp: (r - batch mean) / batch std over the step's samples;
    # gae: per token, from a value model (`critic`), whitened over the step with
    # loss.normalize_adv_std (groups of equal rewards are trained: the values still differ)
    advantage: str = "grpo"
    loss: LossConfig = field(default_factory=LossConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class RolloutConfig:
    num_workers: int = 1
    max_concurrent_loops: int = 64
    agent_loop: str = "partial_single_turn"
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    reward_timeout_s: float = 10.0
    num_cpus_per_worker: float = 0.5
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per worker: see engine.resources
    cpu_cores: str = ""  # CPU only: cores the rollout workers run on ("" = any); see engine.cpu_cores
    # At every weight sync each worker's unfinished groups (finished samples, and in abort mode
    # every loop's snapshot) go to the object store, so that a replacement of a dead worker
    # continues them (docs/faults.md). Costs a copy of their tokens a sync.
    mirror_loops: bool = True


@dataclass
class RewardModelConfig:
    # A discriminative reward model the run serves: a Hugging Face sequence-classification
    # checkpoint with one output (num_labels=1) that scores each finished training sample, its
    # prompt and response through the model's own chat template where it has one
    # (docs/algorithms.md, "Reward models"). Held-out evaluations keep the envs' own rewards.
    path: str = ""  # "" = none
    # A training sample's reward = reward.env_weight x the env's reward + weight x the model's score.
    weight: float = 1.0
    num_actors: int = 1  # replicas, each a Ray actor scoring batches
    num_cpus_per_actor: float = 0.5  # (its bundle in the run's placement group, as a worker's)
    max_batch: int = 32  # samples scored in one forward pass
    max_length: int = 1024  # tokens it reads; a longer sample is cut on the left (the response is kept)


PRM_AGGREGATES = ("min", "mean", "last")


@dataclass
class ProcessRewardConfig(RewardModelConfig):
    # A process reward model the run serves: a Hugging Face token-classification checkpoint with
    # one output. The response is cut into steps at `step_separator`; each step's score is the
    # head's output at its last token, and the sample's score the steps' `aggregate` (min: a
    # chain of steps is as good as its worst; mean; last). A response with no step scores 0.
    # Its fields above as reward.model's; weight: its score's in a training sample's reward.
    step_separator: str = "\n"
    aggregate: str = "min"


JUDGE_PARSERS = ("number", "yes_no", "match")


@dataclass
class JudgeConfig:
    # A generative judge the run serves: a model on vLLM engines of its own, never trained, asked
    # about each finished training sample with `prompt_template` (through its chat template where
    # it has one); `parser` turns its answer into a score in [0, 1] (docs/algorithms.md, "Judges").
    path: str = ""  # "" = none
    weight: float = 1.0  # the score's weight in a training sample's reward, beside the env's and the reward model's
    num_engines: int = 1
    num_cpus_per_engine: float = 0.5
    # Python format fields: {prompt} (the prompt's text, or its last user message), {response}
    prompt_template: str = "Question: {prompt}\nAnswer: {response}\nIs the answer correct? Reply yes or no.\n"
    # number: the first number of the answer, clamped to [min_score, max_score] and scaled to [0, 1];
    # yes_no: 1 for an answer that starts with "yes", 0 for "no"; match: the judge solves the
    # problem itself (a template without {response}), 1 when its answer's last number is the
    # response's last number, else 0. Anything else: the sample's reward is 0 and the failure is
    # counted (judge_unparsable).
    parser: str = "yes_no"
    min_score: float = 0.0
    max_score: float = 10.0
    max_new_tokens: int = 8
    temperature: float = 0.0  # greedy: the same sample always gets the same verdict


@dataclass
class RewardConfig:
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    prm: ProcessRewardConfig = field(default_factory=ProcessRewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    env_weight: float = 1.0  # the weight of the env's own reward (its rule or hook) beside the services'
    # |reward| past this is a counted failure (reward 0), from a reward function, a service or an env
    # server, and refused in a checkpoint: 1e200 overflows a group's variance, 1e308 its mean.
    max_abs: float = DEFAULT_MAX_ABS_REWARD


@dataclass
class SandboxConfig:
    """Where and under which limits model-written code runs (docs/security.md)."""

    # bwrap: bubblewrap namespaces (no network, own PID/mount/IPC/UTS), a read-only view of
    # /usr and the interpreter, an unprivileged user, a system-call filter. none: a plain child process with the
    # limits below but no isolation; refused unless allow_unisolated is set.
    isolation: str = "bwrap"
    allow_unisolated: bool = False
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512  # address space, per process
    max_file_mb: int = 16  # largest file the code may write
    disk_mb: int = 64  # bwrap: the writable directory, a tmpfs inside the container (host memory while it runs)
    max_processes: int = 16  # processes and threads of the sandbox's user
    max_output_bytes: int = 4000  # read from the code's stdout+stderr; the rest is never read


@dataclass
class SimToolsConfig:
    """rollout.agent_loop=sim_agent (scenarios on simulated engines, agent_loops/sim_agent.py):
    an episode's tool calls, each a latency and a result, drawn from lognormals given by their
    median and 99th percentile. Latencies are in the run's (simulated) seconds; results in
    simulated tokens, blocks of engine.sim.token_block, as rollout.max_new_tokens counts them."""

    calls_median: float = 4.0  # tool calls an episode makes (at tools.max_calls it ends, truncated)
    calls_p99: float = 16.0
    latency_median_s: float = 1.0
    latency_p99_s: float = 10.0
    result_tokens_median: float = 16.0
    result_tokens_p99: float = 128.0
    seed: int = 0


@dataclass
class ToolsConfig:
    """The tools that tool-calling agent loops (partial_tool, chat_tool) run."""

    max_calls: int = 4  # per trajectory; at the limit the trajectory ends, truncated
    # How chat_tool reads calls: hermes (<tool_call>{"name": ..., "arguments": ...}</tool_call>)
    # or simple (<tool:NAME>ARGUMENT</tool>, the markup partial_tool always reads).
    parser: str = "hermes"
    timeout_s: float = 30.0  # per call, whatever the tool
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    sim: SimToolsConfig = field(default_factory=SimToolsConfig)


@dataclass
class ClusterConfig:
    # Empty: start an embedded local Ray cluster; "auto": join the running one
    # (what `ray job submit` does); or a "host:port" address.
    address: str = ""
    device: str = "cpu"  # cpu | cuda
    num_cpus: int | None = None  # embedded cluster only; None: all cores
    num_gpus: int = 0
    dashboard: bool = True  # embedded cluster: on 127.0.0.1 only
    # Embedded cluster: Ray's Prometheus metrics endpoint (the ray_asyncrl_* gauges). Ray binds it
    # to every interface, unauthenticated, so it is off unless asked for (docs/security.md).
    ray_metrics: bool = False
    # Simulated seconds per real second, with engine.backend=sim and trainer.backend=sim: every time
    # the run logs is then simulated time (timeouts stay real). 1 with real backends.
    time_scale: float = 1.0


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: str = "offline"  # offline | online | disabled
    project: str = "asyncrl"
    entity: str = ""


@dataclass
class LoggingConfig:
    level: str = "INFO"
    jsonl: bool = True
    progress_bar: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class EvalConfig:
    every_steps: int = 10  # 0: only before and after training
    num_problems: int = 500  # taken from the held-out split
    n_samples: int = 8  # for pass@k
    pass_k: list[int] = field(default_factory=lambda: [1, 8])
    temperature: float = 1.0
    periodic_pass_k: bool = True  # evaluations during training sample pass@k too (not only greedy)
    # Evaluations during training take the first this many held-out problems of each env (0: all
    # num_problems); the base and final evaluations take num_problems.
    periodic_num_problems: int = 100
    # ... of which the first this many of each env are sampled for pass@k (the others greedily
    # only): sampling costs n_samples requests a problem, and beside training the engines' work
    # for an evaluation is taken from the rollouts' (docs/evaluation.md). 0: all of them.
    periodic_pass_k_problems: int = 20
    # Evaluations during training run on the engines beside the rollouts (the trainer goes on; the
    # result is logged at the step it arrives), each worker sending at most `max_concurrent` of
    # their requests at once. The engines keep the evaluated policy until the evaluation ends:
    # weight syncs wait (the trainer trains on, as with sync_every_steps > 1), at most
    # `max_deferred_syncs` of them; then training waits for it. false: training waits for them.
    beside_training: bool = True
    max_concurrent: int = 16
    max_deferred_syncs: int = 2
    # `asyncrl eval` only: an OpenAI-compatible completions endpoint (e.g. `vllm serve`) to
    # evaluate instead of starting vLLM; empty: vLLM in process on model.path.
    endpoint: str = ""
    endpoint_model: str = ""  # the model name the endpoint serves; empty: model.path
    # `asyncrl eval` only: a PEFT LoRA adapter of model.path (adapter_config.json and its
    # safetensors, e.g. RUN_DIR/final_policy/adapter), served by vLLM as a LoRA adapter
    adapter: str = ""


@dataclass
class SimulateConfig:
    """`asyncrl simulate` on this scenario: its colocated synchronous baseline (every device an
    engine, then a trainer rank) is the scenario with these overrides (key=value, as on the command
    line) applied before the devices are counted out, where the baseline's engines or trainer
    differ from the async split's beyond their number; e.g. on CPUs one engine and one trainer
    rank each span every core in turns (engine.tensor_parallel_size=2), with the speeds measured
    so (`asyncrl bench calibrate`)."""

    sync_overrides: list[str] = field(default_factory=list)


@dataclass
class RecipeConfig:
    name: str = MISSING
    description: str = ""
    # Python module holding the recipe's reward and data preparation (e.g. recipes.arith).
    module: str = MISSING


@dataclass
class Config:
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # Several environments mixed by weight; empty: one dataset agent made of `data`, with
    # env_id = recipe.name.
    agents: list[AgentConfig] = field(default_factory=list)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
