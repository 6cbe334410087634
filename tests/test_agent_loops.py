"""Agent-loop logic that needs no engine: budgets and tool-call parsing."""

import pytest
from transformers import AutoTokenizer

from agent_loops import get_agent_loop
from asyncrl.types import AgentLoopSnapshot, SamplingSpec, Segment, Trajectory


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
    loop.append_tool_output(snapshot, "<tool:calculator>1+1</tool>")  # a tool printing a call
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
    loop.append_tool_output(snapshot, "a long tool output")
    assert t.num_response_tokens == 20 and len(t.segments[-1]) == 5


def test_config_validation_refuses_an_unknown_default_loop(base_model):
    from asyncrl.config import ConfigError
    from asyncrl.run_config import load_config

    with pytest.raises(ConfigError, match="rollout.agent_loop='no_such_loop': not a registered agent loop; "
                                          "registered: multi_turn, partial_single_turn, partial_tool"):
        load_config(["rollout.agent_loop=no_such_loop"])
