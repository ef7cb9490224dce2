"""The MPI transport: :class:`MpiBackend` over an mpi4py communicator, and the helpers that let
torch.distributed start under a plain ``mpiexec`` launch (:func:`rendezvous_from_mpi`,
:func:`mpi_world_from_env`).

Tensors travel through mpi4py's buffer API (no pickling) as views of their own memory. Data that
is only moved (gather, broadcast, all-to-all, send/recv) travels as raw bytes, so every dtype moves
bit for bit, bfloat16 included. Reductions use the MPI type of the dtype; float16 and bfloat16 have
none, so they are reduced in a float32 copy and rounded back once: their results carry float32's
rounding, not that of a float16 accumulator. AVG is a SUM divided by the world size afterwards.
bool tensors reduce with MAX (or) and MIN (and) as bytes of 0 and 1, as over Gloo and NCCL, so that a
program does not depend on which launcher started it.

mpi4py is imported on first use, so this module imports without it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from ninefold.comm.backends.base import Backend, CommError, DoneWork, ReduceOp, Work

_INSTALL_HINT = 'pip install "ninefold[mpi]"'

_MOVABLE = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
)
# MPI datatype names for the dtypes MPI reduces natively; float16/bfloat16 reduce as FLOAT.
_REDUCE_TYPE_NAMES = {
    torch.float64: "DOUBLE", torch.float32: "FLOAT",
    torch.int8: "INT8_T", torch.uint8: "UINT8_T", torch.int16: "INT16_T",
    torch.int32: "INT32_T", torch.int64: "INT64_T", torch.bool: "UINT8_T",  # bool: bytes of 0 and 1
}
_UPCAST = (torch.float16, torch.bfloat16)
_MPI_OP_NAMES = {
    ReduceOp.SUM: "SUM", ReduceOp.AVG: "SUM", ReduceOp.PRODUCT: "PROD",
    ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX",
}


def _import_mpi():
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        raise ImportError(
            f"the MPI backend needs mpi4py and an MPI library ({type(exc).__name__}: {exc}); "
            f"install them with: {_INSTALL_HINT}"
        ) from exc
    return MPI


@contextmanager
def _mpi_errors(operation: str):
    """Re-raise mpi4py's errors from ``operation`` as :class:`CommError`."""
    MPI = _import_mpi()
    try:
        yield
    except MPI.Exception as exc:
        raise CommError(f"MPI {operation} failed: {exc.Get_error_string()}") from exc


@functools.cache
def _cuda_aware(MPI) -> bool:
    """Whether the MPI library takes CUDA device pointers.

    Asks the MPI 4.1 memory-allocation kinds first (a positive answer only: they list what the
    launch asked for), then the ``MPIX_Query_cuda_support`` extension of MPICH and Open MPI, looked up
    through mpi4py's own extension module so that it is the library mpi4py actually loaded.
    """
    info = MPI.COMM_WORLD.Get_info()
    try:
        kinds = info.Get("mpi_memory_alloc_kinds") or ""
    finally:
        info.Free()
    if any(kind.strip().startswith("cuda") for kind in kinds.split(",")):
        return True
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    query.argtypes = []
    return bool(query())


def _flat(tensor: torch.Tensor, as_bytes: bool = False):
    """A buffer mpi4py can read and write: the tensor's own memory, flat (bytes if ``as_bytes``, and always
    for bool, which MPI reduces as bytes)."""
    flat = tensor.detach().reshape(-1)
    if as_bytes or flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def _ready(tensor: torch.Tensor) -> None:
    # MPI reads device memory directly: work queued on the stream (an upcast copy, the producer of
    # the tensor) has to finish first.
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()


class _MpiWork:
    """A nonblocking MPI call in flight; completing it runs ``finish`` (cast back, AVG's division).

    Holds every buffer the request reads or writes, so that none is freed before MPI is done with it.
    """

    def __init__(self, request, operation: str, finish: Callable[[], None] | None, keep: tuple):
        self._request = request
        self._operation = operation
        self._finish = finish
        self._keep = keep

    def wait(self) -> None:
        """Block until the transfer is done and its result is in the caller's tensor."""
        if self._request is None:
            return
        with _mpi_errors(self._operation):
            self._request.Wait()
        self._complete()

    def is_completed(self) -> bool:
        """Whether the transfer is done, without blocking; True also means the result is in place."""
        if self._request is None:
            return True
        with _mpi_errors(self._operation):
            done = self._request.Test()
        if done:
            self._complete()
        return done

    def _complete(self) -> None:
        self._request = None
        if self._finish is not None:
            self._finish()
        self._finish = None
        self._keep = ()


