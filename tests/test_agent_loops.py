"""Agent loops without an engine: budgets, tool-call parsing, and each loop's state
machine against a scripted engine (tests/scripted_inference.py)."""

import asyncio

import numpy as np
import pytest
from transformers import AutoTokenizer

from agent_loops import get_agent_loop
from agent_loops.base import AgentLoop
from agent_loops.tools import TOOLS
from asyncrl.config.schema import ToolsConfig
from asyncrl.inference.stops import cut_at_split_stop
from asyncrl.types import (
    AgentLoopSnapshot,
    GenerationResult,
    RoutedExperts,
    SamplingSpec,
    Segment,
    Trajectory,
    TrajectoryStatus,
)
from tests.scripted_inference import DEFAULT_LOGPROB, Reply, ScriptedInference


@pytest.fixture(scope="module")
def tokenizer(base_model):
    return AutoTokenizer.from_pretrained(base_model)


def policy(ids, version=0):
    return Segment.from_policy(ids, [0.0] * len(ids), version)


def test_a_call_split_across_an_interruption_is_found(tokenizer):
    """Only the whole response shows the call: its first half ended the aborted segment."""
    loop = get_agent_loop("partial_tool")(None, tokenizer, SamplingSpec(max_new_tokens=80), max_model_len=128)
    t = Trajectory("p", "g", [1], segments=[policy(tokenizer.encode("<tool:calcu")),
                                             policy(tokenizer.encode("lator>2 + 3</tool>"), version=1)])
    snapshot = AgentLoopSnapshot("partial_tool", "generating", t, 80)
    assert loop.pending_call(snapshot) == ("calculator", "2 + 3")
    snapshot.loop_state["tool_calls"] = 1  # answered: nothing pending
    assert loop.pending_call(snapshot) is None


def test_tool_output_never_counts_as_a_call(tokenizer):
    loop = get_agent_loop("partial_tool")(None, tokenizer, SamplingSpec(max_new_tokens=80), max_model_len=128)
    t = Trajectory("p", "g", [1], segments=[policy(tokenizer.encode("<tool:python>print(1)</tool>"))])
    snapshot = AgentLoopSnapshot("partial_tool", "calling_tools", t, 80, loop_state={"tool_calls": 1})
    loop.append_env(snapshot, "<result><tool:calculator>1+1</tool></result>")  # a tool printing a call
    assert snapshot.trajectory.segments[-1].loss_mask == [0] * len(snapshot.trajectory.segments[-1])
    assert loop.pending_call(snapshot) is None


def test_budget_is_the_smaller_of_tokens_left_and_context_left(tokenizer):
    loop = get_agent_loop("partial_single_turn")(None, tokenizer, SamplingSpec(max_new_tokens=50), max_model_len=64)
    t = Trajectory("p", "g", list(range(20)), segments=[policy([5] * 10)])
    snapshot = AgentLoopSnapshot("partial_single_turn", "generating", t, 50)
    assert loop.budget(snapshot) == 34  # context: 64 - 20 - 10; tokens left: 50 - 10 = 40
    snapshot.max_new_tokens = 15
    assert loop.budget(snapshot) == 5


def test_tool_output_is_cut_to_the_budget(tokenizer):
    loop = get_agent_loop("partial_tool")(None, tokenizer, SamplingSpec(max_new_tokens=20), max_model_len=128)
    t = Trajectory("p", "g", [1], segments=[policy([7] * 15)])
    snapshot = AgentLoopSnapshot("partial_tool", "calling_tools", t, 20)
    loop.append_env(snapshot, "<result>a long tool output</result>")
    assert t.num_response_tokens == 20 and len(t.segments[-1]) == 5


def test_config_validation_refuses_an_unknown_default_loop(base_model):
    from asyncrl.config import ConfigError
    from asyncrl.run_config import load_config

    with pytest.raises(ConfigError, match="rollout.agent_loop='no_such_loop': not a registered agent loop; "
                                          "registered: chat_tool, multi_turn, partial_single_turn, partial_tool"):
        load_config(["rollout.agent_loop=no_such_loop"])


# -- each loop's state machine against a scripted engine ------------------------------

PROMPT = "1 + 2 =\n"
LOOPS = ["partial_single_turn", "partial_tool", "multi_turn"]
# What each loop adds to a trajectory's info when it finishes after one generation.
ONE_TURN_INFO = {"partial_single_turn": {}, "partial_tool": {}, "multi_turn": {"turns": 1}}


