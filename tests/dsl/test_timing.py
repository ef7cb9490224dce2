"""The tuner's stopwatch: the noise-aware choice (CPU) and device-time sampling (CUDA)."""

import pytest
import torch

from ninefold.dsl import timing


def test_a_clearly_faster_candidate_wins():
    samples = [[1.00, 1.01, 0.99, 1.00], [0.80, 0.81, 0.79, 0.80], [0.90, 0.91, 0.89, 0.90]]
    index, summary = timing.choose(samples)
    assert index == 1
    assert summary[1]["median_ms"] == pytest.approx(0.80)
    assert [s["samples"] for s in summary] == [4, 4, 4]


def test_an_earlier_candidate_within_the_noise_is_kept():
    # candidate 1 is 0.2% faster than candidate 0: below NOISE, so the prior's first choice stays
    samples = [[1.000, 1.000, 1.000], [0.998, 0.998, 0.998]]
    assert timing.choose(samples)[0] == 0
    # with wide spreads, a 3% lead is not significant either
    noisy = [[1.0, 1.3, 0.7, 1.0, 1.0], [0.97, 1.27, 0.67, 0.97, 0.97]]
    assert timing.choose(noisy)[0] == 0
    # a later candidate that is faster beyond the noise wins
    assert timing.choose([[1.0] * 5, [0.95] * 5])[0] == 1


def test_candidates_without_samples_are_skipped_and_none_at_all_is_an_error():
    index, summary = timing.choose([[], [2.0, 2.0]])
    assert index == 1 and summary[0]["median_ms"] is None
    with pytest.raises(ValueError, match="no candidate"):
        timing.choose([[], []])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_time_orders_kernels_by_their_work():
    small = torch.randn(1 << 16, device="cuda")
    large = torch.randn(1 << 26, device="cuda")
    fns = [lambda: small.mul_(1.0), lambda: large.mul_(1.0)]
    for fn in fns:
        fn()
    samples = timing.sample(fns, "cuda", rounds=2)
    assert all(len(s) >= timing.MIN_SAMPLES * 2 for s in samples)
    index, summary = timing.choose(samples)
    assert index == 0 and summary[0]["median_ms"] * 10 < summary[1]["median_ms"]


def test_only_quiet_measurements_are_steady():
    quiet = [1.00, 1.01, 0.99, 1.00, 1.00, 1.01, 0.99, 1.00]
    busy = [1.0, 3.0, 1.0, 5.0, 1.0, 2.5, 1.0, 4.0]  # time-sliced with another process
    _, summary = timing.choose([quiet, busy])
    assert timing.steady(summary, 0) and not timing.steady(summary, 1)
    assert not timing.steady([{"median_ms": 1.0, "stderr_ms": 0.0, "samples": 1}], 0)  # one sample proves nothing
