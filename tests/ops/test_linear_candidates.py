"""The GEMM tuners' shared candidate check (``ninefold.ops.linear_candidates``), on the CPU with stand-in kernels:
a candidate that raises or computes the wrong product is left out with a warning naming it, one whose error is
expected is left out silently, and the ones that agree become timed steps beside ``F.linear``."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F

from ninefold.ops import linear_candidates, timing


class CannotRun(RuntimeError):
    pass


def stand_in(x, w, out, candidate):
    if candidate == "raises":
        raise CannotRun("no kernel for this alignment")
    if candidate == "unsupported":
        raise CannotRun("cannot run this shape")
    if candidate == "not_a_kernel_error":
        raise KeyError(candidate)
    out.copy_(F.linear(x, w))
    if candidate == "wrong":
        out.mul_(1.1)  # 10% off: far outside the tolerance


def run(offered):
    return linear_candidates.checked_runs("stand-in", 24, 40, 32, torch.float32, torch.device("cpu"), offered,
                                          stand_in, CannotRun, quiet=lambda e: "cannot run this shape" in str(e),
                                          progress=False)


def test_only_candidates_that_run_and_agree_are_timed():
    with pytest.warns(UserWarning) as caught:
        runs, found = run([(name, name) for name in ("good", "wrong", "raises", "unsupported", "also_good")])
    messages = [str(w.message) for w in caught]
    assert found == {"good": "good", "also_good": "also_good"}
    assert set(runs) == {linear_candidates.VENDOR, "good", "also_good"}
    assert len(messages) == 2  # the expected "cannot run this shape" stays silent
    assert any("stand-in wrong disagrees with F.linear at M=24 N=40 K=32" in m for m in messages)
    assert any("stand-in raises failed at M=24 N=40 K=32: no kernel for this alignment; not used" in m
               for m in messages)


def test_timed_steps_run_and_the_fastest_is_picked_against_the_baseline():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runs, _ = run([("good", "good")])
    for step in runs.values():
        step()  # each cycles to the next weight copy and runs
    # medians of 25 calls each: a load spike on the other test worker's core cannot halve one of them
    best, times = timing.fastest(runs, torch.device("cpu"), ((25, None),), linear_candidates.VENDOR, 0.5)
    assert set(times) == {linear_candidates.VENDOR, "good"} and all(t > 0 for t in times.values())
    assert best == linear_candidates.VENDOR, times  # same work: nobody is 50% faster than the baseline


@pytest.mark.parametrize("min_gain, picked", [(0.0, "baseline"), (-0.5, "slower")])
def test_a_negative_min_gain_keeps_a_slower_candidate_within_it(min_gain, picked):
    runs = {"baseline": lambda: time.sleep(0.010), "slower": lambda: time.sleep(0.012)}  # (sleep never undershoots)
    best, times = timing.fastest(runs, torch.device("cpu"), ((3, None),), "baseline", min_gain)
    assert best == picked, times


def test_an_error_that_is_not_the_kernels_propagates():
    with pytest.raises(KeyError):
        run([("not_a_kernel_error", "not_a_kernel_error")])
