"""MpiBackend under real ``mpiexec`` processes, and its launch helpers.

The MPI checks run in ``mpi_programs/check_backend.py``, one launch per world size; every rank
writes a PASS/FAIL line per case, and the test demands a PASS from every rank for every case it
expects, so a case the program skips fails here too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ninefold.comm.backends.base import CommError
from ninefold.comm.backends.mpi import _pick_endpoint, mpi_world_from_env

PROGRAM = Path(__file__).parent / "mpi_programs" / "check_backend.py"
SRC = Path(__file__).resolve().parents[2] / "src"
TIMEOUT_S = 120
LAUNCHER_VARIABLES = (
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "PMIX_RANK",
    "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID",
)


def find_mpiexec() -> str | None:
    beside_python = Path(sys.executable).parent / "mpiexec"
    return str(beside_python) if beside_python.exists() else shutil.which("mpiexec")


MPIEXEC = find_mpiexec()
needs_mpi = pytest.mark.skipif(
    MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
    reason='needs mpiexec and mpi4py (pip install "ninefold[mpi]")',
)


def expected_cases(size: int) -> set[str]:
    """Every case check_backend.py must report as passed at world size ``size``."""
    reduced = ("float32", "float64", "float16", "bfloat16", "int64")
    small_ints = ("int8", "uint8", "int16", "int32")
    ops = ("sum", "product", "min", "max", "avg")
    modes = ("sync", "async")
    names = {
        f"{collective}/{dtype}/{op}/{mode}"
        for collective in ("all_reduce", "reduce_scatter", "reduce")
        for dtype in reduced for op in ops for mode in modes
        if not (op == "avg" and dtype == "int64")
    }
    names |= {f"all_reduce/{dtype}/{op}/sync" for dtype in small_ints for op in ops[:4]}
    names |= {f"all_reduce/exact/{dtype}" for dtype in reduced[:4]}
    names |= {"all_reduce/large/float32", "all_reduce/empty"}
    if size >= 3:
        names |= {"all_reduce/accumulates_in_float32/float16", "all_reduce/accumulates_in_float32/bfloat16"}
    names |= {
        f"{collective}/{dtype}/{mode}"
        for collective in ("all_gather", "broadcast", "all_to_all", "send_recv_ring")
        for dtype in reduced + small_ints + ("bool",) for mode in modes
    }
    names |= {"broadcast/scalar", "send_recv/tags_out_of_order"}
    names |= {f"broadcast/special_values/{dtype}" for dtype in ("float16", "bfloat16", "float32")}
    names |= {
        "async/not_completed_before_peer_sends", "async/polls_to_completion",
        "async/many_in_flight", "async/keeps_buffers_alive",
        "split/evens_odds",
        "unsupported/cuda", "unsupported/bool_reductions", "unsupported/integer_avg",
        "unsupported/accepted_and_others", "error/mpi_error_is_comm_error",
        "rendezvous/same_everywhere", "rendezvous/gloo_all_reduce", "env/matches_mpi",
        "close/world",
    }
    return names


def run_program(size: int, report_dir: Path) -> tuple[int, str]:
    """Run check_backend.py on ``size`` ranks; kill the whole launch if it outlives TIMEOUT_S."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    command = [MPIEXEC, "-n", str(size), sys.executable, str(PROGRAM), str(report_dir)]
    launch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, start_new_session=True)
    try:
        output, _ = launch.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        output, _ = launch.communicate()
        output += f"\n[killed after {TIMEOUT_S} s]"
    return launch.returncode, output


@needs_mpi
@pytest.mark.parametrize("size", [2, 3])
def test_every_case_passes_on_every_rank(size, tmp_path):
    returncode, output = run_program(size, tmp_path)
    expected = expected_cases(size)
    problems = []
    for rank in range(size):
        report = tmp_path / f"rank{rank}.txt"
        lines = report.read_text().splitlines() if report.exists() else []
        passed = {line.removeprefix("PASS ") for line in lines if line.startswith("PASS ")}
        problems += [f"rank {rank}: {line}" for line in lines if not line.startswith("PASS ")]
        problems += [f"rank {rank}: never passed {name}" for name in sorted(expected - passed)]
        problems += [f"rank {rank}: unexpected case {name}" for name in sorted(passed - expected)]
    assert not problems and returncode == 0, (
        f"mpiexec -n {size} exited {returncode}; {len(problems)} problems:\n"
        + "\n".join(problems[:40]) + f"\n--- output ---\n{output[-4000:]}"
    )


def test_imports_and_refuses_clearly_without_mpi4py():
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'mpi4py':\n"
        "            raise ModuleNotFoundError(\"No module named 'mpi4py'\")\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from ninefold.comm.backends import mpi\n"
        "assert 'mpi4py' not in sys.modules\n"
        "for make in (mpi.MpiBackend, mpi.rendezvous_from_mpi):\n"
        "    try:\n"
        "        make()\n"
        "    except ImportError as exc:\n"
        "        print('refused:', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    refusals = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 2, done.stdout
    assert all('pip install "ninefold[mpi]"' in line for line in refusals), refusals


@pytest.mark.parametrize(
    "variables, expected",
    [
        ({}, None),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, (1, 2, 1)),  # MPICH Hydra, as observed
        ({"PMI_RANK": "3", "PMI_SIZE": "4"}, (3, 4, 3)),  # MPICH gforker: one host, no local rank
        ({"PMI_RANK": "5", "PMI_SIZE": "8", "SLURM_LOCALID": "1"}, (5, 8, 1)),  # srun --mpi=pmi2
        ({"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
          "PMIX_RANK": "6"}, (6, 8, 2)),  # Open MPI 5
        ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0"}, (1, 4, 0)),
        ({"PMIX_RANK": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "0"}, (2, 4, 0)),  # srun --mpi=pmix
        ({"PMIX_RANK": "2"}, None),  # PMIx alone does not say the size
    ],
)
def test_mpi_world_from_env(monkeypatch, variables, expected):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert mpi_world_from_env() == expected


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"PMI_RANK": "one", "PMI_SIZE": "2"}, "PMI_RANK='one'"),
        ({"PMI_RANK": "2", "PMI_SIZE": "2"}, "PMI_RANK=2, PMI_SIZE=2"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "-1"},
         "local rank -1"),
    ],
)
def test_mpi_world_from_env_rejects_nonsense(monkeypatch, variables, message):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        mpi_world_from_env()


def test_endpoint_on_one_host_is_loopback():
    address, port = _pick_endpoint(["node7", "node7", "node7"])
    assert address == "127.0.0.1" and 0 < port < 65536


def test_endpoint_refuses_loopback_across_hosts():
    # A peer called "localhost" routes over loopback: no address the other host could reach.
    with pytest.raises(CommError, match="MASTER_ADDR"):
        _pick_endpoint(["node7", "localhost"])