class MpiBackend(Backend):
    """Collectives and point-to-point transfers over an MPI communicator.

    ``comm`` is an mpi4py intracommunicator (default ``MPI.COMM_WORLD``); this backend's ranks are
    that communicator's. CPU tensors always travel; CUDA tensors only when the MPI library is
    CUDA-aware (``cuda_aware``, probed once at construction).
    """

    name = "mpi"

    def __init__(self, comm: Any = None):
        self._MPI = MPI = _import_mpi()
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self._owns_comm = False
        self.rank = self._comm.Get_rank()
        self.world_size = self._comm.Get_size()
        self.cuda_aware = _cuda_aware(MPI)
        self.max_tag = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))

    def __repr__(self) -> str:
        state = "closed" if self._comm is None else f"rank={self.rank}, world_size={self.world_size}"
        return f"MpiBackend({state})"

    def unsupported(self, device_type: str, dtype: torch.dtype, op: ReduceOp | None = None) -> str | None:
        """None if tensors of ``device_type``/``dtype`` (reduced with ``op``, if given) can travel here, else why not."""
        if device_type == "cuda" and not self.cuda_aware:
            return (
                "device 'cuda': the MPI library here is not CUDA-aware (MPIX_Query_cuda_support() is 0 "
                "and no cuda memory kind is offered); move the tensor to the CPU or use the NCCL backend"
            )
        if device_type not in ("cpu", "cuda"):
            return f"device {device_type!r}: the MPI backend moves tensors on 'cpu' (and 'cuda' if CUDA-aware)"
        if dtype not in _MOVABLE:
            names = ", ".join(str(d).removeprefix("torch.") for d in _MOVABLE)
            return f"dtype {dtype}: the MPI backend moves {names}"
        if op is None:
            return None
        try:
            op = ReduceOp(op)
        except ValueError:
            return f"op {op!r}: the MPI backend reduces with {', '.join(o.value for o in ReduceOp)}"
        if dtype == torch.bool and op not in (ReduceOp.MAX, ReduceOp.MIN):
            return (
                f"op {op.value} on dtype torch.bool: only 'max' (or) and 'min' (and) reduce bool tensors; "
                "convert the tensor to an integer dtype first"
            )
        if op == ReduceOp.AVG and not dtype.is_floating_point:
            return (
                f"op avg on dtype {dtype}: the average of integers is not an integer; "
                "reduce with sum and divide, or use a floating dtype"
            )
        return None

    # Collectives. Each builds the buffers, then runs the blocking or the nonblocking MPI call.

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        """Reduce ``tensor`` over all ranks, in place, on every rank."""
        comm = self._live("all_reduce")
        mpi_type, mpi_op = self._reduction(tensor, op)
        work = tensor.float() if tensor.dtype in _UPCAST else tensor
        finish = self._finisher(tensor, work, op)
        args = (self._MPI.IN_PLACE, [_flat(work), mpi_type], mpi_op)
        return self._run("all_reduce", comm.Allreduce, comm.Iallreduce, args, async_op, finish, (tensor, work))

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool) -> Work:
        """``out`` (``world_size * tensor.numel()`` elements) receives every rank's ``tensor`` in rank order."""
        comm = self._live("all_gather")
        byte = self._MPI.BYTE
        args = ([_flat(tensor, True), byte], [_flat(out, True), byte])
        return self._run("all_gather", comm.Allgather, comm.Iallgather, args, async_op, None, (out, tensor))

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        """Reduce ``tensor`` over all ranks; rank r receives chunk r (``out``, ``tensor.numel() / world_size`` elements)."""
        comm = self._live("reduce_scatter")
        mpi_type, mpi_op = self._reduction(tensor, op)
        if tensor.dtype in _UPCAST:
            send = tensor.float()
            received = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        else:
            send, received = tensor, out
        finish = self._finisher(out, received, op)
        args = ([_flat(send), mpi_type], [_flat(received), mpi_type], mpi_op)
        return self._run(
            "reduce_scatter", comm.Reduce_scatter_block, comm.Ireduce_scatter_block,
            args, async_op, finish, (out, tensor, send, received),
        )

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        """Every rank's ``tensor`` becomes rank ``src``'s, in place."""
        comm = self._live("broadcast")
        args = ([_flat(tensor, True), self._MPI.BYTE], src)
        return self._run("broadcast", comm.Bcast, comm.Ibcast, args, async_op, None, (tensor,))

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, async_op: bool) -> Work:
        """Rank ``dst``'s ``tensor`` becomes the reduction over all ranks; the others' are left unspecified."""
        comm = self._live("reduce")
        mpi_type, mpi_op = self._reduction(tensor, op)
        work = tensor.float() if tensor.dtype in _UPCAST else tensor
        if self.rank == dst:
            finish = self._finisher(tensor, work, op)
            args = (self._MPI.IN_PLACE, [_flat(work), mpi_type], mpi_op, dst)
        else:
            finish = None
            args = ([_flat(work), mpi_type], None, mpi_op, dst)
        return self._run("reduce", comm.Reduce, comm.Ireduce, args, async_op, finish, (tensor, work))

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool) -> Work:
        """Chunk j of rank i's ``tensor`` lands as chunk i of rank j's ``out`` (equal chunks along the flat order)."""
        comm = self._live("all_to_all")
        byte = self._MPI.BYTE
        args = ([_flat(tensor, True), byte], [_flat(out, True), byte])
        return self._run("all_to_all", comm.Alltoall, comm.Ialltoall, args, async_op, None, (out, tensor))

    def send(self, tensor: torch.Tensor, dst: int, tag: int, async_op: bool) -> Work:
        """Send ``tensor`` to rank ``dst`` with ``tag``."""
        comm = self._live("send")
        args = ([_flat(tensor, True), self._MPI.BYTE], dst, tag)
        return self._run("send", comm.Send, comm.Isend, args, async_op, None, (tensor,))

    def recv(self, tensor: torch.Tensor, src: int, tag: int, async_op: bool) -> Work:
        """Receive into ``tensor`` the message with ``tag`` from rank ``src``."""
        comm = self._live("recv")
        args = ([_flat(tensor, True), self._MPI.BYTE], src, tag)
        return self._run("recv", comm.Recv, comm.Irecv, args, async_op, None, (tensor,))

    def barrier(self) -> None:
        """Return when every rank has reached the barrier."""
        comm = self._live("barrier")
        with _mpi_errors("barrier"):
            comm.Barrier()

    def split(self, ranks: list[int]) -> MpiBackend | None:
        """A backend over ``ranks`` (numbered 0.. in sorted order), or None on a rank not among them.

        Collective over this backend (MPI_Comm_split). The new backend owns its communicator and
        frees it on :meth:`close`.
        """
        comm = self._live("split")
        members = sorted(ranks)
        member = self.rank in members
        # Several disjoint groups can form in one call, one per color: each group's lowest rank names it.
        color = members[0] if member else self._MPI.UNDEFINED
        key = members.index(self.rank) if member else 0
        with _mpi_errors("split"):
            sub = comm.Split(color, key)
        if not member:
            return None
        backend = MpiBackend(sub)
        backend._owns_comm = True
        return backend

    def close(self) -> None:
        """Make the backend unusable; frees the communicator if :meth:`split` created it.

        Freeing is collective in MPI: every member of a split backend closes it. ``MPI.COMM_WORLD``
        and communicators passed in by the caller are left to their owner.
        """
        comm, self._comm = self._comm, None
        if comm is not None and self._owns_comm:
            with _mpi_errors("close"):
                comm.Free()

    # Helpers.

    def _live(self, operation: str):
        if self._comm is None:
            raise CommError(f"MPI {operation} on a closed MpiBackend; make a new backend (or split again)")
        return self._comm

    def _reduction(self, tensor: torch.Tensor, op: ReduceOp):
        reason = self.unsupported(tensor.device.type, tensor.dtype, op)
        if reason is not None:
            raise ValueError(reason)
        op = ReduceOp(op)
        MPI = self._MPI
        type_name = "FLOAT" if tensor.dtype in _UPCAST else _REDUCE_TYPE_NAMES[tensor.dtype]
        return getattr(MPI, type_name), getattr(MPI, _MPI_OP_NAMES[op])

    def _finisher(self, target: torch.Tensor, result: torch.Tensor, op: ReduceOp) -> Callable[[], None] | None:
        """What completes a reduction once MPI is done: AVG's division and the cast back into ``target``."""
        average = ReduceOp(op) == ReduceOp.AVG
        if result is target and not average:
            return None

        def finish() -> None:
            if average:
                result.detach().div_(self.world_size)
            if result is not target:
                target.detach().copy_(result)

        return finish

    def _run(self, operation: str, blocking, nonblocking, args: tuple, async_op: bool,
             finish: Callable[[], None] | None, keep: tuple) -> Work:
        _ready(keep[0])
        with _mpi_errors(operation):
            if async_op:
                return _MpiWork(nonblocking(*args), operation, finish, (args, keep))
            blocking(*args)
        if finish is not None:
            finish()
        return DoneWork()


