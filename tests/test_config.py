"""Config composition and validation: shipped configs are valid; bad values fail clearly."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from asyncrl.config import CONF_DIR, Config, ConfigError, compose, validate
from asyncrl.run_config import load_config
from tests.conftest import REPO, run_cli

RECIPES = sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml") if not p.stem.startswith("sim_"))
# Scenarios of simulated backends (asyncrl simulate): recipe options without a recipe folder of their own.
SCENARIOS = sorted(p.stem for p in (CONF_DIR / "recipe").glob("sim_*.yaml"))
GPU_RECIPES = ["gsm8k_qwen", "retool_qwen"]  # validated here, run on GPU clusters
GROUP_OPTIONS = [
    (group.name, option.stem)
    for group in sorted(CONF_DIR.iterdir()) if group.is_dir() and group.name != "recipe"
    for option in sorted(group.glob("*.yaml"))
]


def test_every_recipe_folder_is_a_recipe_option():
    folders = sorted(p.parent.name for p in (REPO / "recipes").glob("*/config.yaml"))
    assert folders == RECIPES
    for name in RECIPES:
        link = CONF_DIR / "recipe" / f"{name}.yaml"
        assert link.resolve() == (REPO / "recipes" / name / "config.yaml").resolve()


@pytest.mark.parametrize("recipe", sorted(set(RECIPES) - set(GPU_RECIPES)) + SCENARIOS)
def test_every_shipped_recipe_validates(recipe, base_model):
    cfg = load_config([f"recipe={recipe}"])
    assert isinstance(cfg, Config)
    assert cfg.recipe.name == recipe
    assert Path(cfg.model.path).is_dir()


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipes_resolve_and_validate_given_their_data_file(recipe, tmp_path):
    """They need the user's local data file (nothing is downloaded) and name a Hub model."""
    with pytest.raises(ConfigError, match="data.path='': source=file needs an existing local"):
        load_config([f"recipe={recipe}"])
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}\n')
    cfg = load_config([f"recipe={recipe}", f"data.path={data}"])
    assert cfg.cluster.device == "cuda" and cfg.engine.dtype == "bfloat16" and cfg.model.path.startswith("Qwen/")
    assert cfg.data.answer_regex == "####\\s*(.+)$" and "{question}" in cfg.data.prompt_template
    assert cfg.rollout.agent_loop == ("chat_tool" if recipe == "retool_qwen" else "partial_single_turn")
    # conversations through the model's own template; the Hermes parser for Qwen's calls
    assert cfg.data.system_prompt and cfg.model.chat_template == "" and cfg.tools.parser == "hermes"
    assert cfg.data.tools == (["python"] if recipe == "retool_qwen" else [])


def test_gsm8k_answer_extraction():
    from recipes.gsm8k_qwen import extract_answer

    assert extract_answer("3 + 4 = 7 apples.\n#### 1,234") == "1234"
    assert extract_answer("So she has 3.5 left, then 12") == "12"  # no marker: the last number
    assert extract_answer("<result>99</result>\n#### -8 dollars") == "-8"
    assert extract_answer("no number") == ""


def test_chain_sum_cot_worked_solutions_score_and_vary_in_length():
    from omegaconf import OmegaConf

    from asyncrl.tasks import Problem, TaskSource, score_answer
    from recipes.chain_sum_cot import extract_answer, sft_target

    data = OmegaConf.to_object(compose(["recipe=chain_sum_cot"]).data)
    problems = TaskSource(data).heldout
    by_hand = Problem(prompt_id="x", task="chain_sum", question="4 + 1 - 7 =", prompt="4 + 1 - 7 =\n", answer="-2",
                      entry={"metadata": {"expression": "4 + 1 - 7"}})
    assert sft_target(by_hand) == "4 +1=5 -7=-2 Answer: -2"
    targets = [sft_target(p) for p in problems]
    assert all(score_answer(p, extract_answer(t)) == 1.0 for p, t in zip(problems, targets))
    lengths = sorted(len(t) for t in targets)
    assert lengths[0] <= 20 and lengths[-1] >= 80  # 2 to 12 terms: the long tail the benchmark needs
    assert extract_answer("4 +1=5 -7=-2 Answer: -2") == "-2"
    assert extract_answer("Answer: 3 +1=4 Answer: 4") == "4"
    assert extract_answer("4 +1=5 -7=-2") == ""  # never answered: no reward


