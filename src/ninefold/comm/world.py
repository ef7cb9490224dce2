"""Starting a communicator over every process of the job, from what the launcher left in the environment.

The job is found, in order, from explicit arguments, torchrun-style variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``ninefold launch`` sets them), or an MPI launcher's
variables (``mpiexec``: then MPI itself hands out the rendezvous address, so Gloo and NCCL start
too); with none of these the process is a job of one.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import time
import uuid
import weakref

import torch
import torch.distributed as dist

from ninefold.comm.backends.base import Backend, CommError
from ninefold.comm.backends.mpi import MpiBackend, env_int, mpi_world_from_env, rendezvous_from_mpi
from ninefold.comm.backends.torch_dist import TorchDistBackend
from ninefold.comm.communicator import Communicator
from ninefold.comm.topology import BACKEND_NAMES, Route, Topology, describe_rank

BACKEND_CHOICES = ("auto", *BACKEND_NAMES)

# The name rank 0 gave this process's last meeting with its job (init() after close() meets again; each
# meeting keeps its keys under its own name in the store, see _meet).
_last_meeting: str | None = None
_MEETING_KEY = "ninefold.comm/meeting"

# Communicators init() made and nobody closed yet: closed at interpreter exit. Left to the final garbage
# collection, Gloo's threads outlive the interpreter's shutdown and abort the process (SIGABRT from
# std::terminate, about 1 exit in 2 for a 2-rank job that never calls close(); tests/comm/test_exit.py).
_open_communicators: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for communicator in list(_open_communicators):
        with contextlib.suppress(Exception):  # exiting anyway: a transport that fails to close must not mask why
            communicator.close()


def init(backend: str = "auto", *, device: str | torch.device | None = None, timeout_s: float = 600.0,
         check_peers: bool | None = None, rank: int | None = None, world_size: int | None = None,
         init_method: str | None = None) -> Communicator:
    """A :class:`Communicator` over every process of the job (collective: every process calls it).

    ``backend``: "auto" picks per device type from the topology (NCCL for CUDA tensors when every rank
    has its own GPU, MPI for CPU tensors under an MPI launcher, Gloo otherwise); "nccl", "gloo" or "mpi"
    sends every tensor it can carry through that one (CPU tensors stay on Gloo with "nccl").
    ``device``: this rank's device; default ``cuda:LOCAL_RANK`` (modulo the visible GPUs) when CUDA is
    available, else the CPU. ``timeout_s`` bounds the rendezvous and every Gloo/NCCL operation.
    ``check_peers`` (default: ``NINEFOLD_COMM_CHECK=1``) makes every collective compare its arguments
    across the ranks first.
    ``rank``, ``world_size``, ``init_method`` (all three or none; ``init_method`` as torch's, e.g.
    ``"tcp://127.0.0.1:29500"``): the job given explicitly, for processes a program starts itself; they
    take precedence over the environment, and the default device is then ``cuda:rank`` (modulo the GPUs).
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKEND_CHOICES))}, got {backend!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    if check_peers is None:
        check_peers = os.environ.get("NINEFOLD_COMM_CHECK", "0") not in ("", "0")
    explicit = _explicit_job(rank, world_size, init_method)
    rank_device = _pick_device(device, None if explicit is None else explicit[0])
    mpi = None if explicit is not None else _mpi_world()
    if backend == "mpi" and mpi is None:
        raise ValueError("backend: 'mpi' needs processes started by an MPI launcher (mpiexec) and mpi4py; "
                         "neither an MPI launcher's environment nor mpi4py was found")
    owns = _start_torch_distributed(mpi, timeout_s, explicit)
    try:
        return _build(backend, rank_device, mpi, timeout_s, check_peers, owns)
    except BaseException:
        for release in owns:
            release()
        raise


def _build(backend: str, rank_device: torch.device, mpi, timeout_s: float, check_peers: bool,
           owns: tuple) -> Communicator:
    world = dist.group.WORLD
    ranks = list(range(dist.get_world_size()))
    backends: dict[str, Backend] = {"gloo": _gloo_backend(ranks, timeout_s)}
    infos = [None] * len(ranks)
    dist.all_gather_object(infos, describe_rank(dist.get_rank(), rank_device), group=backends["gloo"].process_group)
    topology = Topology(tuple(infos))
    if mpi is not None:
        backends["mpi"] = mpi
    if topology.all_cuda and not topology.shared_gpus() and dist.is_nccl_available() and backend in ("auto", "nccl"):
        group = world if dist.get_backend() == "nccl" else dist.new_group(
            ranks, backend="nccl", timeout=datetime.timedelta(seconds=timeout_s))
        backends["nccl"] = TorchDistBackend("nccl", group, ranks)
    routes = _routes(topology, set(backends), backend, mpi)
    communicator = Communicator(backends, topology, rank_device, routes, check_peers=check_peers, owns=owns)
    _open_communicators.add(communicator)
    return communicator


def _explicit_job(rank, world_size, init_method) -> tuple[int, int, str] | None:
    """(rank, world_size, init_method) when the caller gave them, checked; None when it gave none."""
    given = {"rank": rank, "world_size": world_size, "init_method": init_method}
    if all(v is None for v in given.values()):
        return None
    missing = [name for name, v in given.items() if v is None]
    if missing:
        raise ValueError(f"{missing[0]}: rank, world_size and init_method go together; got "
                         + ", ".join(f"{k}={v!r}" for k, v in given.items()))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in 0..world_size-1 = 0..{world_size - 1}, got {rank!r}")
    if not isinstance(init_method, str) or not init_method.startswith(("tcp://", "file://", "env://")):
        raise ValueError(f"init_method: expected 'tcp://HOST:PORT' or 'file://PATH', got {init_method!r}")
    return rank, world_size, init_method


def _pick_device(device, explicit_rank: int | None = None) -> torch.device:
    if device is None:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            local = explicit_rank if explicit_rank is not None else int(
                os.environ.get("LOCAL_RANK", _mpi_local_rank() or 0))
            device = torch.device("cuda", local % torch.cuda.device_count())
        else:
            return torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected None, 'cpu' or 'cuda[:N]', got {device!r}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device} was asked for but CUDA is not available here")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"device: {device} does not exist; this process sees {torch.cuda.device_count()} GPUs")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device}")
    return device


