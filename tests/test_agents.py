"""The agent layer without engines: evaluation metrics against hand-computed values, group
allocation, the multi-task stream, dataset agents on real local files, the reward-only
agent, and config validation of `agents`."""

from __future__ import annotations

import json

import pytest

from asyncrl.agents.api import EvaluationResponse, ProblemResult
from asyncrl.agents.multi_task import WeightedMultiTask, allocate_groups
from asyncrl.agents.registry import build_agent, build_agents
from asyncrl.config import ConfigError
from asyncrl.config.schema import AgentConfig
from asyncrl.run_config import load_config


def result(greedy, sampled):
    return ProblemResult("p", "env", greedy, sampled, [3] * (1 + len(sampled)))


def test_evaluation_metrics_are_the_unbiased_estimator_over_problems():
    # n = 4 samples. Problem 1: c = 2 -> pass@1 = 2/4, pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6.
    # Problem 2: c = 0 -> 0, 0. Problem 3: c = 4 -> 1, 1. A reward of 0.5 is not correct.
    resp = EvaluationResponse("env", [result(1.0, [1, 0, 1, 0.5]), result(0.0, [0, 0, 0, 0]),
                                      result(1.0, [1, 1, 1, 1])], pass_k=[1, 2, 8], temperature=1.0)
    m = resp.metrics()
    assert m["greedy_accuracy"] == pytest.approx(2 / 3)
    assert m["pass@1"] == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert m["pass@2"] == pytest.approx(((1 - 1 / 6) + 0 + 1) / 3)
    assert "pass@8" not in m  # k above the samples collected
    assert m["mean_reward"] == pytest.approx((2.5 + 0 + 4) / 12)
    assert EvaluationResponse.from_dict(json.loads(json.dumps(resp.to_dict()))).metrics() == m
    # two more problems evaluated greedily only (eval.periodic_pass_k_problems): in the greedy
    # accuracy (3 right of 5), not in pass@k or the mean reward (still those of the 3 sampled)
    resp.results += [result(1.0, []), result(0.0, [])]
    both = resp.metrics()
    assert both["greedy_accuracy"] == pytest.approx(3 / 5) and both["num_problems"] == 5
    assert both["num_problems_sampled"] == 3
    assert all(both[k] == m[k] for k in ("pass@1", "pass@2", "mean_reward"))


