"""Every operation of ninefold.comm between real processes, checked against references each rank computes.

The rank program (programs/collectives.py) runs ~100 cases per rank; these tests start it under
``ninefold launch`` (Gloo) and under ``mpiexec`` (MPI for CPU tensors; Gloo when asked) and require
every case on every rank to have passed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROGRAMS = Path(__file__).parent / "programs"


def _mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _check(out: subprocess.CompletedProcess, world: int, expect_cpu_route: str, expect_cuda_route: str = "") -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for rank in range(world):
        lines = re.findall(rf"\[{rank}\] (PASS|FAIL) (\S+)", text)
        done = re.search(rf"\[{rank}\] DONE (\d+)", text)
        assert done, f"rank {rank} did not finish:\n{text[-3000:]}"
        roots = 1 if world == 1 else 2  # broadcast and reduce from rank 0 and from the last rank
        per_float, per_int = 5 + 1 + 9 + 2 * roots, 4 + 1 + 9 + 2 * roots  # reductions, view, 3 dims x 3 ops, roots
        cases = 4 * per_float + per_int + 5 + 9  # ring, objects, split, check_peers, argument_errors; 9 review cases
        assert len(lines) == int(done.group(1)) == cases, (rank, len(lines))
        assert all(kind == "PASS" for kind, _ in lines), [c for k, c in lines if k != "PASS"]
        route = re.search(rf"\[{rank}\] ROUTES .*cpu: (\w+)", text)
        assert route and route.group(1) == expect_cpu_route, route and route.group(0)
        if expect_cuda_route:
            cuda = re.search(rf"\[{rank}\] ROUTES .*cuda: ([\w+]+)", text)
            assert cuda and cuda.group(1) == expect_cuda_route, cuda and cuda.group(0)


@pytest.mark.parametrize("world", [2, 3])
def test_every_operation_between_processes_over_gloo(world):
    out = subprocess.run([sys.executable, "-m", "ninefold.comm.launch", "--nproc", str(world),
                          str(PROGRAMS / "collectives.py")], capture_output=True, text=True, timeout=240)
    _check(out, world, "gloo")


@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec (pip install 'ninefold[mpi]')")
@pytest.mark.parametrize("backend, route", [("auto", "mpi"), ("gloo", "gloo")])
def test_every_operation_under_mpiexec(backend, route):
    pytest.importorskip("mpi4py")
    env = {**os.environ, "COMM_BACKEND": backend}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    out = subprocess.run([_mpiexec(), "-n", "3", sys.executable, str(PROGRAMS / "collectives.py")],
                         capture_output=True, text=True, timeout=240, env=env)
    _check(out, 3, route)


@pytest.mark.parametrize("mode, words", [("exit", "by peer"), ("late", "Timed out")])
def test_a_lost_or_late_peer_is_an_error_not_a_hang(mode, words):
    env = {**os.environ, "MODE": mode, "TIMEOUT_S": "3"}
    out = subprocess.run([sys.executable, "-m", "ninefold.comm.launch", "--nproc", "2", "--grace", "1",
                          str(PROGRAMS / "peer_loss.py")], capture_output=True, text=True, timeout=120, env=env)
    found = re.search(r"RESULT (\S+) ([\d.]+) (.*)", out.stdout)
    assert found, out.stdout + out.stderr
    kind, seconds, message = found.groups()
    assert kind == "CommError" and "all_reduce over gloo failed" in message and words in message
    assert float(seconds) < 30


def test_init_after_close_meets_the_job_again():
    """close() then init() in the same processes, three times, rank 0 closing a second after the others (the
    third time with the job given explicitly): each meeting takes about that second, not a rendezvous
    timeout (the program's is 20 s), and close() leaves no transport thread behind."""
    out = subprocess.run([sys.executable, "-m", "ninefold.comm.launch", "--nproc", "2", str(PROGRAMS / "reinit.py")],
                         capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for rank in range(2):
        took = [float(s) for s in re.findall(rf"\[{rank}\] MEETING \d (\S+)", text)]
        assert len(took) == 3 and max(took) < 10, (rank, took)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world", [1, 2])
def test_every_operation_on_cuda_tensors(world):
    """One rank per GPU goes through NCCL; two ranks on one GPU through host copies over Gloo."""
    env = {**os.environ, "COMM_DEVICE": "cuda"}
    out = subprocess.run([sys.executable, "-m", "ninefold.comm.launch", "--nproc", str(world),
                          str(PROGRAMS / "collectives.py")], capture_output=True, text=True, timeout=300, env=env)
    own_gpus = world <= torch.cuda.device_count()
    _check(out, world, "gloo", "nccl" if own_gpus else "gloo+host")
