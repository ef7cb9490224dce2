"""``ninefold.comm.spawn``: a module-level function run as the ranks of a group in fresh processes.

The rank bodies are the functions at the top of this file (each rank imports this module anew).
Every spawn here costs a few seconds on two cores: each rank imports ninefold.comm, hence torch.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import sys
import time

import pytest

from ninefold.comm.spawn import SpawnError, spawn

pytestmark = pytest.mark.timeout(120)

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "NINEFOLD_COMM_LAUNCHED", "EXTRA")


def report(scale, offset):
    """Rank body: this rank's environment, pid and a value computed from the arguments."""
    return {"value": scale * int(os.environ["RANK"]) + offset, "pid": os.getpid(),
            "cli_modules": sorted(name for name in sys.modules if name.startswith("ninefold.cli")),
            **{name: os.environ.get(name) for name in NAMES}}


def fail_on(bad_rank: int, how: str, directory: str):
    """Rank body: record the pid in ``directory``; rank ``bad_rank`` waits for every other rank's record and
    fails as ``how`` says (raise, exit, kill); the others sleep."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(os.path.join(directory, f"{rank}.pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(directory, f"{rank}.pid.tmp"), os.path.join(directory, f"{rank}.pid"))
    if rank != bad_rank:
        time.sleep(60)
        return rank
    deadline = time.monotonic() + 30
    while len([n for n in os.listdir(directory) if n.endswith(".pid")]) < world and time.monotonic() < deadline:
        time.sleep(0.02)
    if how == "raise":
        _deep_failure(rank)
    if how == "exit":
        os._exit(7)
    os.kill(os.getpid(), signal.SIGKILL)


def _deep_failure(rank):
    raise ValueError(f"bad shard on rank {rank}")


def sleep_long():
    time.sleep(60)


def unpicklable_result():
    return lambda: None


def pids_in(directory) -> list[int]:
    return [int(path.read_text()) for path in sorted(directory.glob("*.pid"))]


def test_returns_each_ranks_value_in_rank_order():
    results = spawn(report, 2, (10, 1), env={"EXTRA": "extra"})
    assert [r["value"] for r in results] == [1, 11]
    port = results[0]["MASTER_PORT"]
    assert 1 <= int(port) <= 65535 and len({r["pid"] for r in results}) == 2
    for rank, r in enumerate(results):
        assert (r["RANK"], r["WORLD_SIZE"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) == (str(rank), "2", str(rank), "2")
        assert (r["MASTER_ADDR"], r["MASTER_PORT"], r["NINEFOLD_COMM_LAUNCHED"], r["EXTRA"]) == (
            "127.0.0.1", port, "1", "extra")
        assert r["cli_modules"] == []  # ninefold.comm (launch, spawn) does not import the command line
    assert not multiprocessing.active_children()


def test_an_exception_in_one_rank_stops_the_others_and_carries_its_traceback(tmp_path):
    start = time.monotonic()
    with pytest.raises(SpawnError) as raised:
        spawn(fail_on, 2, (1, "raise", str(tmp_path)))
    assert time.monotonic() - start < 30  # rank 0 would sleep for 60 s
    message = str(raised.value)
    assert raised.value.ranks == [1] and message.startswith("spawn: rank 1 failed:")
    assert "Traceback" in message and "in _deep_failure" in message
    assert "ValueError: bad shard on rank 1" in message
    assert isinstance(raised.value, RuntimeError)
    for pid in pids_in(tmp_path):
        assert not os.path.exists(f"/proc/{pid}")  # terminated and reaped
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("how, needle", [("exit", "exited with code 7"), ("kill", "was killed by SIGKILL")])
def test_a_rank_that_dies_without_a_result_is_reported_with_its_exit_code(tmp_path, how, needle):
    with pytest.raises(SpawnError) as raised:
        spawn(fail_on, 1, (0, how, str(tmp_path)))
    assert raised.value.ranks == [0]
    assert str(raised.value) == f"spawn: rank 0 {needle}" + (" (code 137)" if how == "kill" else "") + \
        " without returning a result"
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids_in(tmp_path))


def test_a_timeout_names_the_ranks_still_running_and_ends_them():
    start = time.monotonic()
    with pytest.raises(SpawnError) as raised:
        spawn(sleep_long, 2, timeout_s=1.0)
    assert time.monotonic() - start < 30
    assert raised.value.ranks == [0, 1]
    assert str(raised.value) == "spawn: timed out after 1.0 s; ranks still running: [0, 1]"
    assert not multiprocessing.active_children()


def test_a_result_that_cannot_be_pickled_is_reported():
    with pytest.raises(SpawnError) as raised:
        spawn(unpicklable_result, 1)
    assert "rank 0" in str(raised.value) and "cannot be pickled" in str(raised.value)


def _local_factory():
    def local():
        return 1
    return local


@pytest.mark.parametrize(
    "call, error, needles",
    [
        ({"fn": lambda: 1}, TypeError, ["fn", "<lambda>", "module level"]),
        ({"fn": _local_factory()}, TypeError, ["fn", "<locals>", "module level"]),
        ({"fn": 3}, TypeError, ["fn", "3", "module level"]),
        ({"nprocs": 0}, ValueError, ["nprocs", "0", ">= 1"]),
        ({"nprocs": 2.0}, TypeError, ["nprocs", "2.0", ">= 1"]),
        ({"args": 5}, TypeError, ["args", "5", "tuple"]),
        ({"args": (lambda: 1,)}, TypeError, ["args", "pickled", "tuple"]),
        ({"timeout_s": 0}, ValueError, ["timeout_s", "0", "> 0"]),
        ({"timeout_s": math.inf}, ValueError, ["timeout_s", "inf", "finite"]),
        ({"env": {"WORLD_SIZE": "4"}}, ValueError, ["env", "WORLD_SIZE", "other names"]),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(call, error, needles):
    call = {"fn": report, "nprocs": 2, "args": (1, 0), **call}
    with pytest.raises(error) as raised:
        spawn(call.pop("fn"), call.pop("nprocs"), call.pop("args"), **call)
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))
    assert not multiprocessing.active_children()


def gloo_sum():
    """Rank body: all-reduce (rank + 1) over Gloo, meeting through the environment spawn set."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value)
        return dist.get_rank(), int(value.item())
    finally:
        dist.destroy_process_group()


def test_spawned_ranks_meet_over_gloo():
    assert spawn(gloo_sum, 2, timeout_s=90) == [(0, 3), (1, 3)]