def test_arith_worked_solutions_reduce_one_operation_a_step():
    from omegaconf import OmegaConf

    from asyncrl.tasks import TaskSource, score_answer
    from recipes.arith import direct_answer, extract_answer, reduction_steps, sft_target

    # by hand: innermost group first, left to right; a group holding one number loses its parentheses
    assert reduction_steps("( -9 - 8 ) + 6") == ["-17 + 6", "-11"]
    assert reduction_steps("5 + -4 + 2 - -2") == ["1 + 2 - -2", "3 - -2", "5"]
    assert reduction_steps("-( ( -6 - -5 ) + 3 - -9 )") == ["-( -1 + 3 - -9 )", "-( 2 - -9 )", "-11"]
    assert reduction_steps("( -( -8 - -7 ) ) + -8") == ["1 + -8", "-7"]
    cfg = compose(["recipe=arith"])
    problems = TaskSource(OmegaConf.to_object(cfg.data)).heldout
    assert problems[0].prompt == problems[0].entry["metadata"]["expression"] + " =\n"
    for p in problems:
        assert score_answer(p, extract_answer(sft_target(p))) == 1.0
        assert score_answer(p, extract_answer(direct_answer(p))) == 1.0
        assert len(sft_target(p)) < cfg.rollout.max_new_tokens  # one token a character, then EOS
    assert extract_answer("-17 + 6 = -11 Answer: -11") == "-11" and extract_answer("-17 + 6 = -11") == ""


def test_recipe_hooks_default_to_the_bare_answer_and_reject_non_functions(tmp_path, monkeypatch):
    from asyncrl.reward.recipe_hooks import load_recipe_hooks
    from asyncrl.tasks import Problem

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "plain_recipe.py").write_text("def extract_answer(response):\n    return response\n")
    (tmp_path / "bad_recipe.py").write_text("def extract_answer(response):\n    return response\n"
                                            "direct_answer = 'Answer: 7'\n")
    p = Problem(prompt_id="x", task="t", question="3 + 4", prompt="3 + 4 =\n", answer="7", entry={})
    hooks = load_recipe_hooks("plain_recipe")
    assert hooks.sft_target(p) == hooks.direct_answer(p) == "7"
    with pytest.raises(ValueError, match="`direct_answer` must be a function"):
        load_recipe_hooks("bad_recipe")


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_group_option_validates_with_the_default_recipe(group, option, base_model):
    pair = {"engine": ["trainer=sim"], "trainer": ["engine=sim"]}.get(group, []) if option == "sim" else []
    load_config([f"{group}={option}", *pair])  # simulated backends come as a pair


def test_presets_set_what_they_promise(base_model):
    sync = load_config(["algorithm=sync"])
    assert sync.algorithm.max_staleness == 0 and not sync.algorithm.partial_rollout
    decoupled = load_config(["algorithm=decoupled_ppo"])
    assert decoupled.algorithm.loss.type == "decoupled_ppo"
    assert decoupled.algorithm.n_samples_per_prompt == 8  # inherited from grpo
    assert load_config(["engine=vllm_gpu"]).engine.dtype == "bfloat16"
    ppo = load_config(["algorithm=ppo", "algorithm.n_samples_per_prompt=1"])  # one sample: the critic is its baseline
    assert ppo.algorithm.advantage == "gae" and ppo.algorithm.critic.lam == 1.0 and ppo.algorithm.loss.type == "grpo"