def make(name, tokenizer, script, max_new_tokens=40, max_model_len=256, interrupt=None, **kwargs):
    engine = ScriptedInference(script, tokenizer)
    loop = get_agent_loop(name)(engine, tokenizer, SamplingSpec(max_new_tokens=max_new_tokens), max_model_len,
                                interrupt=interrupt, **kwargs)
    return loop, engine


def start(tokenizer):
    return Trajectory("p", "g", tokenizer.encode(PROMPT))


def run(loop, tokenizer):
    return asyncio.run(loop.run(start(tokenizer)))


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", LOOPS)
def test_a_loop_finishes_ok_when_the_engine_stops(tokenizer, name):
    loop, engine = make(name, tokenizer, [Reply("Answer: 3")])
    outcome = run(loop, tokenizer)
    t = outcome.trajectory
    assert outcome.finished and t.status is TrajectoryStatus.OK
    assert tokenizer.decode(t.response_token_ids) == "Answer: 3"
    assert t.loss_mask == [1] * 9 and t.versions == [0] * 9 and t.response_logprobs == [DEFAULT_LOGPROB] * 9
    assert t.info == {**ONE_TURN_INFO[name], "num_interruptions": 0}
    (request,) = engine.requests
    assert request.prompt_token_ids == ids(tokenizer, PROMPT) and request.max_new_tokens == 40
    assert request.sampling.stop == (["</tool>"] if name == "partial_tool" else [])


@pytest.mark.parametrize("name", LOOPS)
def test_a_loop_is_truncated_at_its_token_budget_or_the_context(tokenizer, name):
    loop, engine = make(name, tokenizer, [Reply("1 + 2 = 3 Answer: 3")], max_new_tokens=6)
    t = run(loop, tokenizer).trajectory
    assert t.status is TrajectoryStatus.TRUNCATED and tokenizer.decode(t.response_token_ids) == "1 + 2 "
    assert t.info == {**ONE_TURN_INFO[name], "num_interruptions": 0}

    loop, engine = make(name, tokenizer, [Reply("1 + 2 = 3 Answer: 3")], max_model_len=len(PROMPT) + 4)
    assert run(loop, tokenizer).trajectory.num_response_tokens == 4
    assert engine.requests[0].max_new_tokens == 4  # the context, not the 40 tokens left

    loop, engine = make(name, tokenizer, [])
    spent = AgentLoopSnapshot(name, "generating", Trajectory("p", "g", [1], segments=[policy([5] * 40)]), 40)
    assert asyncio.run(loop.resume(spent)).trajectory.status is TrajectoryStatus.TRUNCATED
    assert engine.requests == []  # nothing left to ask for


@pytest.mark.parametrize("name", LOOPS)
def test_an_aborted_request_resumes_for_the_rest_of_the_budget(tokenizer, name):
    loop, _ = make(name, tokenizer, [Reply("1 + 2", "abort", version=0)])
    outcome = run(loop, tokenizer)
    snapshot = outcome.snapshot
    assert not outcome.finished and snapshot.state == "generating" and snapshot.num_interruptions == 1
    assert tokenizer.decode(snapshot.trajectory.response_token_ids) == "1 + 2"  # the partial tokens are kept

    snapshot = AgentLoopSnapshot.from_dict(snapshot.to_dict())  # as another worker receives it
    fresh, engine = make(name, tokenizer, [Reply(" = 3 Answer: 3", version=1)])
    t = asyncio.run(fresh.resume(snapshot)).trajectory
    (request,) = engine.requests
    assert request.prompt_token_ids == ids(tokenizer, PROMPT + "1 + 2")  # prompt + tokens so far
    assert request.max_new_tokens == 40 - 5  # only what remains
    assert t.status is TrajectoryStatus.OK and tokenizer.decode(t.response_token_ids) == "1 + 2 = 3 Answer: 3"
    assert t.versions == [0] * 5 + [1] * 14 and t.loss_mask == [1] * 19
    assert t.info == {**ONE_TURN_INFO[name], "num_interruptions": 1}


@pytest.mark.parametrize("name", LOOPS)
def test_an_interrupt_before_start_snapshots_without_a_request(tokenizer, name):
    interrupt = asyncio.Event()
    interrupt.set()
    loop, engine = make(name, tokenizer, [], interrupt=interrupt)
    snapshot = run(loop, tokenizer).snapshot
    assert snapshot.state == "generating" and snapshot.num_interruptions == 1
    assert snapshot.trajectory.segments == [] and engine.requests == []


