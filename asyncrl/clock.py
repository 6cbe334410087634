"""The run's clock: real seconds, or, with simulated backends, simulated seconds that pass
`cluster.time_scale` times faster than real ones.

Everything a run reports as a duration (step times, idle ratios, training seconds, engine
activity, the simulated engines' and trainer's work) reads this clock, so a simulated
128-GPU hour that runs in minutes here is logged as an hour. Timeouts stay in real seconds:
they guard against processes that hang, which do so in real time.
"""

from __future__ import annotations

import asyncio
import time


class Clock:
    def __init__(self, scale: float = 1.0):
        if not scale > 0:
            raise ValueError(f"time scale {scale}: must be > 0")
        self.scale = scale

    def now(self) -> float:
        """Seconds on this clock (monotonic; only differences mean anything)."""
        return time.monotonic() * self.scale

    def real(self, seconds: float) -> float:
        """The real seconds that `seconds` on this clock take."""
        return seconds / self.scale

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds) / self.scale)

    async def asleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.scale)
