"""init() in one process (a job of one) and its argument errors."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ninefold.comm as nc
from ninefold.comm.launch import free_port


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "NINEFOLD_COMM_CHECK"):
        monkeypatch.delenv(name, raising=False)
    yield
    assert not dist.is_initialized(), "a test left torch.distributed initialized"


def test_a_job_of_one_runs_every_operation_and_closes(clean_env):
    comm = nc.init(device="cpu")
    try:
        assert (comm.rank, comm.world_size, comm.device) == (0, 1, torch.device("cpu"))
        assert comm.backend_for(torch.ones(1)) == "gloo"
        x = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(comm.all_reduce(x.clone(), "avg"), x)
        assert torch.equal(comm.all_gather(x, dim=1), x)
        assert torch.equal(comm.reduce_scatter(x, dim=0), x)
        assert torch.equal(comm.all_to_all(x, dim=1), x)
        assert torch.equal(comm.all_gather(torch.tensor(5.0)), torch.tensor([5.0]))
        assert comm.all_gather_object({"a": 1}) == [{"a": 1}]
        assert comm.broadcast_object("hi") == "hi"
        sub = comm.split(0)
        assert sub.world_size == 1
        sub.close()
        text = comm.describe()
        assert "cpu tensors: gloo" in text and "rank" in text
    finally:
        comm.close()
    comm.close()  # twice is fine
    with pytest.raises(nc.CommError, match="closed"):
        comm.all_reduce(torch.ones(1))


def _transport_thread_count(expect: int | None = None) -> int:
    """How many Gloo and TCPStore threads this process has (Linux names them), waiting up to 2 s for
    ``expect`` (a joined thread can stay listed until the kernel reaps it)."""
    deadline = time.monotonic() + 2
    while True:
        count = 0
        for comm_file in Path("/proc/self/task").glob("*/comm"):
            with contextlib.suppress(OSError):
                count += comm_file.read_text().startswith(("pt_gloo", "gloo", "pt_tcpstore"))
        if expect is None or count == expect or time.monotonic() > deadline:
            return count
        time.sleep(0.01)


def test_close_ends_the_transport_threads_while_the_communicator_is_referenced(clean_env):
    """close() destroys the process groups, its children's too: a group that lives on (the communicator still
    referenced, say from a reference cycle) keeps Gloo's worker threads into interpreter shutdown, where one
    that releases a finished operation's tensor aborts the process."""
    before = _transport_thread_count()
    comm = nc.init(device="cpu")
    child = comm.split(0)
    if _transport_thread_count() == before:
        pytest.skip("torch's threads are not named here (not Linux?)")
    comm.close()
    assert _transport_thread_count(expect=before) == before
    with pytest.raises(nc.CommError, match="closed"):
        child.all_reduce(torch.ones(1))


def test_a_communicator_is_a_context_manager(clean_env):
    with nc.init(device="cpu") as comm:
        comm.barrier()
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs, kind, words", [
    ({"backend": "tcp"}, ValueError, "backend: expected one of 'auto', 'nccl', 'gloo', 'mpi', got 'tcp'"),
    ({"timeout_s": 0}, ValueError, "timeout_s: expected a positive number"),
    ({"timeout_s": True}, ValueError, "timeout_s"),
    ({"device": "tpu"}, ValueError, "device: expected"),
    ({"device": "cuda:99"}, ValueError, "device: cuda:99"),
    ({"backend": "mpi"}, ValueError, "backend: 'mpi' needs processes started by an MPI launcher"),
])
def test_bad_arguments_name_the_argument(clean_env, kwargs, kind, words):
    with pytest.raises(kind, match=words.replace("(", r"\(").replace("[", r"\[")):
        nc.init(**kwargs)


