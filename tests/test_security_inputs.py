"""Bad input gets a clear error (docs/security.md): config values an attacker (or a slip of the
keyboard) might give, through validation and through `--cfg job`, and malformed dataset files.
Every refusal names the key, or the env, file and line; nothing here starts Ray or vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.agents.registry import build_agent
from asyncrl.config import ConfigError
from asyncrl.config.schema import AgentConfig
from asyncrl.run_config import load_config, validate_shown_config
from tests.conftest import run_cli

# (overrides, what the one problem must say): sizes far past any real run, NaN and infinite
# floats, timeouts that never or always fire, prompt templates that read attributes or pad
# without bound. Each must be refused by validation with exactly one problem.
BAD_OVERRIDES = [
    (["tools.sandbox.isolation=none"], "tools.sandbox.isolation='none': runs model-written code without isolation"),
    (["tools.sandbox.isolation=docker"], "tools.sandbox.isolation='docker': must be one of bwrap, none"),
    (["tools.sandbox.max_processes=0"], "tools.sandbox.max_processes=0: must be in [1, 4096]"),
    (["tools.sandbox.memory_mb=1"], "tools.sandbox.memory_mb=1: must be in [64, 1048576]"),
    (["tools.timeout_s=-1"], "tools.timeout_s=-1.0: must be in (0, 86400] seconds"),
    (["rollout.num_workers=100000"], "rollout.num_workers=100000: must be in [1, 1024]"),
    (["rollout.num_workers=0"], "rollout.num_workers=0: must be in [1, 1024]"),
    (["rollout.max_concurrent_loops=10000000"], "rollout.max_concurrent_loops=10000000: must be in [1, 16384]"),
    (["engine.num_engines=100000"], "engine.num_engines=100000: must be in [1, 1024]"),
    (["engine.max_num_seqs=99999999"], "engine.max_num_seqs=99999999: must be in [1, 16384]"),
    (["engine.max_model_len=100000000"], "engine.max_model_len=100000000: must be <= 1048576 tokens"),
    (["rollout.max_new_tokens=4096"], "must exceed rollout.max_new_tokens=4096"),
    (["engine.tensor_parallel_size=100000"], "engine.tensor_parallel_size=100000: must be in [1, 1024]"),
    (["engine.cpu_kvcache_space_gib=1000000"], "engine.cpu_kvcache_space_gib=1000000: must be in [1, 4096]"),
    (["algorithm.n_samples_per_prompt=100000"], "algorithm.n_samples_per_prompt=100000: must be <= 1024"),
    (["algorithm.prompts_per_step=10000000"], "must be <= 1048576 samples per step"),
    (["trainer.micro_batch_size=100000000"], "trainer.micro_batch_size=100000000: must be in [0, 1048576]"),
    (["trainer.data_parallel_size=100000"], "trainer.data_parallel_size=100000: must be in [1, 1024]"),
    (["trainer.torch_threads=1000000"], "trainer.torch_threads=1000000: must be in [0, 1024]"),
    (["trainer.weight_sync_bucket_mb=1e12"], "trainer.weight_sync_bucket_mb=1000000000000.0: must be in (0, 16384] MB"),
    (["trainer.lr=nan"], "trainer.lr=nan: must be a finite number"),
    (["trainer.lr=inf"], "trainer.lr=inf: must be a finite number"),
    (["trainer.min_lr=nan"], "trainer.min_lr=nan: must be a finite number"),
    (["trainer.grad_clip=inf"], "trainer.grad_clip=inf: must be a finite number"),
    (["rollout.temperature=nan"], "rollout.temperature=nan: must be a finite number"),
    (["rollout.top_p=nan"], "rollout.top_p=nan: must be a finite number"),
    (["eval.temperature=inf"], "eval.temperature=inf: must be a finite number"),
    (["algorithm.loss.kl_coef=inf"], "algorithm.loss.kl_coef=inf: must be a finite number"),
    (["algorithm.loss.clip_eps_high=-inf"], "algorithm.loss.clip_eps_high=-inf: must be a finite number"),
    (["run.max_train_s=inf"], "run.max_train_s=inf: must be a finite number"),
    (["run.max_train_s=-1"], "run.max_train_s=-1.0: must be >= 0"),
    (["rollout.reward_timeout_s=0"], "rollout.reward_timeout_s=0.0: must be in (0, 86400] seconds"),
    (["rollout.reward_timeout_s=-5"], "rollout.reward_timeout_s=-5.0: must be in (0, 86400] seconds"),
    (["rollout.reward_timeout_s=1e12"], "rollout.reward_timeout_s=1000000000000.0: must be in (0, 86400] seconds"),
    (["trainer.dist_timeout_s=0"], "trainer.dist_timeout_s=0.0: must be in (0, 86400] seconds"),
    (["data.train_size=1000000000"], "data.train_size=1000000000: must be in [1, 1000000] (problems generated)"),
    (["data.tasks.0.weight=nan"], "data.tasks[0].weight=nan: must be a finite number"),
    (["eval.n_samples=0"], "eval.n_samples=0: must be in [1, 1024]"),
    (["eval.n_samples=100000000"], "eval.n_samples=100000000: must be in [1, 1024]"),
    (["data.prompt_template='{expression.__class__}'"], "placeholders must be plain names"),
    (["data.prompt_template='{expression:>999999999}'"], "placeholders must be plain names"),
    (["data.prompt_template='{expression!r}'"], "placeholders must be plain names"),
    (["data.prompt_template='{0} {expression}'"], "placeholders must be plain names"),
    (["data.prompt_template='{expression'"], "not a format string: expected '}' before end of string"),
    (["recipe=multi_task", "agents.0.weight=inf"], "agents[0].weight=inf: must be a finite number"),
    (["recipe=multi_task", "agents.0.params.train_size=100000000"],
     "agents[0].params.train_size=100000000: must be in [1, 1000000]"),
    (["recipe=multi_task", "agents.1.params.prompt_template='{question.__init__.__globals__}'"],
     "agents[1].params.prompt_template="),
]


@pytest.mark.attack
@pytest.mark.parametrize("overrides,expected", BAD_OVERRIDES, ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_validation_refuses_bad_values_with_one_clear_problem(overrides, expected, base_model):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert len(err.value.problems) == 1, err.value.problems
    assert expected in err.value.problems[0]


def test_the_bounds_leave_real_runs_alone(base_model):
    cfg = load_config(["rollout.num_workers=1024", "rollout.max_concurrent_loops=512", "engine.max_model_len=131072",
                       "rollout.max_new_tokens=32768", "algorithm.n_samples_per_prompt=64",
                       "algorithm.prompts_per_step=512", "trainer.lr=1e-6", "rollout.reward_timeout_s=600"])
    assert cfg.rollout.num_workers == 1024 and cfg.engine.max_model_len == 131072


# -- `--cfg job` validates what it prints --------------------------------------------------------

@pytest.mark.attack
@pytest.mark.parametrize("argv,key", [
    (["rollout.num_workers=100000", "--cfg", "job"], "rollout.num_workers=100000"),
    (["--cfg=job", "trainer.lr=nan"], "trainer.lr=nan"),
    (["-c", "all", "rollout.reward_timeout_s=0"], "rollout.reward_timeout_s=0.0"),
    (["--config-name", "evaluate", "--cfg", "job", "eval.n_samples=0"], "eval.n_samples=0"),
])
def test_cfg_job_exits_2_naming_the_key(argv, key, base_model, capsys):
    with pytest.raises(SystemExit) as exit_:
        validate_shown_config("config", argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncrl: invalid config (1 problem(s)):") and key in err


@pytest.mark.parametrize("argv", [
    ["recipe=arith", "--cfg", "job"],  # valid: Hydra prints it
    ["rollout.num_workers=100000"],  # no --cfg: the run itself validates
    ["rollout.num_workers=100000", "--cfg", "hydra"],  # Hydra's own settings only
    ["rollout.no_such_key=1", "--cfg", "job"],  # a composition error: Hydra reports it, as for a run
])
def test_cfg_check_leaves_other_invocations_to_hydra(argv, base_model):
    validate_shown_config("config", argv)


@pytest.mark.attack
@pytest.mark.parametrize("args,key", [
    (["train", "recipe=arith", "rollout.num_workers=100000", "trainer.lr=nan", "--cfg", "job"],
     "rollout.num_workers=100000: must be in [1, 1024]"),
    (["eval", "recipe=arith", "eval.temperature=inf", "--cfg", "job"], "eval.temperature=inf: must be a finite number"),
    (["bench", "rollout", "recipe=arith", "rollout.max_concurrent_loops=10000000", "--cfg", "all"],
     "rollout.max_concurrent_loops=10000000"),
], ids=["train", "eval", "bench"])
def test_cli_cfg_job_refuses_what_a_run_would(args, key, tmp_path, base_model):
    out = run_cli(*args, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert key in out.stderr and "invalid config" in out.stderr
    assert "recipe:" not in out.stdout  # nothing printed
    assert not (tmp_path / "runs").exists()


# -- dataset files ---------------------------------------------------------------------------------

GOOD = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
GOOD_LINES = "".join(json.dumps(r) + "\n" for r in GOOD)


@pytest.fixture(scope="module")
def cfg():
    return load_config(["recipe=multi_task", "algorithm.prompts_per_step=10"])


def file_agent(cfg, path: Path, **params):
    spec = AgentConfig(env_id="gsm", type="dataset", params={
        "source": "file", "path": str(path), "heldout_size": 2, "prompt_template": "Q: {question}\nA: ", **params})
    return build_agent(spec, cfg)


# (file name, contents, where, what): where is the line (JSON) or row (binary formats) at fault
MALFORMED = [
    ("rows.jsonl", GOOD_LINES + '{"question": "cut off", "answer": \n', "line 5", "not valid JSON: Expecting value"),
    ("rows.jsonl", GOOD_LINES + "\n" + '["question", "answer"]\n', "line 6", "must be a JSON object, not an array"),
    ("rows.jsonl", '{"question": 7, "answer": "8"}\n' + GOOD_LINES, "line 1",
     "field 'question' must be a string, not a number"),
    ("rows.jsonl", GOOD_LINES + '{"question": "q?", "answer": {"value": 1}}\n', "line 5",
     "field 'answer' must be a string or a number, not an object"),
    ("rows.jsonl", GOOD_LINES + '{"question": "q?", "answer": NaN}\n', "line 5", "NaN is not valid JSON"),
    ("rows.jsonl", GOOD_LINES.encode() + b'{"question": "\xff\xfe?", "answer": "1"}\n', "line 5", "not UTF-8 text"),
    ("rows.jsonl", GOOD_LINES + "[" * 100_000 + "]" * 100_000 + "\n", "line 5", "nested too deeply"),
    ("rows.json", "[\n" + ",\n".join(json.dumps(r) for r in GOOD) + ',\n{"question": "q?",\n "answer": [1]}\n]\n',
     "line 6", "field 'answer' must be a string or a number, not an array"),
    ("rows.json", "[\n" + "\n".join(json.dumps(r) for r in GOOD) + "\n]\n", "line 3", "expected ',' or ']'"),
    ("rows.json", "[" + ",".join(json.dumps(r) for r in GOOD) + "] trailing", "line 1", "text after the closing"),
    ("rows.jsonl", GOOD_LINES + '{"question": "q?", "answer": "1", "messages": "hi"}\n', "line 5",
     "field 'messages' must be an array of messages, not a string"),
    ("rows.jsonl", GOOD_LINES + '{"question": "q?", "answer": "1", "messages": []}\n', "line 5",
     "field 'messages' is empty"),
    ("rows.jsonl", GOOD_LINES + '{"question": "q?", "answer": "1", "messages": [{"role": "root", "content": "x"}]}\n',
     "line 5", "messages[0] must be an object with a role of system, user, assistant, tool"),
    ("rows.jsonl", GOOD_LINES + '{"question": "q?", "answer": "1", "messages": [{"role": "user", "content": 7}]}\n',
     "line 5", "messages[0].content must be a string"),
]


@pytest.mark.attack
@pytest.mark.parametrize("name,contents,where,what", MALFORMED, ids=[f"{m[0]}-{m[3][:30]}" for m in MALFORMED])
def test_a_malformed_row_names_env_file_and_line(name, contents, where, what, cfg, tmp_path):
    path = tmp_path / name
    path.write_bytes(contents if isinstance(contents, bytes) else contents.encode())
    with pytest.raises(ValueError) as err:
        file_agent(cfg, path).problems("train")
    assert str(err.value).startswith(f"env 'gsm': {path}, {where}: "), err.value
    assert what in str(err.value)


@pytest.mark.attack
def test_a_malformed_heldout_file_is_named(cfg, tmp_path):
    train, heldout = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text(GOOD_LINES)
    heldout.write_text(GOOD_LINES + "{oops}\n")
    with pytest.raises(ValueError, match=rf"env 'gsm': {heldout}, line 5: not valid JSON"):
        file_agent(cfg, train, heldout_path=str(heldout)).problems("heldout")


@pytest.mark.attack
def test_binary_formats_name_the_file_and_row(cfg, tmp_path):
    import datasets

    rows = [{"question": i, "answer": "1"} for i in range(3)]  # a column of numbers, not questions
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    with pytest.raises(ValueError, match=rf"env 'gsm': {tmp_path / 'rows.parquet'}, row 1: field 'question' must be"):
        file_agent(cfg, tmp_path / "rows.parquet").problems("train")
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match=rf"env 'gsm': {garbage}: cannot be read: "):
        file_agent(cfg, garbage).problems("train")


def test_incomplete_rows_are_skipped_and_counted(cfg, tmp_path):
    incomplete = [{"answer": "1"}, {"question": "no answer?"}, {"question": "null?", "answer": None},
                  {"question": "   ", "answer": "2"}, {"question": "empty?", "answer": ""}]
    path = tmp_path / "rows.jsonl"
    path.write_text(GOOD_LINES + "\n\n" + "".join(json.dumps(r) + "\n" for r in incomplete)
                    + json.dumps({"question": "A number?", "answer": 42}) + "\n")
    agent = file_agent(cfg, path)
    problems = agent.problems("train") + agent.problems("heldout")
    assert agent.skipped_rows == len(incomplete)  # blank lines are not rows
    assert len(problems) == len(GOOD) + 1 and "42" in {p.answer for p in problems}


@pytest.mark.attack
@pytest.mark.parametrize("base", ["${oc.env:ASYNCRL_TEST_SECRET}", "x,y", "a b", "'quoted'", "[1]"])
def test_an_adapters_base_is_never_read_as_config_syntax(base, tmp_path, monkeypatch):
    """`asyncrl eval ADAPTER_DIR` names the adapter's base model as model.path: a string from a file,
    never resolved (an `${oc.env:...}` there printed the variable in a validation error)."""
    from asyncrl.evaluate import resolve_checkpoint

    monkeypatch.setenv("ASYNCRL_TEST_SECRET", "s3cr3t-value")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    with pytest.raises(ValueError, match="not a plain path or hub id") as refused:
        resolve_checkpoint(str(tmp_path))
    assert "s3cr3t-value" not in str(refused.value)


@pytest.mark.attack
def test_a_checkpoint_directorys_name_is_never_read_as_config_syntax(tmp_path):
    from asyncrl.evaluate import resolve_checkpoint

    run = tmp_path / "run${oc.env:HOME}"
    (run / "final_policy").mkdir(parents=True)
    (run / "final_policy" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a plain path or hub id"):
        resolve_checkpoint(str(run))
    plain = tmp_path / "adapter"
    plain.mkdir()
    (plain / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-0.6B"}))
    assert resolve_checkpoint(str(plain)) == ["model.path=Qwen/Qwen3-0.6B", f"eval.adapter={plain.resolve()}"]
