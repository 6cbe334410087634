"""MessageQueue: the bounded buffer of finished trajectory groups between the rollout
workers (producers) and the driver/trainer (consumer). A Ray async actor, `message-queue`.

- `put(group)` waits while the queue is full (backpressure): nothing is ever dropped.
- `get(n)` waits until n groups are there and returns the n oldest (FIFO).
- Metrics: size, produced, consumed, producer and consumer wait times, and a histogram
  of the groups' staleness (policy versions between a group's oldest token and the
  version current when the group is taken out).
- `state()` / `restore()` carry the contents through checkpoints.
"""

from __future__ import annotations

import asyncio
import collections
import time

from asyncrl.messages import QueueState, QueueStats
from asyncrl.types import TrajectoryGroup, staleness


class MessageQueue:
    def __init__(self, capacity: int, enable_ray_metrics: bool = True):
        if capacity < 1:
            raise ValueError(f"queue capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: collections.deque[TrajectoryGroup] = collections.deque()
        self._changed = asyncio.Condition()
        self.produced = 0
        self.consumed = 0
        self.producer_wait_s = 0.0
        self.consumer_wait_s = 0.0
        self.staleness_histogram: collections.Counter[int] = collections.Counter()
        self._gauges = None
        if enable_ray_metrics:
            from asyncrl.monitoring.ray_metrics import RayGauges

            self._gauges = RayGauges()

    async def put(self, group: TrajectoryGroup) -> None:
        t0 = time.monotonic()
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._items) < self.capacity)
            self._items.append(group)
            self.produced += 1
            self._changed.notify_all()
        self.producer_wait_s += time.monotonic() - t0

    async def get(self, n: int, current_version: int = 0, timeout_s: float | None = None) -> list[TrajectoryGroup]:
        """The n oldest groups, once n are there. Raises TimeoutError after `timeout_s`."""
        if not 1 <= n <= self.capacity:
            raise ValueError(f"get({n}): n must be in [1, capacity={self.capacity}]")
        t0 = time.monotonic()
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self._items) >= n), timeout_s)
            groups = [self._items.popleft() for _ in range(n)]
            self.consumed += n
            self._changed.notify_all()
        self.consumer_wait_s += time.monotonic() - t0
        for g in groups:
            oldest = g.oldest_version()
            if oldest is not None:
                self.staleness_histogram[staleness(current_version, oldest)] += 1
        return groups

    def size(self) -> int:
        return len(self._items)

    def report(self, values: dict[str, float]) -> None:
        """Export the driver's run gauges, with the queue's size, as Ray metrics."""
        if self._gauges is not None:
            self._gauges.set({**values, "asyncrl_queue_size": len(self._items)})

    def stats(self) -> QueueStats:
        return QueueStats(len(self._items), self.capacity, self.produced, self.consumed, self.producer_wait_s,
                          self.consumer_wait_s, dict(sorted(self.staleness_histogram.items())), time.process_time())

    def prompt_ids(self) -> list[str]:
        """The prompts whose groups are queued."""
        return [g.prompt_id for g in self._items]

    def state(self) -> QueueState:
        """For a checkpoint: the queued groups and the counters."""
        return QueueState(list(self._items), self.produced, self.consumed, dict(self.staleness_histogram))

    async def restore(self, state: QueueState) -> None:
        async with self._changed:
            self._items = collections.deque(state.groups)
            self.produced, self.consumed = state.produced, state.consumed
            self.staleness_histogram = collections.Counter(state.staleness_histogram)
            self._changed.notify_all()
