"""Data as verl's users have it: verl's parquet layout (`prompt` messages, `reward_model.ground_truth`,
`data_source`, `extra_info`) through the dataset agent (`format: verl`), and a reward function with
verl's compute_score signature from a file (`reward_function`): the rows as problems, the calls with
verl's arguments, float and dict results, bad rows and bad results counted and named, and config
validation. The end-to-end run on such data is tests/test_train_e2e.py's tool_loop mode."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from asyncrl.agents.registry import build_agent
from asyncrl.config import ConfigError
from asyncrl.config.schema import AgentConfig
from asyncrl.reward.reward_function import load_reward_function
from asyncrl.run_config import load_config
from asyncrl.tasks import TaskSource
from asyncrl.types import Segment, Trajectory

DATA_SOURCE = "arith_verl"

# verl's example scorer, and variations on it: every way a result can be good or bad
SCORE_PY = '''
import re
import time

CALLS = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the last number of the solution is the ground truth."""
    CALLS.append((data_source, solution_str, ground_truth, extra_info))
    numbers = re.findall(r"-?\\d+", solution_str)
    return float(bool(numbers) and numbers[-1] == str(ground_truth))


def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None):
    """verl's dict result: "score" is the reward, the other numbers are per-sample metrics."""
    score = compute_score(data_source, solution_str, ground_truth, extra_info)
    verl_row = float(data_source == "arith_verl" and "index" in (extra_info or {}))
    return {"score": score, "acc": score, "verl_row": verl_row, "pred": "text is not a metric"}