def test_allocation_by_largest_remainder_with_at_least_one_group_each():
    assert allocate_groups(32, {"a": 0.6, "b": 0.2, "c": 0.2}) == {"a": 19, "b": 7, "c": 6}  # 19.2, 6.4, 6.4
    assert allocate_groups(10, {"a": 3, "b": 1, "eval": 0}) == {"a": 8, "b": 2}  # 7.5, 2.5: tie -> order
    # 0.1 of 4 rounds to 0, but every weighted env gets a group; the largest share gives one back.
    assert allocate_groups(4, {"a": 0.9, "b": 0.1}) == {"a": 3, "b": 1}
    assert allocate_groups(3, {"a": 1, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 1}
    with pytest.raises(ValueError, match="2 groups cannot give each of the 3 weighted envs at least one"):
        allocate_groups(2, {"a": 1, "b": 1, "c": 1})
    with pytest.raises(ValueError, match="no env has a weight > 0"):
        allocate_groups(4, {"a": 0})


@pytest.fixture(scope="module")
def multi_cfg():
    return load_config(["recipe=multi_task", "algorithm.prompts_per_step=10"])


def test_the_multi_task_stream_mixes_by_weight_and_resumes(multi_cfg):
    agents = build_agents(multi_cfg)
    assert agents.weights == pytest.approx({"arith": 0.6, "word_problems": 0.2, "retry": 0.2})
    block = [agents.next_problem() for _ in range(10)]
    counts = {env: sum(p.env_id == env for p in block) for env in agents.weights}
    assert counts == {"arith": 6, "word_problems": 2, "retry": 2}  # 10 x (0.6, 0.2, 0.2)
    assert not any(p.env_id == "chain_sum" for p in block)  # evaluation only
    assert len({p.prompt_id for p in block}) == 10
    # evaluation covers every env, the evaluation-only one included
    assert {p.env_id for p in agents.heldout(5)} == {"arith", "word_problems", "retry", "chain_sum"}
    for _ in range(3):
        agents.next_problem()
    state = json.loads(json.dumps(agents.state()))
    upcoming = [agents.next_problem().prompt_id for _ in range(15)]
    again = build_agents(multi_cfg)
    again.restore(state)
    assert [again.next_problem().prompt_id for _ in range(15)] == upcoming


def test_duplicate_env_ids_and_all_evaluation_only_are_rejected(multi_cfg):
    arith = build_agent(multi_cfg.agents[0], multi_cfg)
    with pytest.raises(ValueError, match="duplicate env_id 'arith'"):
        WeightedMultiTask([arith, arith], block_size=4)
    evaluation_only = build_agent(multi_cfg.agents[3], multi_cfg)
    with pytest.raises(ValueError, match="every agent has weight 0"):
        WeightedMultiTask([evaluation_only], block_size=4)


def write_rows(path, rows):
    """The same rows as .jsonl, .parquet and .arrow (a datasets directory) files."""
    import datasets

    path.mkdir()
    with open(path / "rows.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(path / "rows.parquet"))
    ds.save_to_disk(str(path / "rows_arrow"))
    return [path / "rows.jsonl", path / "rows.parquet", path / "rows_arrow"]


def test_dataset_agent_reads_local_files_and_counts_bad_rows(multi_cfg, tmp_path):
    rows = [{"question": f"What is {i} + 1?", "solution": f"It is {i + 1}.\n#### {i + 1}"} for i in range(30)]
    rows += [{"question": "", "solution": "#### 1"},  # empty question
             {"question": "No answer?", "solution": "no marker"},  # the regex finds no answer
             {"question": None, "solution": "#### 2"}]
    for file in write_rows(tmp_path / "data", rows):
        spec = AgentConfig(env_id="gsm", type="dataset", params={
            "source": "file", "path": str(file), "question_field": "question", "answer_field": "solution",
            "answer_regex": r"####\s*(.+)$", "heldout_size": 5, "prompt_template": "Q: {question}\nA: "})
        agent = build_agent(spec, multi_cfg)
        train, heldout = agent.problems("train"), agent.problems("heldout")
        assert (len(train), len(heldout), agent.skipped_rows) == (25, 5, 3), file
        assert {p.prompt_id for p in train}.isdisjoint(p.prompt_id for p in heldout)
        p = train[0]
        assert p.env_id == "gsm" and p.prompt.startswith("Q: What is ") and p.prompt.endswith("\nA: ")
        assert p.answer == str(int(p.question.split()[2]) + 1)
        assert agent.reward(p, f"{p.answer}\nmore") == 1.0 and agent.reward(p, "-1") == 0.0


def test_dataset_problems_become_conversations_offering_tools(multi_cfg, tmp_path):
    from agent_loops.tools.schemas import tool_schemas

    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    rows[0]["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 0?"}]
    file = tmp_path / "rows.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = {"source": "file", "path": str(file), "heldout_size": 2, "prompt_template": "Q: {question}\nA: "}
    plain = build_agent(AgentConfig(env_id="e", type="dataset", params=params), multi_cfg)
    for p in plain.problems("train") + plain.problems("heldout"):  # a conversation only where the row has one
        assert (p.messages, p.tools) == ((rows[0]["messages"], []) if p.question == "What is 0 + 1?" else ([], []))
    chat = build_agent(AgentConfig(env_id="e", type="dataset", params={**params, "system_prompt": "Use tools.",
                                                                       "tools": ["calculator"]}), multi_cfg)
    by_question = {p.question: p for p in chat.problems("train") + chat.problems("heldout")}
    own = by_question.pop("What is 0 + 1?")
    assert own.messages == rows[0]["messages"] and own.tools == tool_schemas(["calculator"])  # the row's own
    for p in by_question.values():
        assert p.messages == [{"role": "system", "content": "Use tools."}, {"role": "user", "content": p.prompt}]
        assert p.tools == tool_schemas(["calculator"])
    with pytest.raises(ValueError, match=r"env 'e': unknown tool\(s\) \['search'\]; registered: calculator, python"):
        build_agent(AgentConfig(env_id="e", type="dataset", params={**params, "tools": ["search"]}), multi_cfg)


def test_reward_only_agent_gives_problems_reward_and_observations(multi_cfg):
    agent = build_agent(multi_cfg.agents[2], multi_cfg)
    p = agent.problems("train")[0]
    assert p.prompt_id == "retry/train/0" and p.prompt.endswith("\nAnswer: ")
    wrong = str(int(p.answer) + 1)
    assert agent.reward(p, p.answer) == 1.0 and agent.reward(p, wrong) == 0.0
    assert agent.observe(p, wrong, turn=1) == "\nWrong. Answer: "  # a wrong first answer: retry
    assert agent.observe(p, p.answer, turn=1) is None
    assert agent.observe(p, wrong, turn=2) is None  # max_turns reached
    # the reward reads the last turn's answer
    assert agent.reward(p, f"{wrong}\nWrong. Answer: {p.answer}") == 1.0


def test_config_validation_checks_every_agent(multi_cfg):
    from omegaconf import OmegaConf

    from asyncrl.config import compose
    from asyncrl.run_config import validate_config

    raw = compose(["recipe=multi_task"])
    raw.agents[1].env_id = "arith"
    raw.agents[2].type = "os.system"
    raw.agents[0].params.prompt_template = "no placeholder"
    raw.agents[3].params = OmegaConf.create({"source": "file", "path": "/no/such.jsonl", "answer_regex": "(",
                                             "typo_key": 1})
    with pytest.raises(ConfigError) as e:
        validate_config(raw)
    text = str(e.value)
    assert "agents[1].env_id='arith': duplicate" in text
    assert "agents[2] (retry): agent type 'os.system' is not registered; registered types: dataset, reward_only" \
           ", remote" in text
    assert "agents[0].params.prompt_template='no placeholder'" in text
    assert "agents[3] (chain_sum): params.typo_key: Key 'typo_key' not in 'DatasetParams'" in text
    with pytest.raises(ConfigError, match="algorithm.prompts_per_step=2: must be >= the number of training agents"):
        load_config(["recipe=multi_task", "algorithm.prompts_per_step=2"])


def test_periodic_evaluations_sample_the_first_problems_of_each_env_and_the_rest_greedily():
    from types import SimpleNamespace

    from asyncrl.config.schema import EvalConfig
    from asyncrl.control.periodic_eval import PeriodicEvaluation
    from asyncrl.tasks import Problem

    envs = {env: [Problem(f"{env}/{i}", env, "q", "q", "1") for i in range(5)] for env in ("a", "b")}
    agents = SimpleNamespace(heldout=lambda n: [p for ps in envs.values() for p in ps[:n]])
    evals = PeriodicEvaluation(EvalConfig(periodic_pass_k_problems=2), 10, agents, agents.heldout(4))
    assert [p.prompt_id for p in evals.sampled] == ["a/0", "a/1", "b/0", "b/1"]
    assert [p.prompt_id for p in evals.greedy_only] == ["a/2", "a/3", "b/2", "b/3"]
    every = PeriodicEvaluation(EvalConfig(periodic_pass_k_problems=0), 10, agents, agents.heldout(4))
    assert len(every.sampled) == 8 and every.greedy_only == []
