"""An abort pause empties the engine even when a request registers with vLLM only after the
pause's abort sweep (vLLM prepares a prompt in an executor thread before registering it). The
race itself is timing on a busy machine; here a scripted vLLM stands behind EngineActor's drain,
so the rule is checked every time. The real engine's pauses: tests/test_engine_vllm.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.engine import engine_actor
from asyncrl.engine.engine_actor import EngineActor
from asyncrl.run_config import load_config


class LateRegistrations:
    """vLLM's abort as the drain sees it: it ends only the requests registered so far (their
    streams end: generate() drops them from the outstanding set). `late` requests register one
    abort after another, each just after a sweep."""

    def __init__(self, actor: EngineActor, late: list[str]):
        self.actor, self.late, self.registered, self.aborts = actor, list(late), set(), 0

    async def abort(self, request_ids: list[str]) -> None:
        self.aborts += 1
        for rid in request_ids:
            if rid in self.registered:
                self.actor._outstanding.discard(rid)
        if not self.actor._outstanding:
            self.actor._idle.set()
        if self.late:
            self.registered.add(self.late.pop(0))


@pytest.fixture
def actor(base_model):
    cfg = load_config([f"model.path={base_model}"])
    return EngineActor(0, str(base_model), "", cfg.engine, "cpu")  # not started: no vLLM behind it


def outstanding(actor: EngineActor, ids: list[str]) -> None:
    actor._outstanding.update(ids)
    actor._idle.clear()


def test_requests_that_register_after_each_sweep_are_aborted_by_the_next(actor):
    outstanding(actor, ["a", "b"])
    actor._llm = LateRegistrations(actor, ["a", "b"])
    asyncio.run(asyncio.wait_for(actor._drain_aborted("abort", time.monotonic()), timeout=10))
    assert actor._outstanding == set() and actor._llm.aborts == 3  # a after the 1st sweep, b after the 2nd


def test_a_pause_that_cannot_empty_the_engine_fails_instead_of_hanging(actor, monkeypatch):
    monkeypatch.setattr(engine_actor, "ABORT_GIVE_UP_S", 0.5)
    outstanding(actor, ["never"])
    actor._llm = LateRegistrations(actor, [])  # it never registers
    with pytest.raises(RuntimeError, match=r"requests \['never'\] still outstanding 0.5s into an abort pause"):
        asyncio.run(asyncio.wait_for(actor._drain_aborted("abort", time.monotonic()), timeout=10))


def test_an_empty_engine_pauses_without_an_abort(actor):
    actor._llm = LateRegistrations(actor, [])
    asyncio.run(actor._drain_aborted("abort", time.monotonic()))
    assert actor._llm.aborts == 0
