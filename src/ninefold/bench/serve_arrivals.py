"""When each request of a serving benchmark is sent: a gamma arrival process."""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds after the start, one per request, non-decreasing.

    Gaps between requests are gamma distributed with shape ``burstiness`` and mean ``1 / rate``:
    burstiness 1 is a Poisson process, below 1 burstier (coefficient of variation
    ``1 / sqrt(burstiness)``), above 1 more regular. The times are then rescaled so that the last
    request is sent at exactly ``num_requests / rate``, so every run lasts as long as its nominal
    rate says. ``rate = inf`` sends everything at time 0.
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    if not isinstance(rate, (int, float)) or math.isnan(rate) or rate <= 0:
        raise ValueError(f"rate must be a positive number of requests per second or inf, got {rate!r}")
    if not isinstance(burstiness, (int, float)) or not math.isfinite(burstiness) or burstiness <= 0:
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness!r}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    return times * ((num_requests / rate) / times[-1])
