"""Long-tailed draws for simulated scenarios: a lognormal given by its median and its 99th
percentile, the two figures published timings and lengths usually come with."""

from __future__ import annotations

import math
import random

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def lognormal(median: float, p99: float, rng: random.Random) -> float:
    """A draw of the lognormal whose median is `median` and 99th percentile `p99` (>= median)."""
    if median <= 0:
        return 0.0
    return median * math.exp(math.log(p99 / median) / Z99 * rng.gauss(0.0, 1.0))