def rendezvous_from_mpi(comm: Any = None) -> tuple[str, int]:
    """An (address, port) on rank 0 where every rank of ``comm`` can meet, e.g. for torch.distributed.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``). Rank 0 picks ``127.0.0.1`` when every rank
    runs on its host, else its address on the route towards another host; the port is one the
    kernel reports free on rank 0 at the time of the call. Every rank returns the same pair.
    """
    MPI = _import_mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    with _mpi_errors("rendezvous_from_mpi"):
        hosts = comm.allgather(MPI.Get_processor_name())
        answer: tuple[Any, ...] | None = None
        if comm.Get_rank() == 0:
            try:
                answer = ("ok", *_pick_endpoint(hosts))
            except Exception as exc:  # whatever went wrong must reach the other ranks, or they wait forever
                answer = ("error", f"{type(exc).__name__}: {exc}")
        answer = comm.bcast(answer, root=0)
    if answer[0] == "error":
        raise CommError(f"rendezvous_from_mpi: rank 0 found no endpoint: {answer[1]}")
    return answer[1], answer[2]


def _pick_endpoint(hosts: list[str]) -> tuple[str, int]:
    """Rank 0's (address, free port), given every rank's processor name (rank 0's first)."""
    others = sorted({host for host in hosts if host != hosts[0]})
    address = "127.0.0.1" if not others else _address_towards(others[0], hosts[0])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return address, port


