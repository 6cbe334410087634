"""The run's reward services. Its reward model (reward.model): a real sequence classifier served by
RewardModelActor (batched scoring, the conversation through its chat template, long samples cut on
the left) and validation of the checkpoint. Its judge (reward.judge): the request through the
judge's template and chat template, its answer parsed. The rollout worker's side: every score
weighed beside the env's, timeouts and failures counted, with values computed by hand. End to end
(Ray actors and vLLM engines, one of each killed and replaced mid-run): the faults bench's run
(tests/test_bench.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from asyncrl.config.models import reward_model_problem
from asyncrl.config.schema import JudgeConfig
from asyncrl.engine.reward_model import RewardModelActor, RewardModelSettings
from asyncrl.messages import RewardRequest
from asyncrl.reward.clients import JudgeClient, RewardModelClient, RewardServices, ScoreFailed
from asyncrl.tasks import Problem
from asyncrl.types import Trajectory


def test_a_reward_model_scores_batches_as_it_scores_each_sample_alone(reward_model):
    actor = RewardModelActor(RewardModelSettings(str(reward_model), max_batch=2, max_length=24))
    requests = [RewardRequest("1 + 2 =\n", f"Answer: {a}") for a in (3, 4, -1, 30, 3)]

    async def scenario():
        alone = [(await actor.score([r]))[0] for r in requests]
        together = await asyncio.gather(actor.score(requests[:3]), actor.score(requests[3:]))
        return alone, [s for part in together for s in part]

    alone, together = asyncio.run(scenario())
    assert together == pytest.approx(alone, abs=1e-5)
    assert alone[0] == pytest.approx(alone[4], abs=1e-6) and len(set(round(s, 4) for s in alone[:4])) == 4
    assert actor.samples == 10 and actor.passes >= 5  # at most max_batch samples a pass
    # a sample longer than max_length keeps its end: a different far-left prompt scores the same
    end = len(actor.tokenizer("1 + 2 =\nAnswer: 3")["input_ids"]) - 2  # tokens of the common end, less a margin
    short = RewardModelActor(RewardModelSettings(str(reward_model), max_batch=2, max_length=end))
    long_a, long_b = (RewardRequest(head * 40 + "1 + 2 =\n", "Answer: 3") for head in ("7 - ", "8 + "))
    a, b = asyncio.run(short.score([long_a, long_b]))
    assert a == pytest.approx(b, abs=1e-6)
    assert asyncio.run(actor.score([long_a, long_b])) != pytest.approx([a, b])  # (24 tokens reach the heads)


def test_a_reward_model_reads_a_conversation_through_its_chat_template(reward_model, tmp_path):
    import shutil

    from agent_loops.chat import load_named_template

    chat = tmp_path / "chat_rm"
    shutil.copytree(reward_model, chat)
    config = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": load_named_template("chatml")}))
    actor = RewardModelActor(RewardModelSettings(str(chat), max_batch=4, max_length=256))
    text = actor.text(RewardRequest("ignored when there are messages", "Answer: 3",
                                    [{"role": "user", "content": "1 + 2 ="}]))
    assert text == "<|im_start|>user\n1 + 2 =<|im_end|>\n<|im_start|>assistant\nAnswer: 3<|im_end|>\n"
    plain = RewardModelActor(RewardModelSettings(str(reward_model), max_batch=4, max_length=256))
    assert plain.text(RewardRequest("1 + 2 =\n", "Answer: 3")) == "1 + 2 =\nAnswer: 3"  # the policy's view


def test_a_process_reward_model_scores_each_step_at_its_last_token_and_aggregates(process_reward_model):
    """reward.prm: the head's output at the last token of each step of the response (steps cut at
    the separator, empty ones skipped), computed here from HF's own forward pass of the text;
    the sample's score is their min, mean or last. Batched with other samples (padding) the same."""
    import dataclasses

    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    prompt, response = "12 + 7 =\n", "12 + 7 = 19\n\nthen 19\nAnswer: 19"
    text = prompt + response
    step_ends = [len(prompt + "12 + 7 = 19"), len(prompt + "12 + 7 = 19\n\nthen 19"), len(text)]
    tokenizer = AutoTokenizer.from_pretrained(process_reward_model)
    model = AutoModelForTokenClassification.from_pretrained(process_reward_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(**tokenizer(text, return_tensors="pt")).logits[0, :, 0]
    steps = [float(logits[len(tokenizer(text[:end])["input_ids"]) - 1]) for end in step_ends]
    assert len(set(round(x, 4) for x in steps)) == 3  # three different scores: the aggregates differ

    settings = RewardModelSettings(str(process_reward_model), max_batch=4, max_length=256, step_separator="\n")
    request = RewardRequest(prompt, response)
    other = RewardRequest("3 + 4 =\n", "a longer response, so that the first one is padded\nAnswer: 7")
    for aggregate, want in (("min", min(steps)), ("mean", sum(steps) / 3), ("last", steps[-1])):
        actor = RewardModelActor(dataclasses.replace(settings, aggregate=aggregate))
        alone, = asyncio.run(actor.score([request]))
        batched = asyncio.run(actor.score([other, request, RewardRequest(prompt, "")]))
        assert alone == pytest.approx(want, abs=1e-5) and batched[1] == pytest.approx(want, abs=1e-5)
        assert batched[2] == 0.0  # no step, no score


def test_a_process_reward_model_places_the_steps_after_its_chat_templates_prompt(process_reward_model, tmp_path):
    """Through a chat template the response follows the template's generation prompt (a step whose
    text is in the prompt too is placed in the response); a template that rewrites the
    response (here: trims it) leaves nothing to place the steps by: a clear error, which the worker
    counts as prm_error."""
    import shutil

    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from agent_loops.chat import load_named_template

    chat = tmp_path / "chat_prm"
    shutil.copytree(process_reward_model, chat)
    config = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": load_named_template("chatml")}))
    actor = RewardModelActor(RewardModelSettings(str(chat), max_batch=4, max_length=256, step_separator="\n"))
    prompt, response = "12 + 7 = 19\n12 + 7 =", "12 + 7 = 19\nAnswer: 19"  # the first step is in the prompt too
    text = actor.text(RewardRequest(prompt, response))
    start = text.rindex(response)
    tokenizer = AutoTokenizer.from_pretrained(chat)
    model = AutoModelForTokenClassification.from_pretrained(chat, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(**tokenizer(text, return_tensors="pt")).logits[0, :, 0]
    steps = [float(logits[len(tokenizer(text[:end])["input_ids"]) - 1])
             for end in (start + len("12 + 7 = 19"), start + len(response))]
    assert asyncio.run(actor.score([RewardRequest(prompt, response)])) == [pytest.approx(min(steps), abs=1e-5)]
    trimming = json.loads((chat / "tokenizer_config.json").read_text())
    trimming["chat_template"] = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n{% endfor %}"
                                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (chat / "tokenizer_config.json").write_text(json.dumps(trimming))
    trimmed = RewardModelActor(RewardModelSettings(str(chat), max_batch=4, max_length=256, step_separator="\n"))
    with pytest.raises(ValueError, match="chat template rewrites the response"):
        asyncio.run(trimmed.score([RewardRequest(prompt, " Answer: 19\n")]))


def test_only_a_one_output_sequence_classifier_is_a_reward_model(reward_model, base_model, tmp_path):
    assert reward_model_problem(str(reward_model)) is None
    assert reward_model_problem(str(base_model)) == (
        "its architectures ['Qwen2ForCausalLM'] hold no sequence classifier (a reward model is a "
        "*ForSequenceClassification checkpoint)")
    two = tmp_path / "two"
    two.mkdir()
    config = json.loads((reward_model / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "id2label": {"0": "bad", "1": "good"}}))
    assert reward_model_problem(str(two)) == "it has 2 outputs; a reward model has one score (num_labels=1)"
    from asyncrl.config.validate import ConfigError
    from asyncrl.run_config import load_config

    with pytest.raises(ConfigError, match=r"reward.model.path='.*': its architectures \['Qwen2ForCausalLM'\]"):
        load_config(["recipe=arith", f"reward.model.path={base_model}"])
    # a process reward model is a token classifier: the outcome reward model is refused there, in one line
    with pytest.raises(ConfigError) as e:
        load_config(["recipe=arith", f"reward.prm.path={reward_model}", "reward.prm.aggregate=max"])
    assert e.value.problems == [
        f"reward.prm.path={str(reward_model)!r}: its architectures ['Qwen2ForSequenceClassification'] hold no token "
        "classifier (a process reward model is a *ForTokenClassification checkpoint)",
        "reward.prm.aggregate='max': must be one of min, mean, last"]


class ScriptedReplica:
    """A replica behind the interface: `score.remote` answers, raises, or (`hang`) never answers."""

    def __init__(self, score: float = 0.0, hang: bool = False, error: Exception | None = None):
        self.calls = 0

        async def answer(requests):
            self.calls += 1
            if hang:
                await asyncio.Event().wait()  # set by no one: the client's timeout must end it
            if error is not None:
                raise error
            return [score for _ in requests]

        self.score = SimpleNamespace(remote=answer)


class ScriptedJudge:
    """A judge client behind the worker's interface: its score, or a failure to read its answer."""

    name = "judge"

    def __init__(self, answer: str, parse):
        self.answer, self.parse = answer, parse

    async def score(self, problem, response):
        return self.parse(self.answer)


def _model_client(replicas) -> RewardModelClient:
    return RewardModelClient("reward_model", replicas)


PROBLEM = Problem("p", "arith", "1 + 2", "1 + 2 =\n", "3")


def scored(services: RewardServices, env_reward: float = 1.0):
    traj = Trajectory("p", "g", [1], reward=env_reward, info={"response": "Answer: 3"})
    failure = asyncio.run(services.score(PROBLEM, traj))
    return traj, failure


def test_the_services_scores_are_weighed_beside_the_env_s_and_their_failures_counted(tmp_path, base_model):
    judge = JudgeClient.__new__(JudgeClient)  # its parser alone (no engine): reward.judge's defaults
    judge.name = "judge"
    judge.judge = JudgeConfig(parser="number", min_score=0, max_score=10)
    assert [judge.parse(a) for a in ("7", " 7.5/10", "-3", "12 points")] == [0.7, 0.75, 0.0, 1.0]
    judge.judge = JudgeConfig(parser="yes_no")
    assert [judge.parse(a) for a in ("Yes.", " no", "YES, it is")] == [1.0, 0.0, 1.0]
    with pytest.raises(ScoreFailed) as e:
        judge.parse("maybe")
    assert str(e.value.failure) == "judge_unparsable: 'maybe' (yes_no)"
    judge.judge = JudgeConfig(parser="match")  # the judge's own answer against the response's last number
    assert [judge.parse(a, "-5 + 2 = -3 Answer: -3") for a in ("Answer: -3", " -3.0", "Answer: 3",
                                                                "-5 + 2 = -3 Answer: -3")] == [1, 1, 0, 1]
    assert judge.parse("Answer: 4", "no number") == 0.0
    with pytest.raises(ScoreFailed):
        judge.parse("Answer: none", "Answer: 4")
    judge.judge = JudgeConfig(parser="yes_no")
    # 0.5 x 1.0 (env) + 2.0 x 0.25 (model) + 1.0 x 1.0 (judge: "yes") = 2.0
    model = _model_client([ScriptedReplica(0.25)])
    traj, failure = scored(RewardServices(0.5, 5, [(model, 2.0), (ScriptedJudge("yes", judge.parse), 1.0)]))
    assert failure is None and traj.reward == pytest.approx(2.0)
    assert traj.info["reward_metrics"] == {"env_reward": 1.0, "reward_model": 0.25, "judge": 1.0}
    # the replica with fewer of this worker's requests outstanding is picked
    busy, idle = ScriptedReplica(1.0), ScriptedReplica(1.0)
    two = _model_client([busy, idle])
    two.outstanding[0] = 3
    services = RewardServices(1.0, 5, [(two, 1.0)])
    scored(services)
    assert (busy.calls, idle.calls) == (0, 1) and services.stats["reward_model"].calls == 1
    for services, code in (
            (RewardServices(1.0, 0.05, [(_model_client([ScriptedReplica(1.0, hang=True)]), 1.0)]),
             "reward_model_timeout: > 0.05s (rollout.reward_timeout_s)"),
            (RewardServices(1.0, 5, [(_model_client([ScriptedReplica(error=RuntimeError("died\nmore"))]), 1.0)]),
             "reward_model_error: RuntimeError: died"),
            (RewardServices(1.0, 5, [(model, 1.0), (ScriptedJudge("perhaps", judge.parse), 1.0)]),
             "judge_unparsable: 'perhaps' (yes_no)")):
        traj, failure = scored(services)
        assert (str(failure), traj.reward, traj.info["reward_failure"]) == (code, 0.0, code)


def test_the_judge_is_asked_with_its_template_through_its_chat_template(reward_model, base_model, tmp_path):
    import shutil

    from agent_loops.chat import load_named_template

    chat = tmp_path / "chat_judge"
    shutil.copytree(base_model, chat)
    config = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": load_named_template("chatml")}))
    judge = JudgeClient("judge", [object()],
                        JudgeConfig(path=str(chat), prompt_template="Q: {prompt} A: {response} ok?"))
    conversation = Problem("p", "arith", "1 + 2", "(text)", "3", messages=[{"role": "system", "content": "Be brief."},
                                                                          {"role": "user", "content": "1 + 2 ="}])
    ids = judge.prompt_ids(conversation, "Answer: 3")
    asked = "<|im_start|>user\nQ: 1 + 2 = A: Answer: 3 ok?<|im_end|>\n<|im_start|>assistant\n"
    assert judge.tokenizer.decode(ids) == asked  # the last user message, the generation prompt
    plain = JudgeClient("judge", [object()],
                        JudgeConfig(path=str(base_model), prompt_template="Q: {prompt} A: {response}"))
    assert plain.tokenizer.decode(plain.prompt_ids(PROBLEM, "Answer: 3")) == "Q: 1 + 2 =\n A: Answer: 3"
    # a template without the response is a judge that answers the problem itself: parser=match only
    from asyncrl.config.validate import ConfigError
    from asyncrl.run_config import load_config

    alone = [f"reward.judge.path={base_model}", "reward.judge.prompt_template='{prompt}'"]
    with pytest.raises(ConfigError, match=r"must hold \{response\}"):
        load_config(alone)
    assert load_config([*alone, "reward.judge.parser=match"]).reward.judge.parser == "match"