CALL, RESULT = "<tool:calculator>2 + 3</tool>", "<result>5</result>"


def test_partial_tool_appends_a_call_result_as_environment_tokens(tokenizer):
    loop, engine = make("partial_tool", tokenizer, [Reply(CALL), Reply("Answer: 5")], max_new_tokens=80)
    t = run(loop, tokenizer).trajectory
    assert t.status is TrajectoryStatus.OK and t.info == {"tool_calls": 1, "num_interruptions": 0}
    assert tokenizer.decode(t.response_token_ids) == CALL + RESULT + "Answer: 5"
    assert t.loss_mask == [1] * len(CALL) + [0] * len(RESULT) + [1] * 9
    assert t.versions == [0] * len(CALL) + [-1] * len(RESULT) + [0] * 9
    first, second = engine.requests
    assert first.sampling.stop == ["</tool>"] and second.sampling.stop == ["</tool>"]
    assert second.prompt_token_ids == ids(tokenizer, PROMPT + CALL + RESULT)
    assert second.max_new_tokens == 80 - len(CALL) - len(RESULT)


def test_partial_tool_finds_a_call_split_by_an_abort(tokenizer):
    loop, _ = make("partial_tool", tokenizer, [Reply("<tool:calcu", "abort")], max_new_tokens=80)
    snapshot = run(loop, tokenizer).snapshot
    fresh, _ = make("partial_tool", tokenizer, [Reply("lator>2 + 3</tool>", version=1), Reply("Answer: 5", version=1)],
                    max_new_tokens=80)
    t = asyncio.run(fresh.resume(snapshot)).trajectory
    assert t.info == {"tool_calls": 1, "num_interruptions": 1}
    assert tokenizer.decode(t.response_token_ids) == CALL + RESULT + "Answer: 5"


def test_a_stop_string_split_by_an_abort_ends_the_resumed_generation(tokenizer):
    """The engine matches "</tool>" only in what it generates: after "</to" ended an aborted
    request, the resumed one writes on past "ol>". The loop cuts it there, as the engine would
    have stopped, and runs the call."""
    loop, _ = make("partial_tool", tokenizer, [Reply("<tool:calculator>2 + 3</to", "abort")], max_new_tokens=80)
    snapshot = run(loop, tokenizer).snapshot
    fresh, _ = make("partial_tool", tokenizer, [Reply("ol><result>7</result>", version=1), Reply("Answer: 5")],
                    max_new_tokens=80)
    t = asyncio.run(fresh.resume(snapshot)).trajectory
    assert tokenizer.decode(t.response_token_ids) == CALL + RESULT + "Answer: 5"
    assert t.info == {"tool_calls": 1, "num_interruptions": 1}


def test_the_gateway_continues_a_request_only_to_the_stop_string_a_sync_split(tokenizer):
    """The inference gateway hides a sync from env servers by continuing the aborted request:
    it too ends at a stop string the pause split."""
    from asyncrl.rollout.gateway import InferenceGateway

    engine = ScriptedInference([Reply("<tool:calculator>2 + 3</to", "abort"), Reply("ol> and on", version=1)],
                               tokenizer)
    gateway = InferenceGateway(lambda: engine, tokenizer)
    out = asyncio.run(gateway.agenerate(ids(tokenizer, PROMPT), SamplingSpec(max_new_tokens=40, stop=["</tool>"]), "r"))
    assert (tokenizer.decode(out.token_ids), out.finish_reason) == (CALL, "stop")
    assert out.versions == [0] * len(ids(tokenizer, "<tool:calculator>2 + 3</to")) + [1] * len(ids(tokenizer, "ol>"))


def test_a_stop_string_is_not_completed_across_environment_tokens(tokenizer):
    """Text an environment appended that ends like a stop string's start is no stop: the
    request after it starts fresh, its tokens kept whole."""
    fresh = Trajectory("p", "g", [1], segments=[policy(ids(tokenizer, "a </to")),
                                                Segment.from_env(ids(tokenizer, "b"))])
    assert AgentLoop.continued_tokens(fresh, 8) == []
    resumed = Trajectory("p", "g", [1], segments=[*fresh.segments, policy([5, 6]), policy([7], version=1)])
    assert AgentLoop.continued_tokens(resumed, 8) == [5, 6, 7]
    assert AgentLoop.continued_tokens(resumed, 2) == [6, 7]


