"""MessageQueue (backpressure, FIFO, metrics, checkpoint state) and staleness control,
without Ray: both are plain classes that Ray wraps at the edge."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.messages import QueueState
from asyncrl.queue.message_queue import MessageQueue
from asyncrl.rollout.admission import (
    InvariantBroken,
    PromptAccount,
    PromptAccountState,
    PromptLedger,
    StalenessController,
)
from asyncrl.types import Segment, Trajectory, TrajectoryGroup


def group(i: int, version: int = 0) -> TrajectoryGroup:
    gid = f"g{i}"
    trajs = [Trajectory(prompt_id=f"p{i}", group_id=gid, prompt_token_ids=[1],
                        segments=[Segment.from_policy([5, 6], [-0.1, -0.2], [version, version + 1])])]
    return TrajectoryGroup(gid, f"p{i}", trajs)


def test_put_waits_while_full_and_get_waits_for_n():
    async def scenario():
        q = MessageQueue(capacity=2, enable_ray_metrics=False)
        await q.put(group(0))
        await q.put(group(1))
        third = asyncio.create_task(q.put(group(2)))
        await asyncio.sleep(0.05)
        assert not third.done() and q.size() == 2  # backpressure: nothing dropped, the producer waits
        got = await q.get(1, current_version=2)
        await asyncio.wait_for(third, 1)
        assert [g.group_id for g in got] == ["g0"] and q.size() == 2
        waiting = asyncio.create_task(q.get(2))
        await asyncio.sleep(0.05)
        assert waiting.done()  # g1, g2 are there
        assert [g.group_id for g in waiting.result()] == ["g1", "g2"]
        late = asyncio.create_task(q.get(1))
        await asyncio.sleep(0.05)
        assert not late.done()
        await q.put(group(3, version=1))
        assert [g.group_id for g in await asyncio.wait_for(late, 1)] == ["g3"]
        with pytest.raises(asyncio.TimeoutError):
            await q.get(1, timeout_s=0.05)
        m = q.stats()
        assert (m.produced, m.consumed, m.size) == (4, 4, 0)
        # g0 taken at version 2 with tokens of version 0: staleness 2; g1, g2, g3 at version 0: 0, ... g3 -1
        assert m.staleness_histogram[2] == 1
        assert m.producer_wait_s > 0.04 and m.consumer_wait_s > 0.04
    asyncio.run(scenario())


def test_queue_state_round_trips_through_a_checkpoint():
    async def scenario():
        q = MessageQueue(capacity=4, enable_ray_metrics=False)
        for i in range(3):
            await q.put(group(i))
        await q.get(1)
        state = QueueState.from_dict(json.loads(json.dumps(q.state().to_dict())))  # as a checkpoint holds it
        restored = MessageQueue(capacity=4, enable_ray_metrics=False)
        await restored.restore(state)
        assert restored.size() == 2 and (restored.produced, restored.consumed) == (3, 1)
        assert [g.to_dict() for g in await restored.get(2)] == [group(1).to_dict(), group(2).to_dict()]
    asyncio.run(scenario())


def test_admission_bound_by_hand():
    # eta = 1, B = 32, k = 1: (1 + v + 1) * 32 -> 64 prompts at v = 0, 96 at v = 1
    s = PromptAccount(StalenessController(max_staleness=1, prompts_per_step=32))
    assert s.admissible(0) == 64
    s.admit([f"p{i}" for i in range(64)], {}, 0)
    assert s.admissible(0) == 0 and s.admissible(1) == 32
    with pytest.raises(AssertionError):
        s.admit(["one more"], {}, 0)
    # synchronous: eta = 0, k = 2, B = 4: (0 + v + 1) * 2 * 4 = 8 per version
    sync = StalenessController(max_staleness=0, prompts_per_step=4, sync_every_steps=2)
    assert [sync.capacity(v) for v in range(3)] == [8, 16, 24]
    # the queue holds every group admission lets start ahead of the trainer, and one step's more
    assert sync.queue_capacity() == 8 + 4 and s.rule.queue_capacity() == 64 + 32
    # freshness: oldest token version 0 (group(0) has versions 0, 1)
    assert s.rule.is_fresh(group(0), 1) and not s.rule.is_fresh(group(0), 2)
    # controlled staleness: eta = 2, engines lag = 2 versions behind: admission runs 2 - 2 = 0
    # versions ahead, (0 + v + 1) * B = 4 per version, as synchronous training does
    lagged = StalenessController(max_staleness=2, prompts_per_step=4, policy_lag=2)
    assert [lagged.capacity(v) for v in range(3)] == [4, 8, 12]
    assert lagged.is_fresh(group(0), 2) and not lagged.is_fresh(group(0), 3)


def test_ledger_keeps_each_prompt_in_exactly_one_state():
    ledger = PromptLedger()
    for p in ("a", "b", "c", "d"):
        ledger.admit(p)
    ledger.finish("a", "trained")
    ledger.finish("b", "filtered", "uniform")
    ledger.finish("c", "failed", "empty_prompt")
    assert ledger.counts() == {"running": 1, "trained": 1, "filtered": 1, "failed": 1}
    assert ledger.running() == {"d"} and ledger.reasons["filtered:uniform"] == 1
    with pytest.raises(ValueError, match="admitted twice"):
        ledger.admit("a")
    with pytest.raises(ValueError, match="not running"):
        ledger.finish("a", "trained")


def test_admission_over_versions_with_a_sync_every_two_steps():
    # eta = 1, B = 4, k = 2: (1 + v + 1) * 2 * 4 = 16, 24, 32, 40 prompts by versions 0..3, so
    # each sync (k * B = 8 prompts trained) lets 8 more start.
    s = PromptAccount(StalenessController(max_staleness=1, prompts_per_step=4, sync_every_steps=2))
    started_at = []  # the version each prompt started at, in admission order
    for v in range(4):
        n = s.admissible(v)
        s.admit([f"p{len(started_at) + i}" for i in range(n)], {}, v)
        started_at += [v] * n
    assert [started_at.count(v) for v in range(4)] == [16, 8, 8, 8] and s.admitted == 40
    # Prompt a (1-based) is trained in step ceil(a / B), which runs at version (step - 1) // k:
    # prompt 16 starts at v0 and is trained in step 4 at v1; prompt 24 starts at v1, step 6, v2.
    trained_at = [((a + 3) // 4 - 1) // 2 for a in range(1, 41)]
    staleness = [t - v for t, v in zip(trained_at, started_at)]
    assert max(staleness) == 1 and min(staleness) == 0  # the bound eta holds, and is reached

    partial = PromptAccount(StalenessController(max_staleness=1, prompts_per_step=4, sync_every_steps=2))
    partial.admit([f"p{i}" for i in range(12)], {"p10": "empty_prompt", "p11": "too_long"}, 0)
    assert partial.admitted == 10  # the two refused prompts failed and take no room
    assert partial.admissible(0) == 6 and partial.admissible(1) == 14  # what is left, then a sync's worth more


def test_the_prompt_account_adds_up_and_says_so_when_it_does_not():
    """SkyRL's invariant in asyncrl's terms: admitted = accepted = running + trained + filtered +
    failed after acceptance; trained in order, none twice; every running prompt held by a worker
    or the queue. Each way of breaking it is caught, here on purpose."""
    rule = StalenessController(max_staleness=0, prompts_per_step=4)
    account = PromptAccount(rule)
    account.admit(["a", "b", "c", "d", "e"], {"e": "empty_prompt"}, 0)
    account.trained("a")
    account.filtered("b", "uniform")
    account.failed("c", "too_long")  # refused when restarted: accepted, so it stays admitted
    assert account.admitted == 4 and account.counts() == {"running": 1, "trained": 1, "filtered": 1, "failed": 2}
    account.check(0, held={"d", "x"})  # holding a finished prompt's late group is no loss
    with pytest.raises(InvariantBroken, match=r"1 running prompts are neither queued nor in a worker, e.g. \['d'\]"):
        account.check(0, held=set())
    # the checkpoint's copy restores the same account; broken copies are refused by the check
    state = PromptAccountState.from_dict(json.loads(json.dumps(account.to_dict())))
    PromptAccount(rule, state).check(0, held={"d"})
    twice = PromptAccountState(**{**account.to_dict(), "trained": ["a", "a"]})
    with pytest.raises(InvariantBroken, match="2 trainings recorded .1 of prompts trained before. for 1 trained"):
        PromptAccount(rule, twice).check(0)
    over = PromptAccountState(**{**account.to_dict(), "rejected": 0})  # 5 admitted, room for 4
    with pytest.raises(InvariantBroken, match="5 admitted, more than admission's 4 at version 0"):
        PromptAccount(rule, over).check(0)
    with pytest.raises(InvariantBroken, match="3 prompts refused at admission but 2 failed"):
        PromptAccount(rule, PromptAccountState(**{**account.to_dict(), "rejected": 3})).check(0)
    with pytest.raises(ValueError, match="not a prompt account"):
        PromptAccountState.from_dict({**account.to_dict(), "states": {"a": "lost"}})
