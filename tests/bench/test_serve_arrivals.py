"""Statistics of the arrival process: mean gap, coefficient of variation, gamma shape, last arrival."""

import math

import numpy as np
import pytest
import torch

from ninefold.bench.serve_arrivals import arrival_times


def gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times]))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_gap_cv_and_last_arrival(burstiness, seed):
    rate, n = 10.0, 5000
    times = arrival_times(n, rate, burstiness, seed)
    assert times.shape == (n,) and np.all(np.diff(times) >= 0) and times[0] > 0
    assert times[-1] == pytest.approx(n / rate, rel=1e-12)
    g = gaps(times)
    assert g.mean() == pytest.approx(1 / rate, rel=1e-9)
    # Gamma with shape k has coefficient of variation 1/sqrt(k): 2, 1, 0.5 here.
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gaps_follow_the_gamma_distribution(burstiness):
    rate, n = 3.0, 5000
    g = np.sort(gaps(arrival_times(n, rate, burstiness, seed=7))) * rate  # unit mean
    # Reference CDF of Gamma(shape k, scale 1/k), the regularised lower incomplete gamma function.
    k = torch.tensor(burstiness, dtype=torch.float64)
    cdf = torch.special.gammainc(k, k * torch.from_numpy(g)).numpy()
    ks = max((np.arange(1, n + 1) / n - cdf).max(), (cdf - np.arange(n) / n).max())
    assert ks < 0.03  # an exponential in place of Gamma(0.25) or Gamma(4) is off by more than 0.25


def test_seed_reproduces_and_varies():
    assert np.array_equal(arrival_times(50, 2.0, 1.0, seed=3), arrival_times(50, 2.0, 1.0, seed=3))
    assert not np.array_equal(arrival_times(50, 2.0, 1.0, seed=3), arrival_times(50, 2.0, 1.0, seed=4))


def test_single_request_lands_at_one_over_rate():
    assert arrival_times(1, 4.0, 0.5).tolist() == pytest.approx([0.25])


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(7, math.inf).tolist() == [0.0] * 7


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_requests": 0}, "num_requests"),
        ({"num_requests": 2.0}, "num_requests"),
        ({"rate": 0.0}, "rate"),
        ({"rate": -1.0}, "rate"),
        ({"rate": float("nan")}, "rate"),
        ({"burstiness": 0.0}, "burstiness"),
        ({"burstiness": math.inf}, "burstiness"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    args = {"num_requests": 5, "rate": 1.0, "burstiness": 1.0} | kwargs
    with pytest.raises(ValueError, match=name):
        arrival_times(**args)