@pytest.mark.parametrize("overrides,expected", [
    (["algorithm.loss.type=gspo", "algorithm.loss.aggregation=sequence"],
     ["algorithm.loss.type='gspo'", "one advantage per sequence; algorithm.advantage=gae give(s) one per token"]),
    (["trainer.pipeline_parallel_size=2"],
     ["trainer.pipeline_parallel_size=2", "must be 1 with algorithm.advantage=gae"]),
    (["algorithm.critic.lam=1.5"], ["algorithm.critic.lam=1.5", "must be in [0, 1]"]),
    (["algorithm.critic.path=/no/such/critic"], ["algorithm.critic.path='/no/such/critic'", "no such directory"]),
])
def test_critic_settings_are_checked(overrides, expected, base_model):
    with pytest.raises(ConfigError) as err:
        load_config(["algorithm.advantage=gae", *overrides])
    assert len(err.value.problems) == 1, err.value.problems
    for text in expected:
        assert text in str(err.value)


def test_gspo_refuses_every_per_token_advantage_by_one_rule(base_model):
    """GSPO's one ratio per sequence takes one advantage per sequence: a distillation teacher's
    per-token term is refused as the critic's per-token advantages are (test_critic_settings_are_checked)."""
    gspo = ["algorithm.loss.type=gspo", "algorithm.loss.aggregation=sequence"]
    with pytest.raises(ConfigError) as err:
        load_config([*gspo, f"algorithm.distill.teacher_path={base_model}"])
    assert err.value.problems == ["algorithm.loss.type='gspo': gspo takes one advantage per sequence; "
                                  "algorithm.distill.teacher_path give(s) one per token"]
    load_config([*gspo])  # with group advantages it validates


@pytest.mark.parametrize("override,expected", [
    ("algorithm.max_staleness=-1", ["algorithm.max_staleness=-1", ">= 0"]),
    ("run.max_trainer_restarts=-1", ["run.max_trainer_restarts=-1", ">= 0"]),
    ("algorithm.policy_lag=2", ["algorithm.policy_lag=2", "must be in [0, algorithm.max_staleness=1]"]),
    ("run.health_timeout_s=0", ["run.health_timeout_s=0.0", "seconds in (0,"]),
    ("run.resume_from=latest", ["run.resume_from=latest: no checkpoint in run.output_dir=''"]),
    ("engine.backend=sglang", ["engine.backend='sglang'", "must be one of vllm"]),
    ("trainer.backend=fsdp", ["trainer.backend='fsdp'", "megatron"]),
    ("trainer.mini_batches_per_step=300", ["trainer.mini_batches_per_step=300", "must be in [1, 256]"]),
    ("model.path=/no/such/model", ["model.path='/no/such/model'", "no such directory"]),
    ("algorithm.n_samples_per_prompt=1", ["algorithm.n_samples_per_prompt=1", ">= 2"]),
    ("algorithm.pause_mode=drop", ["algorithm.pause_mode='drop'", "abort, keep"]),
    ("algorithm.loss.type=dpo", ["algorithm.loss.type='dpo'", "grpo, decoupled_ppo, tis"]),
    ("rollout.temperature=0", ["rollout.temperature=0.0", "> 0"]),
    ("rollout.max_new_tokens=500", ["engine.max_model_len=128", "rollout.max_new_tokens=500"]),
    ("eval.num_problems=9999", ["eval.num_problems=9999", "data.heldout_size=500"]),
    ("cluster.device=tpu", ["cluster.device='tpu'", "cpu, cuda"]),
    ("data.tasks.0.name=no_such_task", ["data.tasks[0].name='no_such_task'", "not a reasoning-gym task"]),
    ("data.prompt_template=hello", ["data.prompt_template='hello'", "{question}"]),
    ("engine.cpu_threads_bind=everywhere", ["engine.cpu_threads_bind='everywhere'", '"nobind"']),
    ("engine.cpu_cores=first", ["engine.cpu_cores='first'", 'not a core list such as "0"']),
    ("trainer.cpu_cores='3-1'", ["trainer.cpu_cores='3-1'", "the range 3-1 runs backwards"]),
    ("rollout.cpu_cores='0,4096'", ["rollout.cpu_cores='0,4096'", "cores [4096] are not available here"]),
])
def test_bad_value_names_key_value_and_what_is_valid(override, expected, base_model):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert len(err.value.problems) == 1, err.value.problems
    for text in expected:
        assert text in str(err.value)