def raising(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("no rule for " + data_source)


def nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")


def text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(1.0)
    return 1.0


def two_args(solution_str, ground_truth):
    return 1.0


not_a_function = 3
'''


def write_score_file(directory: Path) -> Path:
    path = directory / "score.py"
    path.write_text(SCORE_PY)
    return path


def verl_rows(problems: list[Any], split: str) -> list[dict[str, Any]]:
    """Arith problems in verl's layout, prompted as the arith recipes prompt them ("( 3 + 4 ) - 2 =\\n")."""
    return [{"data_source": DATA_SOURCE, "ability": "math",
             "prompt": [{"role": "user", "content": p.prompt}],
             "reward_model": {"style": "rule", "ground_truth": p.answer},
             "extra_info": {"split": split, "index": i}} for i, p in enumerate(problems)]


def arith_verl_files(cfg: Any, directory: Path, train: int, heldout: int) -> tuple[Path, Path]:
    """verl-layout parquet files of the arith recipe's problems (its train and held-out splits)."""
    import datasets

    source = TaskSource(cfg.data)
    paths = (directory / "train.parquet", directory / "test.parquet")
    for path, split, problems in zip(paths, ("train", "test"), (source.train[:train], source.heldout[:heldout])):
        datasets.Dataset.from_list(verl_rows(problems, split)).to_parquet(str(path))
    return paths


@pytest.fixture(scope="module")
def cfg():
    return load_config(["recipe=arith", "eval.num_problems=4"])


def verl_agent(cfg, path: Path, **params):
    spec = AgentConfig(env_id="verl", type="dataset", params={
        "source": "file", "format": "verl", "path": str(path), "heldout_size": 2, **params})
    return build_agent(spec, cfg)


def test_verl_rows_load_as_conversations_with_their_data_source_and_extra_info(cfg, tmp_path):
    import datasets

    rows = verl_rows(TaskSource(cfg.data).heldout[:6], "test")
    rows[0]["prompt"] = [{"role": "system", "content": "Be brief."}, *rows[0]["prompt"]]  # a column of 1-2 messages
    rows[1]["extra_info"] = {"split": "test", "index": 1, "note": "only here"}  # the struct gains a key
    incomplete = [{**rows[2], "reward_model": {"style": "rule", "ground_truth": None}},
                  {**rows[2], "reward_model": {"style": "rule", "ground_truth": " "}},
                  {**rows[2], "prompt": None},
                  {**rows[2], "prompt": [{"role": "user", "content": ""}]}]
    parquet, jsonl = tmp_path / "rows.parquet", tmp_path / "rows.jsonl"
    datasets.Dataset.from_list(rows + incomplete).to_parquet(str(parquet))
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows + incomplete))
    for file in (parquet, jsonl):
        agent = verl_agent(cfg, file)
        problems = agent.problems("train") + agent.problems("heldout")
        assert (len(agent.problems("train")), len(agent.problems("heldout")), agent.skipped_rows) == (4, 2, 4), file
        by_index = {p.extra_info["index"]: p for p in problems}
        assert sorted(by_index) == list(range(6))
        for i, p in by_index.items():
            assert p.messages == rows[i]["prompt"]  # parquet's struct nulls dropped: the messages as written
            assert p.answer == rows[i]["reward_model"]["ground_truth"]
            assert p.question == rows[i]["prompt"][-1]["content"]
            assert p.data_source == DATA_SOURCE and p.tools == [] and p.env_id == "verl"
            expected = dict(rows[i]["extra_info"])
            if file == parquet and i != 1:
                expected["note"] = None  # parquet gives every row every key of the struct, as verl sees it
            assert p.extra_info == expected
            assert p.entry["ability"] == "math"
        # the recipe's reward (no reward_function): its answer extraction on the ground truth
        p = by_index[3]
        assert agent.reward(p, f"Answer: {p.answer}") == 1.0 and agent.reward(p, "Answer: 1000") == 0.0


def test_verl_prompts_are_rendered_by_the_chat_template_as_the_recipes_own_conversations(tmp_path):
    from agent_loops.chat import prompt_token_ids
    from agent_loops.tools.schemas import tool_schemas
    from asyncrl.agents.registry import build_agents

    chat_cfg = load_config(["recipe=arith_tool"])  # its model's own chat template; data.tools: [calculator]
    train, heldout = arith_verl_files(chat_cfg, tmp_path, train=4, heldout=4)
    verl = build_agent(AgentConfig(env_id="verl", type="dataset", params={
        "source": "file", "format": "verl", "path": str(train), "heldout_path": str(heldout), "heldout_size": 4,
        "tools": ["calculator"]}), chat_cfg)
    own = {p.prompt: p for p in build_agents(chat_cfg)["arith_tool"].problems("heldout")[:4]}  # "-4 - -7 =\n"
    for p in verl.problems("heldout"):
        assert p.tools == tool_schemas(["calculator"]) and p.messages[0]["role"] == "user"
        assert prompt_token_ids(p, verl.tokenizer) == prompt_token_ids(own[p.messages[0]["content"]], verl.tokenizer)


def scored(agent, problem, text: str) -> tuple[Trajectory, Any]:
    """Agent.score (the rollout workers' path) on a trajectory whose response is `text`."""
    ids = agent.tokenizer.encode(text, add_special_tokens=False)
    traj = Trajectory(problem.prompt_id, problem.prompt_id, [1, 2], [Segment.from_policy(ids, [0.0] * len(ids), 0)])
    return traj, asyncio.run(agent.score(problem, traj))


def test_a_verl_reward_function_gets_verls_arguments_and_may_return_a_float_or_a_dict(cfg, tmp_path):
    import datasets

    score = write_score_file(tmp_path)
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(verl_rows(TaskSource(cfg.data).heldout[:4], "test")).to_parquet(str(path))
    calls = load_reward_function(f"{score}::compute_score").__globals__["CALLS"]  # the agents' module: cached

    agent = verl_agent(cfg, path, reward_function=f"{score}::compute_score")
    p = agent.problems("train")[0]
    traj, failure = scored(agent, p, f"{p.answer} + 0 = {p.answer} Answer: {p.answer}")
    assert failure is None and traj.reward == 1.0 and "reward_metrics" not in traj.info
    data_source, solution_str, ground_truth, extra_info = calls[-1]
    assert (data_source, ground_truth, extra_info) == (DATA_SOURCE, p.answer, p.extra_info)
    assert solution_str == traj.info["response"] == agent.tokenizer.decode(traj.response_token_ids,
                                                                           skip_special_tokens=True)
    assert scored(agent, p, "Answer: 1000")[0].reward == 0.0

    as_dict = verl_agent(cfg, path, reward_function=f"{score}::compute_score_dict")
    p = as_dict.problems("train")[0]
    traj, failure = scored(as_dict, p, f"Answer: {p.answer}")
    assert failure is None and traj.reward == 1.0
    assert traj.info["reward_metrics"] == {"acc": 1.0, "verl_row": 1.0}  # text values are not metrics

    # the name defaults to verl's compute_score; a qa-layout file passes its answer text and the env id
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": f"{i} + 1 =", "answer": i + 1}) + "\n" for i in range(4)))
    plain = build_agent(AgentConfig(env_id="qa", type="dataset", params={
        "source": "file", "path": str(qa), "heldout_size": 2, "reward_function": str(score)}), cfg)
    p = plain.problems("train")[0]
    assert scored(plain, p, f"= {p.answer}")[0].reward == 1.0 and calls[-1][0::2] == ("qa", p.answer)


@pytest.mark.parametrize("name,code,detail", [
    ("raising", "reward_error", "reward_error: KeyError: 'no rule for arith_verl'"),
    ("nan", "reward_error", "reward_error: ValueError: returned nan, not a finite number"),
    ("text", "reward_error", "reward_error: TypeError: returned str '1.0', not a number"),
    ("no_score", "reward_error", "reward_error: ValueError: returned a dict without a 'score' key (keys: acc)"),
    ("slow", "reward_timeout", "reward_timeout: > 0.05s"),
])
def test_a_bad_reward_result_gives_zero_and_a_named_failure(name, code, detail, cfg, tmp_path):
    import dataclasses

    import datasets

    fast = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, reward_timeout_s=0.05))
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(verl_rows(TaskSource(cfg.data).heldout[:4], "test")).to_parquet(str(path))
    agent = verl_agent(fast, path, reward_function=f"{write_score_file(tmp_path)}::{name}")
    p = agent.problems("train")[0]
    traj, failure = scored(agent, p, f"Answer: {p.answer}")
    assert failure is not None and failure.code == code and str(failure) == detail  # the workers count it by code
    assert traj.reward == 0.0 and traj.info["reward_failure"] == detail


GOOD_ROW = {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": "1 + 2 =\n"}],
            "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"index": 0}}

# (a row's fields replaced, what the error says): the load fails naming the env, the file and the line
MALFORMED = [
    ({"prompt": "1 + 2 =\n"}, "field 'prompt' must be an array of chat messages (verl's layout), not a string"),
    ({"prompt": []}, "field 'prompt' is empty"),
    ({"prompt": [{"role": "root", "content": "x"}]},
     "prompt[0] must be an object with a role of system, user, assistant, tool"),
    ({"prompt": [{"role": "user", "content": 3}]}, "prompt[0].content must be a string"),
    ({"reward_model": "3"}, "field 'reward_model' must be an object such as {\"style\": \"rule\", \"ground_truth\": "
                            "...}, not a string"),
    ({"reward_model": {"ground_truth": [3, "3.0"]}},
     "field 'reward_model.ground_truth' must be a string or a number, not an array (a reward_function gets it"),
    ({"data_source": 7}, "field 'data_source' must be a string, not a number"),
    ({"extra_info": ["index", 0]}, "field 'extra_info' must be an object, not an array"),
]


@pytest.mark.attack
@pytest.mark.parametrize("fields,what", MALFORMED, ids=[m[1][:40] for m in MALFORMED])
def test_a_malformed_verl_row_names_env_file_and_line(fields, what, cfg, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(GOOD_ROW) + "\n" for _ in range(3)) + json.dumps({**GOOD_ROW, **fields}) + "\n")
    with pytest.raises(ValueError) as err:
        verl_agent(cfg, path).problems("train")
    assert str(err.value).startswith(f"env 'verl': {path}, line 4: {what}"), err.value


@pytest.mark.attack
def test_verl_binary_files_name_the_row_and_any_ground_truth_goes_to_a_reward_function(cfg, tmp_path):
    import datasets

    nan_truth = [{**GOOD_ROW, "reward_model": {"style": "rule", "ground_truth": x}} for x in (3.0, math.nan)]
    datasets.Dataset.from_list(nan_truth).to_parquet(str(tmp_path / "nan.parquet"))
    with pytest.raises(ValueError, match=rf"env 'verl': {tmp_path / 'nan.parquet'}, row 2: field "
                                         r"'reward_model.ground_truth' must be finite, not nan"):
        verl_agent(cfg, tmp_path / "nan.parquet").problems("train")
    # a ground truth that is a list is verl's to pass on: with a reward function it is one, as it is
    lists = [{**GOOD_ROW, "prompt": [{"role": "user", "content": f"{i} + 3 =\n"}],
              "reward_model": {"style": "rule", "ground_truth": [str(i + 3), f"{i + 3}.0"]}} for i in range(4)]
    datasets.Dataset.from_list(lists).to_parquet(str(tmp_path / "lists.parquet"))
    score = write_score_file(tmp_path)
    agent = verl_agent(cfg, tmp_path / "lists.parquet", reward_function=f"{score}::compute_score")
    p = agent.problems("train")[0]
    truth = p.entry["reward_model"]["ground_truth"]
    assert p.answer == json.dumps(truth) and len(truth) == 2
    scored(agent, p, "3")
    assert load_reward_function(f"{score}::compute_score").__globals__["CALLS"][-1][2] == truth


def test_a_qa_file_with_verls_columns_says_to_set_format_verl(cfg, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD_ROW) + "\n")
    spec = AgentConfig(env_id="gsm", type="dataset", params={"source": "file", "path": str(path), "heldout_size": 1})
    with pytest.raises(ValueError, match=r"no usable rows \(fields 'question', 'answer'\); its rows have verl's "
                                         r"columns \(prompt, reward_model\): set format: verl"):
        build_agent(spec, cfg).problems("train")


def test_config_validation_refuses_a_bad_reward_function_or_format_with_one_line_each(tmp_path):
    from omegaconf import open_dict

    from asyncrl.config import compose
    from asyncrl.run_config import validate_config

    score = write_score_file(tmp_path)
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    (tmp_path / "rows.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
    base = ["recipe=arith", "eval.num_problems=1", "data.heldout_size=1", "data.source=file", "data.format=verl",
            f"data.path={tmp_path / 'rows.jsonl'}"]
    cases = {
        f"{tmp_path}/missing.py::compute_score": f"{tmp_path}/missing.py': no such file",
        f"{score}::no_such_function": "defines no no_such_function",
        f"{score}::not_a_function": "not_a_function is not callable (it is int)",
        f"{score}::two_args": "two_args(solution_str, ground_truth) cannot take verl's arguments (data_source, "
                              "solution_str, ground_truth, extra_info)",
        f"{tmp_path / 'broken.py'}": "raised on import: ModuleNotFoundError: No module named 'no_such_module_here'",
        f"{tmp_path / 'rows.jsonl'}::compute_score": "is not a .py file",
    }
    for spec, what in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config([*base, f"data.reward_function={spec}"])
        assert len(err.value.problems) == 1, err.value
        assert err.value.problems[0].startswith(f"data.reward_function={spec!r}: ") and what in err.value.problems[0]
    assert load_config([*base, f"data.reward_function={score}"]).data.reward_function == str(score)

    with pytest.raises(ConfigError) as err:
        load_config(["recipe=arith", "data.format=parquet"])
    assert err.value.problems == ["data.format='parquet': must be one of qa, verl"]
    with pytest.raises(ConfigError) as err:
        load_config(["recipe=arith", "data.format=verl"])
    assert err.value.problems == ["data.format='verl': reads rows of a local file: needs data.source=file "
                                  "(not reasoning_gym)"]
    # an agent's params are checked the same way
    raw = compose(["recipe=multi_task"])
    with open_dict(raw.agents[1].params):
        raw.agents[1].params.reward_function = f"{score}::nope"
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert err.value.problems == [f"agents[1].params.reward_function='{score}::nope': "
                                  f"{str(score.resolve())!r} defines no nope"]