def _mpi_local_rank() -> int | None:
    found = mpi_world_from_env()
    return None if found is None else found[2]


def _mpi_world():
    """The MPI backend when an MPI launcher started this process and mpi4py is installed, else None."""
    if mpi_world_from_env() is None:
        return None
    try:
        return MpiBackend()
    except ImportError:
        return None


def _start_torch_distributed(mpi, timeout_s: float, explicit: tuple[int, int, str] | None = None) -> tuple:
    """Start torch.distributed's default group unless the caller already did; returns what close() undoes."""
    if dist.is_initialized():
        return ()
    timeout = datetime.timedelta(seconds=timeout_s)
    env = os.environ
    if explicit is not None:
        rank, world, init = explicit
    elif "RANK" in env and "WORLD_SIZE" in env:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise ValueError(f"{name}: RANK and WORLD_SIZE are set but {name} is not; start the job with "
                                 "`ninefold launch` or torchrun, or set all four")
        rank, world = env_int("RANK"), env_int("WORLD_SIZE")
        if world < 1:
            raise ValueError(f"WORLD_SIZE: expected at least 1, got {world}")
        if not 0 <= rank < world:
            raise ValueError(f"RANK: expected 0..WORLD_SIZE-1 = 0..{world - 1}, got {rank}")
        init = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    elif mpi is not None:
        addr, port = rendezvous_from_mpi()
        rank, world, init = mpi.rank, mpi.world_size, f"tcp://{addr}:{port}"
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return (dist.destroy_process_group,)
    try:
        store = _meet(init, rank, world, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except (RuntimeError, ValueError) as e:
        raise CommError(f"rendezvous at {init} as rank {rank} of {world} failed: {e}") from e
    return (dist.destroy_process_group,)


def _meet(init: str, rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The store of this process's next meeting with its job at ``init`` (torch's rendezvous), under a
    prefix of the meeting's own.

    After ``close()``, a rank may reach the store of the last meeting before rank 0 (closing later) has
    stopped serving it; it waits there for rank 0's next meeting, and when that store stops serving,
    asks again at ``init``, until ``timeout`` has passed."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            store = _meeting_store(init, rank, world, deadline)
            store.set_timeout(timeout)  # it was made with the time left
            return store
        except dist.DistNetworkError:  # the last meeting's store stopped serving while this rank waited
            if rank == 0 or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def _meeting_store(init: str, rank: int, world: int, deadline: float) -> dist.Store:
    """The store at ``init``, under the prefix of the meeting rank 0 names there (a fresh name each time)."""
    global _last_meeting
    left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0))
    store = next(iter(dist.rendezvous(init, rank, world, timeout=left)))[0]
    store.set_timeout(left)  # (file:// ignores the rendezvous' timeout: its FileStore waits 300 s)
    if rank == 0:
        store.set(_MEETING_KEY, uuid.uuid4().hex)
    meeting = store.get(_MEETING_KEY).decode()
    while meeting == _last_meeting:  # the store of this process's last meeting: rank 0 is still closing it
        if time.monotonic() > deadline:
            raise CommError(f"rank 0 did not start a new meeting at {init} within the timeout (it still "
                            "served the last one); init() after close() must run on every rank")
        time.sleep(0.05)
        meeting = store.get(_MEETING_KEY).decode()  # raises DistNetworkError once that store stops
    _last_meeting = meeting
    return dist.PrefixStore(f"ninefold.comm/{meeting}", store)


def _gloo_backend(ranks: list[int], timeout_s: float) -> TorchDistBackend:
    if dist.get_backend() == "gloo":
        return TorchDistBackend("gloo", dist.group.WORLD, ranks)
    group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return TorchDistBackend("gloo", group, ranks)


def _routes(topology: Topology, available: set[str], backend: str, mpi) -> dict[str, Route]:
    mpi_cuda = False
    if mpi is not None:
        with contextlib.suppress(Exception):
            mpi_cuda = mpi.unsupported("cuda", torch.float32) is None
    if backend == "auto":
        usable = available
    elif backend == "nccl":
        if "nccl" not in available:
            raise ValueError("backend: 'nccl' needs every rank on its own GPU with NCCL available; here "
                             + _why_not_nccl(topology))
        usable = {"nccl", "gloo"}
    else:
        usable = {backend}
    routes = {}
    for kind in ("cpu", "cuda"):
        route = topology.choose(kind, usable, mpi_launched=mpi is not None, mpi_cuda_aware=mpi_cuda)
        if route is not None:
            routes[kind] = route
    if "cpu" not in routes:
        raise CommError(f"no transport for CPU tensors among {sorted(usable)}")
    return routes


def _why_not_nccl(topology: Topology) -> str:
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    if not topology.all_cuda:
        return "not every rank has a GPU:\n" + topology.table()
    return "ranks share a GPU:\n" + topology.table()