@pytest.mark.parametrize("overrides,expected", [
    (["trainer.lora.rank=300"], ["trainer.lora.rank=300", "must be in [0, 256]"]),
    (["trainer.lora.rank=8", "trainer.lora.alpha=0"], ["trainer.lora.alpha=0.0", "alpha / rank"]),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[q_proj]"], ["trainer.lora.target_modules=['q_proj']",
                                                                        "'linear_qkv', 'linear_proj'"]),
    (["trainer.lora.rank=8", "algorithm.pause_mode=keep"], ["algorithm.pause_mode='keep'", "with trainer.lora"]),
    (["trainer.lora.rank=8", "trainer.pipeline_parallel_size=2"], ["pipeline_parallel_size > 1 is not supported"]),
])
def test_lora_settings_are_checked(overrides, expected, base_model):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert len(err.value.problems) == 1, err.value.problems
    for text in expected:
        assert text in str(err.value)


def test_all_problems_are_reported_at_once(base_model):
    with pytest.raises(ConfigError) as err:
        load_config(["algorithm.max_staleness=-2", "engine.backend=x", "trainer.lr=0"])
    assert len(err.value.problems) == 3
    assert "3 problem(s)" in str(err.value)


@pytest.mark.parametrize("override,expected", [
    ("algorithm.max_staleness=abc", "algorithm.max_staleness"),  # wrong type
    ("algorithm.max_stalness=1", "max_stalness"),  # unknown key (a typo)
    ("recipe=no_such_recipe", "recipe/no_such_recipe"),
    ("bench.rounds=3", "bench"),  # the benchmarks' settings are not the training config's
])
def test_hydra_rejects_wrong_types_unknown_keys_and_recipes(override, expected):
    with pytest.raises(ConfigCompositionException) as err:
        compose([override])
    assert expected in str(err.value) + str(err.value.__cause__)


def test_validate_reports_unknown_sections_and_missing_values():
    with pytest.raises(ConfigError) as err:
        validate({"recipe": {"name": "x", "module": "m"}, "model": {}, "trainers": {}})
    assert any("trainers: unknown config section" in p for p in err.value.problems)
    with pytest.raises(ConfigError, match=r"model.path: required but not set"):
        validate({"recipe": {"name": "x", "module": "m"}})


def test_cli_prints_the_resolved_config(tmp_path):
    out = run_cli("train", "recipe=arith", "algorithm.max_staleness=3", "--cfg", "job", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "max_staleness: 3" in out.stdout and "name: arith" in out.stdout
    assert not (tmp_path / "runs").exists()  # --cfg starts nothing


def test_cli_rejects_a_bad_value_before_starting_anything(tmp_path, base_model):
    out = run_cli("train", "recipe=arith", "algorithm.max_staleness=-1", cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert "algorithm.max_staleness=-1: must be >= 0" in out.stderr


def test_cli_help_lists_the_config_groups(tmp_path):
    out = run_cli("train", "--help", cwd=tmp_path, timeout=120)
    assert out.returncode == 0
    for group in ("engine", "trainer", "algorithm", "rollout", "cluster", "logging", "recipe"):
        assert f"{group}:" in out.stdout
    top = run_cli("--help", cwd=tmp_path)
    assert "train" in top.stdout and "eval" in top.stdout


def test_arith_tool_recipe_is_arith_as_a_chat_with_the_calculator(base_model):
    from dataclasses import replace

    from recipes.arith_tool import extract_answer

    arith, tool = load_config(["recipe=arith"]), load_config(["recipe=arith_tool"])
    assert tool.rollout.agent_loop == "chat_tool" and tool.tools.parser == "hermes"
    assert tool.recipe.module == "recipes.arith_tool" and tool.model.path.endswith("recipes/arith_tool/base_model")
    assert tool.data == replace(arith.data, tools=["calculator"])  # the same problems, offering the calculator
    assert extract_answer('<tool_call>\n{"name": "calculator"}\n</tool_call>...Answer: 7') == "7"
    assert extract_answer("<tool:calculator>3 + 4</tool><result>7</result>Answer: 7") == "7"
    assert extract_answer("Answer: -12") == "-12"