def test_a_cut_at_a_split_stop_string_keeps_the_routes_of_the_positions_it_forwarded(tokenizer):
    head, tail = ids(tokenizer, "x </to"), ids(tokenizer, "ol>2 + 3")
    forwarded = 2 + len(head)  # a prompt of 2 tokens, then head
    positions = forwarded + len(tail) - 1
    routes = RoutedExperts.from_array(np.arange(positions * 2, dtype=np.uint8).reshape(positions, 1, 2))
    result = GenerationResult(tail, [0.0] * len(tail), [1] * len(tail), "length", routes)
    cut = cut_at_split_stop(head, result, ["</tool>"], tokenizer, forwarded)
    k = len(ids(tokenizer, "ol>"))
    assert (cut.token_ids, cut.logprobs, cut.versions, cut.finish_reason) == (tail[:k], [0.0] * k, [1] * k, "stop")
    assert cut.routes.positions == forwarded + k - 1
    assert cut.routes.data == routes.data[: cut.routes.positions * 2]
    # no stop string begun at the pause, or none completed: the result as it came
    assert cut_at_split_stop(ids(tokenizer, "x </tx"), result, ["</tool>"], tokenizer, forwarded) is result
    other = GenerationResult(ids(tokenizer, "oops"), [0.0] * 4, [1] * 4, "length")
    assert cut_at_split_stop(head, other, ["</tool>"], tokenizer, forwarded) is other


def test_partial_tool_completes_a_running_call_before_the_snapshot(tokenizer, monkeypatch):
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(argument, sandbox):
        started.set()
        await release.wait()
        return argument.upper()

    monkeypatch.setitem(TOOLS, "slow", slow)

    async def interrupted_during_the_call():
        interrupt = asyncio.Event()
        loop, engine = make("partial_tool", tokenizer, [Reply("<tool:slow>ok</tool>")], interrupt=interrupt,
                            max_new_tokens=80)
        task = asyncio.create_task(loop.run(start(tokenizer)))
        await asyncio.wait_for(started.wait(), 5)
        interrupt.set()  # a weight sync begins while the tool runs
        release.set()
        return await task, engine

    outcome, engine = asyncio.run(interrupted_during_the_call())
    snapshot = outcome.snapshot
    assert snapshot.state == "generating" and snapshot.loop_state == {"tool_calls": 1} and len(engine.requests) == 1
    assert tokenizer.decode(snapshot.trajectory.response_token_ids) == "<tool:slow>ok</tool><result>OK</result>"
    fresh, _ = make("partial_tool", tokenizer, [Reply("Answer: OK")])
    t = asyncio.run(fresh.resume(snapshot)).trajectory
    assert t.status is TrajectoryStatus.OK and t.info == {"tool_calls": 1, "num_interruptions": 1}


def test_partial_tool_interrupted_during_a_request_snapshots_before_calling(tokenizer):
    async def interrupted_while_generating():
        interrupt, answered = asyncio.Event(), asyncio.Event()
        loop, engine = make("partial_tool", tokenizer, [Reply(CALL, hold=answered)], interrupt=interrupt,
                            max_new_tokens=80)
        task = asyncio.create_task(loop.run(start(tokenizer)))
        await engine.wait_for_requests(1)
        interrupt.set()
        answered.set()  # the request completes (pause mode keep): the flag stops the loop after it
        return await task

    snapshot = asyncio.run(interrupted_while_generating()).snapshot
    assert snapshot.state == "calling_tools" and snapshot.loop_state == {}
    assert tokenizer.decode(snapshot.trajectory.response_token_ids) == CALL  # the call has not run
    fresh, engine = make("partial_tool", tokenizer, [Reply("Answer: 5")])
    t = asyncio.run(fresh.resume(snapshot)).trajectory
    assert tokenizer.decode(t.response_token_ids) == CALL + RESULT + "Answer: 5"
    assert t.info == {"tool_calls": 1, "num_interruptions": 1} and len(engine.requests) == 1