def _address_towards(peer: str, own: str) -> str:
    """This host's address on the route to ``peer`` (falls back to what the own host name resolves to)."""
    try:
        peer_address = socket.gethostbyname(peer)
        # A UDP "connection" sends nothing; it only makes the kernel choose the outgoing interface.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
            route.connect((peer_address, 9))
            address = route.getsockname()[0]
    except OSError:
        address = socket.gethostbyname(socket.gethostname())
    if address.startswith("127."):
        raise CommError(
            f"ranks run on hosts {own!r} and {peer!r}, but rank 0 only found its loopback address "
            f"{address}; set the rendezvous address explicitly (MASTER_ADDR)"
        )
    return address


# (rank, size, local rank) variables per launcher, most specific first. A missing local rank falls
# back to the rank: the launchers that omit it (MPICH's gforker) start every process on one host.
_LAUNCHER_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",)),  # Open MPI
    ("MV2_COMM_WORLD_RANK", ("MV2_COMM_WORLD_SIZE",), ("MV2_COMM_WORLD_LOCAL_RANK",)),  # MVAPICH
    ("PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID", "SLURM_LOCALID")),  # MPICH (Hydra), Intel MPI, srun pmi2
    ("PMIX_RANK", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), ("SLURM_LOCALID",)),  # srun --mpi=pmix
)


def mpi_world_from_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) as an MPI launcher put them in the environment, else None.

    Reads the variables of Open MPI, MVAPICH, MPICH's Hydra (``PMI_RANK``, ``PMI_SIZE``,
    ``MPI_LOCALRANKID``; Intel MPI sets the same) and PMIx under Slurm; does not import mpi4py.
    """
    for rank_name, size_names, local_names in _LAUNCHER_VARIABLES:
        if rank_name not in os.environ:
            continue
        size_name = next((name for name in size_names if name in os.environ), None)
        if size_name is None:
            continue
        rank, size = env_int(rank_name), env_int(size_name)
        local_name = next((name for name in local_names if name in os.environ), None)
        local = rank if local_name is None else env_int(local_name)
        if not 0 <= rank < size or local < 0:
            raise ValueError(
                f"{rank_name}={rank}, {size_name}={size}, local rank {local}: "
                "expected 0 <= rank < size and a local rank >= 0"
            )
        return rank, size, local
    return None


def env_int(name: str) -> int:
    """The integer in environment variable ``name`` (which must be set); a ValueError naming it otherwise."""
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer") from None
