import pytest

from asyncrl.config.schema import DataConfig, TaskConfig
from asyncrl.tasks import TaskSource, _split_by_weight, score_answer

ARITH = TaskConfig(name="basic_arithmetic",
                   params={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"]})


def data_config(**kw) -> DataConfig:
    base = dict(tasks=[ARITH], train_size=2000, heldout_size=200, prompt_template="{question}\nAnswer: ")
    return DataConfig(**{**base, **kw})


def test_same_seeds_give_the_same_problems():
    a, b = TaskSource(data_config()), TaskSource(data_config())
    assert [p.question for p in a.train] == [p.question for p in b.train]
    assert [p.question for p in a.heldout] == [p.question for p in b.heldout]
    c = TaskSource(data_config(train_seed=99))
    assert [p.question for p in c.train] != [p.question for p in a.train]


def test_heldout_questions_never_appear_in_train():
    source = TaskSource(data_config())
    assert len(source.heldout) == 200
    heldout = {p.question for p in source.heldout}
    assert not heldout & {p.question for p in source.train}
    # The arithmetic space is small, so some train problems collide and are dropped.
    assert 1800 < len(source.train) <= 2000
    extra = source.generate_split("selection", 7, 300)
    assert not heldout & {p.question for p in extra}


def test_prompt_ids_are_unique_and_prompts_use_the_template():
    source = TaskSource(data_config())
    ids = [p.prompt_id for p in source.train + source.heldout]
    assert len(ids) == len(set(ids))
    p = source.heldout[0]
    assert p.prompt == f"{p.question}\nAnswer: "
    assert p.prompt_id.startswith("heldout/basic_arithmetic/")


def test_scorer_accepts_the_answer_and_rejects_others():
    source = TaskSource(data_config())
    p = source.heldout[0]
    assert score_answer(p, p.answer) == 1.0
    assert score_answer(p, f"  {p.answer} ") == 1.0
    assert score_answer(p, str(int(p.answer) + 1)) == 0.0
    assert score_answer(p, "") == 0.0


def test_tasks_mix_by_weight():
    chain = TaskConfig(name="chain_sum", weight=3.0)
    source = TaskSource(data_config(tasks=[ARITH, chain], heldout_size=100, train_size=400))
    tasks = [p.task for p in source.heldout]
    assert tasks.count("basic_arithmetic") == 25 and tasks.count("chain_sum") == 75


@pytest.mark.parametrize("total,weights,expected", [
    (10, [1, 1, 1], [4, 3, 3]),  # remainders tie: the first task gets the extra problem
    (7, [0.5, 0.25, 0.25], [3, 2, 2]),  # exact 3.5, 1.75, 1.75: floors 3,1,1; remainders .75 win
    (5, [1, 0], [5, 0]),
])
def test_largest_remainder_split(total, weights, expected):
    tasks = [TaskConfig(name=f"t{i}", weight=w) for i, w in enumerate(weights)]
    assert _split_by_weight(total, tasks) == expected


def test_prompt_template_may_use_the_tasks_metadata_fields():
    chain = TaskConfig(name="chain_sum", params={"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 1})
    source = TaskSource(data_config(tasks=[chain], heldout_size=20, train_size=20, prompt_template="{expression} =\n"))
    p = source.heldout[0]
    assert p.prompt == f"{p.entry['metadata']['expression']} =\n" and p.prompt.strip() in p.question
    with pytest.raises(ValueError, match=r"'\{expresion\} =': 'expresion' is not a field of task 'chain_sum' "
                                         r"\(fields: .*expression.*question"):
        TaskSource(data_config(tasks=[chain], prompt_template="{expresion} ="))