def test_partial_tool_counts_failed_calls_by_reason(tokenizer, monkeypatch):
    async def broken(argument, sandbox):
        raise ValueError("bug")

    monkeypatch.setitem(TOOLS, "broken", broken)
    script = [Reply("<tool:search>x</tool>"), Reply("<tool:broken>x</tool>"), Reply(CALL), Reply("Answer: 5")]
    loop, _ = make("partial_tool", tokenizer, script, max_new_tokens=400, max_model_len=512)
    t = run(loop, tokenizer).trajectory
    assert t.status is TrajectoryStatus.OK
    assert t.info == {"tool_calls": 3, "tool_errors": {"unknown_tool": 1, "tool_exception": 1}, "num_interruptions": 0}
    text = tokenizer.decode(t.response_token_ids)
    assert "<result>error: unknown tool 'search'" in text and "failed: ValueError: bug</result>" in text


def test_partial_tool_stops_at_the_tool_call_limit(tokenizer):
    loop, engine = make("partial_tool", tokenizer, [Reply(CALL), Reply(CALL)], max_new_tokens=100,
                        tools=ToolsConfig(max_calls=1))
    t = run(loop, tokenizer).trajectory
    assert t.status is TrajectoryStatus.TRUNCATED
    assert t.info == {"stop_reason": "max_tool_calls", "tool_calls": 1, "num_interruptions": 0}
    assert tokenizer.decode(t.response_token_ids) == CALL + RESULT + CALL and len(engine.requests) == 2


REPLY = " no, try again. "


def test_multi_turn_appends_environment_replies_as_loss_mask_0_tokens(tokenizer):
    seen = []

    def env(response, turn):
        seen.append((response, turn))
        return REPLY if turn == 1 else None

    loop, engine = make("multi_turn", tokenizer, [Reply("Answer: 4"), Reply("Answer: 3", version=1)], env=env)
    t = run(loop, tokenizer).trajectory
    assert t.status is TrajectoryStatus.OK and t.info == {"turns": 2, "num_interruptions": 0}
    assert seen == [("Answer: 4", 1), ("Answer: 4" + REPLY + "Answer: 3", 2)]
    assert t.loss_mask == [1] * 9 + [0] * len(REPLY) + [1] * 9
    assert t.versions == [0] * 9 + [-1] * len(REPLY) + [1] * 9
    second = engine.requests[1]
    assert second.prompt_token_ids == ids(tokenizer, PROMPT + "Answer: 4" + REPLY)
    assert second.max_new_tokens == 40 - 9 - len(REPLY)


def test_multi_turn_cuts_a_reply_to_the_budget_and_ends_truncated(tokenizer):
    loop, engine = make("multi_turn", tokenizer, [Reply("Answer: 4")], max_new_tokens=12, env=lambda r, turn: REPLY)
    t = run(loop, tokenizer).trajectory
    assert t.status is TrajectoryStatus.TRUNCATED and t.info == {"turns": 1, "num_interruptions": 0}
    assert t.num_response_tokens == 12 and t.loss_mask == [1] * 9 + [0] * 3 and len(engine.requests) == 1


def test_multi_turn_interrupted_during_a_request_snapshots_before_observing(tokenizer):
    async def interrupted_while_generating():
        interrupt, answered = asyncio.Event(), asyncio.Event()
        loop, engine = make("multi_turn", tokenizer, [Reply("Answer: 4", hold=answered)], interrupt=interrupt,
                            env=lambda r, turn: None)
        task = asyncio.create_task(loop.run(start(tokenizer)))
        await engine.wait_for_requests(1)
        interrupt.set()
        answered.set()
        return await task

    snapshot = asyncio.run(interrupted_while_generating()).snapshot
    assert snapshot.state == "observing" and snapshot.loop_state == {"turns": 1}
    turns = []
    fresh, engine = make("multi_turn", tokenizer, [], env=lambda r, turn: turns.append(turn))
    t = asyncio.run(fresh.resume(snapshot)).trajectory
    assert turns == [1] and engine.requests == []  # the environment answers the turn already generated
    assert t.status is TrajectoryStatus.OK and t.info == {"turns": 1, "num_interruptions": 1}


def test_a_snapshot_in_a_state_the_loop_does_not_have_is_refused(tokenizer):
    loop, _ = make("partial_single_turn", tokenizer, [])
    with pytest.raises(ValueError, match="partial_single_turn: unknown state 'calling_tools'"):
        asyncio.run(loop.resume(AgentLoopSnapshot("partial_single_turn", "calling_tools", start(tokenizer), 40)))