def test_nccl_on_a_machine_without_it_says_why(clean_env):
    if dist.is_nccl_available() and torch.cuda.is_available():
        pytest.skip("this machine has NCCL and a GPU")
    with pytest.raises(ValueError, match="backend: 'nccl' needs every rank on its own GPU"):
        nc.init("nccl", device="cpu")
    assert not dist.is_initialized()


def test_rank_without_master_address_is_refused(clean_env, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="MASTER_ADDR: RANK and WORLD_SIZE are set"):
        nc.init()


@pytest.mark.parametrize("rank, world, words", [
    ("2", "2", "RANK: expected 0..WORLD_SIZE-1 = 0..1, got 2"),
    ("0", "0", "WORLD_SIZE: expected at least 1, got 0"),
])
def test_rank_outside_the_world_is_refused(clean_env, monkeypatch, rank, world, words):
    for k, v in {"RANK": rank, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=words):
        nc.init()


@pytest.mark.parametrize("kwargs, words", [
    ({"rank": 0, "world_size": 2}, "init_method: rank, world_size and init_method go together"),
    ({"rank": 0, "world_size": 0, "init_method": "tcp://127.0.0.1:1"}, "world_size: expected a positive int, got 0"),
    ({"rank": 2, "world_size": 2, "init_method": "tcp://127.0.0.1:1"}, "rank: expected an int in 0..world_size-1 = 0..1, got 2"),
    ({"rank": 0, "world_size": 1, "init_method": "127.0.0.1:1"}, "init_method: expected 'tcp://HOST:PORT'"),
])
def test_explicit_job_arguments_are_checked(clean_env, kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        nc.init(device="cpu", **kwargs)


EXPLICIT_JOB = Path(__file__).parent / "programs" / "explicit_job.py"


def _explicit_rank(rank: int, world: int, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen([sys.executable, str(EXPLICIT_JOB), str(rank), str(world), str(port)], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_an_explicit_job_meets_without_launcher_variables(clean_env):
    port = free_port()
    ranks = [_explicit_rank(r, 2, port) for r in range(2)]
    outputs = [p.communicate(timeout=120) for p in ranks]
    for p, (_, err) in zip(ranks, outputs):
        assert p.returncode == 0, err[-2000:]
    assert sorted(line for out, _ in outputs for line in out.splitlines() if line.startswith("RESULT")) == [
        "RESULT 0 3", "RESULT 1 3"]


def test_a_process_meets_a_second_job_of_new_processes(clean_env):
    """This process, rank 0, meets a job, closes, and meets a new job whose other rank is a fresh process, at
    the same address (as an LLM driver starting a second engine's workers does): the new rank must not take
    the first job's store, nor wait for a meeting it never had."""
    port = free_port()
    for _ in range(2):
        peer = _explicit_rank(1, 2, port)
        with nc.init(device="cpu", rank=0, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=30) as comm:
            assert comm.all_reduce(torch.tensor([1.0])).item() == 3.0
        out, err = peer.communicate(timeout=120)
        assert peer.returncode == 0 and "RESULT 1 3" in out, err[-2000:]


def test_op_names(clean_env):
    from ninefold.comm.communicator import parse_op
    assert parse_op("prod") is nc.ReduceOp.PRODUCT and parse_op("MEAN") is nc.ReduceOp.AVG
    with pytest.raises(ValueError, match="op: expected one of 'sum'"):
        parse_op("median")


def test_a_file_meeting_that_rank_0_never_joins_ends_after_timeout_s(clean_env, tmp_path):
    code = ("import time, ninefold.comm as nc\nstart = time.monotonic()\ntry:\n"
            f"    nc.init(device='cpu', rank=1, world_size=2, init_method='file://{tmp_path}/store', timeout_s=2)\n"
            "except Exception as e:\n    print('ERROR', type(e).__name__, round(time.monotonic() - start))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    words = out.stdout.split()
    assert words[:2] == ["ERROR", "CommError"], out.stdout + out.stderr[-2000:]
    assert int(words[2]) < 30  # (the file store's own default is 300 s)
