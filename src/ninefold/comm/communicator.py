"""The user-facing communicator: one API for collectives and point-to-point transfers.

Each call checks its arguments (tensor, device, dtype, ranks, dimension, reduction), routes the
tensor to the transport chosen for its device (:meth:`Topology.choose`), and reshapes around the
transport's flat, contiguous view of the data. With ``check_peers`` every collective first compares
its signature (operation, shape, dtype, root) across the ranks, so a mismatch is an error naming the
ranks instead of a hang or garbage.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Callable
from typing import Any

import torch

from ninefold.comm.backends.base import Backend, CommError, DoneWork, ReduceOp, Work
from ninefold.comm.topology import Route, Topology

_OP_NAMES = {"sum": ReduceOp.SUM, "product": ReduceOp.PRODUCT, "prod": ReduceOp.PRODUCT, "min": ReduceOp.MIN,
             "max": ReduceOp.MAX, "avg": ReduceOp.AVG, "mean": ReduceOp.AVG}


def parse_op(op: str | ReduceOp) -> ReduceOp:
    """``op`` as a :class:`ReduceOp` (accepts its value or the aliases 'prod' and 'mean')."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.lower() in _OP_NAMES:
        return _OP_NAMES[op.lower()]
    raise ValueError(f"op: expected one of 'sum', 'product', 'min', 'max', 'avg' or a ReduceOp, got {op!r}")


_REFUSED = "<refused>"  # the signature a rank sends to check_peers when its own argument checks failed


def _collective(method):
    """With ``check_peers``, an argument error on one rank reaches every rank: the others raise a CommError
    naming it instead of waiting in the signature exchange for a rank that never comes (and then pairing
    with its next call)."""
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if not self.check_peers:
            return method(self, *args, **kwargs)
        self._agreed = False
        try:
            return method(self, *args, **kwargs)
        except (TypeError, ValueError) as e:
            if not self._agreed and not self._closed:
                self._compare(method.__name__, (_REFUSED, f"{type(e).__name__}: {e}"))
            raise
    return checked


class _Staged:
    """A Work whose result must be copied back to the caller's tensor when it completes."""

    def __init__(self, work: Work, finish: Callable[[], None]):
        self._work, self._finish, self._done = work, finish, False

    def wait(self) -> None:
        if not self._done:
            self._work.wait()
            self._finish()
            self._done = True

    def is_completed(self) -> bool:
        """Whether the operation has finished; True also means the caller's tensor holds the result."""
        if not self._done and self._work.is_completed():
            self.wait()
        return self._done


class Communicator:
    """A group of processes that exchange tensors; made by :func:`ninefold.comm.init` or :meth:`split`.

    Attributes: ``rank`` and ``world_size`` (this group's numbering), ``device`` (the device this
    rank's CUDA tensors must be on, or the CPU), ``topology``, and ``routes`` (the transport per
    device type, see :meth:`describe`).
    """

    def __init__(self, backends: dict[str, Backend], topology: Topology, device: torch.device,
                 routes: dict[str, Route], *, check_peers: bool = False, owns: tuple[Callable[[], None], ...] = ()):
        first = next(iter(backends.values()))
        self.rank, self.world_size = first.rank, first.world_size
        self.backends, self.topology, self.device, self.routes = backends, topology, device, routes
        self._max_tag = min(b.max_tag for b in backends.values())  # one bound whichever transport a tensor takes
        self.check_peers = check_peers
        self._owns = owns
        self._closed = False
        self._agreed = False  # whether the collective in progress has compared its arguments (check_peers)
        self._children: list[Communicator] = []  # made by split, closed with this one
        self._verdicts: dict[tuple, str | None] = {}

    # ---- routing and checks -------------------------------------------------------------------

    def backend_for(self, tensor: torch.Tensor) -> str:
        """The transport that carries ``tensor`` (its name; "via host" when staged through CPU memory)."""
        route = self._route(tensor, "tensor", None)
        return f"{route.backend} via host" if route.staged else route.backend

    def _route(self, tensor: Any, arg: str, op: ReduceOp | None) -> Route:
        if self._closed:
            raise CommError("this communicator was closed")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{arg}: expected a torch.Tensor, got {type(tensor).__name__}")
        kind = tensor.device.type
        if kind == "cuda" and tensor.device != self.device:
            raise ValueError(f"{arg}: this rank's CUDA tensors must be on {self.device}, got one on {tensor.device}")
        route = self.routes.get(kind)
        if route is None:
            raise ValueError(f"{arg}: no transport here carries {kind} tensors; "
                             f"this communicator carries {', '.join(sorted(self.routes)) or 'nothing'}")
        key = (kind, tensor.dtype, op)
        if key not in self._verdicts:  # a transport's answer never changes: ask once per kind of call
            self._verdicts[key] = self.backends[route.backend].unsupported("cpu" if route.staged else kind,
                                                                          tensor.dtype, op)
        reason = self._verdicts[key]
        if reason is not None:
            raise TypeError(f"{arg}: {reason}")
        return route

    def _peer(self, value: Any, arg: str, *, other_than_self: bool = False) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{arg}: expected an int rank in 0..{self.world_size - 1}, got {type(value).__name__}")
        if not 0 <= value < self.world_size:
            raise ValueError(f"{arg}: expected a rank in 0..{self.world_size - 1}, got {value}")
        if other_than_self and value == self.rank:
            raise ValueError(f"{arg}: expected another rank than this one ({self.rank}), got {value}")
        return value

    def _dim(self, tensor: torch.Tensor, dim: Any) -> int:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
        nd = max(tensor.dim(), 1)
        if not -nd <= dim < nd:
            raise ValueError(f"dim: expected a dimension in {-nd}..{nd - 1} of a {tensor.dim()}-d tensor, got {dim}")
        return dim % nd

    def _agree(self, what: str, tensor: torch.Tensor, *extra: Any) -> None:
        """With ``check_peers``: every rank must be calling the same collective on the same kind of tensor."""
        if not self.check_peers:
            return
        self._agreed = True
        self._compare(what, (what, tuple(tensor.shape), str(tensor.dtype), tensor.device.type, *extra))

    def _compare(self, what: str, mine: tuple) -> None:
        """Exchange signatures (or refusals, see :func:`_collective`); a CommError unless every rank sent the same."""
        theirs = self.all_gather_object(mine)
        refused = [(r, sig[1]) for r, sig in enumerate(theirs) if sig[0] == _REFUSED]
        if refused:
            if mine[0] == _REFUSED:
                return  # the caller raises its own error
            raise CommError(f"{what}: " + "; ".join(f"rank {r} refused its arguments ({why})" for r, why in refused))
        odd = [r for r, sig in enumerate(theirs) if sig != theirs[0]]
        if odd:
            lines = "; ".join(f"rank {r}: {_sig(sig)}" for r, sig in enumerate(theirs))
            raise CommError(f"{what}: the ranks disagree ({lines})")

    # ---- collectives --------------------------------------------------------------------------

    @_collective
    def all_reduce(self, tensor: torch.Tensor, op: str | ReduceOp = "sum", *, async_op: bool = False):
        """Reduce ``tensor`` over the ranks, in place; returns ``tensor`` (or a Work with ``async_op``)."""
        op = parse_op(op)
        route = self._route(tensor, "tensor", op)
        self._agree("all_reduce", tensor, op.value)
        return self._in_place(tensor, route, lambda b, t, a: b.all_reduce(t, op, a), async_op)

    @_collective
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False):
        """Every rank's ``tensor`` becomes rank ``src``'s, in place; returns ``tensor`` (or a Work)."""
        src = self._peer(src, "src")
        route = self._route(tensor, "tensor", None)
        self._agree("broadcast", tensor, src)
        return self._in_place(tensor, route, lambda b, t, a: b.broadcast(t, src, a), async_op)

    @_collective
    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str | ReduceOp = "sum", *, async_op: bool = False):
        """Rank ``dst``'s ``tensor`` becomes the reduction over the ranks; the others' keep their values."""
        op, dst = parse_op(op), self._peer(dst, "dst")
        route = self._route(tensor, "tensor", op)
        self._agree("reduce", tensor, dst, op.value)
        keep = tensor if self.rank == dst else tensor.clone()
        out = self._in_place(keep, route, lambda b, t, a: b.reduce(t, dst, op, a), async_op)
        if keep is tensor:
            return out
        return out if async_op else tensor

    @_collective
    def all_gather(self, tensor: torch.Tensor, dim: int = 0, *, out: torch.Tensor | None = None,
                   async_op: bool = False):
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order: a new tensor, or ``out`` (reused
        buffers spare the allocation); with ``async_op`` a Work whose ``result`` is it."""
        route = self._route(tensor, "tensor", None)
        dim = self._dim(tensor, dim)
        src = tensor.reshape(1) if tensor.dim() == 0 else tensor
        shape = (*src.shape[:dim], src.shape[dim] * self.world_size, *src.shape[dim + 1:])
        out = self._check_out(out, shape, tensor)
        self._agree("all_gather", tensor, dim)
        flat = self._stage_in(src.contiguous(), route)
        direct = out is not None and dim == 0 and out.is_contiguous() and not route.staged and not _overlaps(out, flat)
        blocks = out.view(self.world_size, *src.shape) if direct else torch.empty(
            (self.world_size, *src.shape), dtype=src.dtype, device=flat.device)
        work = self.backends[route.backend].all_gather(blocks, flat, async_op and not route.staged)

        def result() -> torch.Tensor:
            if direct:
                return out
            gathered = self._stage_out(blocks, tensor.device, route).movedim(0, dim).reshape(shape)
            return gathered if out is None else out.copy_(gathered)
        return self._finish(work, result, async_op)

    @_collective
    def reduce_scatter(self, tensor: torch.Tensor, op: str | ReduceOp = "sum", dim: int = 0, *,
                       out: torch.Tensor | None = None, async_op: bool = False):
        """Reduce ``tensor`` over the ranks and keep this rank's chunk along ``dim`` (chunk ``rank`` of
        ``world_size`` equal chunks; the size along ``dim`` must divide evenly), in a new tensor or ``out``."""
        op = parse_op(op)
        route = self._route(tensor, "tensor", op)
        dim = self._dim(tensor, dim)
        if tensor.dim() == 0 or tensor.shape[dim] % self.world_size:
            raise ValueError(f"tensor: reduce_scatter needs dimension {dim} divisible by the world size "
                             f"{self.world_size}, got shape {tuple(tensor.shape)}")
        shape = list(tensor.shape)
        shape[dim] //= self.world_size
        out = self._check_out(out, tuple(shape), tensor)
        self._agree("reduce_scatter", tensor, dim, op.value)
        front = self._stage_in(tensor.movedim(dim, 0).contiguous(), route)
        direct = out is not None and dim == 0 and out.is_contiguous() and not route.staged and not _overlaps(out, front)
        part = out if direct else torch.empty((front.shape[0] // self.world_size, *front.shape[1:]),
                                              dtype=front.dtype, device=front.device)
        work = self.backends[route.backend].reduce_scatter(part, front, op, async_op and not route.staged)
        return self._finish(work, lambda: self._deliver(part, out, dim, tensor.device, route, direct), async_op)

    @_collective
    def all_to_all(self, tensor: torch.Tensor, dim: int = 0, *, out: torch.Tensor | None = None,
                   async_op: bool = False):
        """Chunk j along ``dim`` goes to rank j; returns the chunks received, concatenated along ``dim`` in
        rank order (the size along ``dim`` must divide evenly by the world size), in a new tensor or ``out``."""
        route = self._route(tensor, "tensor", None)
        dim = self._dim(tensor, dim)
        if tensor.dim() == 0 or tensor.shape[dim] % self.world_size:
            raise ValueError(f"tensor: all_to_all needs dimension {dim} divisible by the world size "
                             f"{self.world_size}, got shape {tuple(tensor.shape)}")
        out = self._check_out(out, tuple(tensor.shape), tensor)
        self._agree("all_to_all", tensor, dim)
        front = self._stage_in(tensor.movedim(dim, 0).contiguous(), route)
        direct = out is not None and dim == 0 and out.is_contiguous() and not route.staged and not _overlaps(out, front)
        received = out if direct else torch.empty_like(front)
        work = self.backends[route.backend].all_to_all(received, front, async_op and not route.staged)
        return self._finish(work, lambda: self._deliver(received, out, dim, tensor.device, route, direct), async_op)

    def _check_out(self, out: Any, shape: tuple, like: torch.Tensor) -> torch.Tensor | None:
        if out is None:
            return None
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected None or a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
        if out.dtype != like.dtype or out.device != like.device:
            raise TypeError(f"out: expected {like.dtype} on {like.device} like tensor, got {out.dtype} on {out.device}")
        return out

    def _deliver(self, front: torch.Tensor, out: torch.Tensor | None, dim: int, device: torch.device,
                 route: Route, direct: bool) -> torch.Tensor:
        """The result of a dim-0 transport call, moved back to ``dim`` (and into ``out``, unless it is there)."""
        if direct:
            return out
        result = self._stage_out(front, device, route).movedim(0, dim)
        return result if out is None else out.copy_(result)

    def barrier(self) -> None:
        """Return when every rank has called ``barrier``."""
        self._open_cpu_backend().barrier()

    # ---- point to point -----------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = False):
        """Send ``tensor`` to rank ``dst`` (which calls :meth:`recv` with a tensor of the same shape and dtype)."""
        dst = self._peer(dst, "dst", other_than_self=True)
        tag = _tag(tag, self._max_tag)
        route = self._route(tensor, "tensor", None)
        data = self._stage_in(tensor.contiguous(), route)
        work = self.backends[route.backend].send(data, dst, tag, async_op and not route.staged)
        return work if async_op else None

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0, async_op: bool = False):
        """Receive into ``tensor`` from rank ``src``; returns ``tensor`` (or a Work with ``async_op``)."""
        src = self._peer(src, "src", other_than_self=True)
        tag = _tag(tag, self._max_tag)
        route = self._route(tensor, "tensor", None)
        return self._in_place(tensor, route, lambda b, t, a: b.recv(t, src, tag, a), async_op)

    # ---- Python objects -----------------------------------------------------------------------

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (pickled) on every rank."""
        src = self._peer(src, "src")
        backend = self._open_cpu_backend()
        data, why = _pickle(obj) if self.rank == src else (torch.empty(0, dtype=torch.uint8), None)
        size = torch.tensor([-1 if why else data.numel()], dtype=torch.int64)
        backend.broadcast(size, src, False)  # -1: rank src's object cannot be pickled, every rank raises
        if why is not None:
            raise _unpicklable(obj, why)
        if size.item() < 0:
            raise CommError(f"broadcast_object: rank {src}'s obj could not be pickled (see the error on that rank)")
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        backend.broadcast(data, src, False)
        return pickle.loads(data.numpy().tobytes())

    def send_object(self, obj: Any, dst: int, *, tag: int = 0) -> None:
        """Send ``obj`` (pickled) to rank ``dst``, which calls :meth:`recv_object`."""
        dst, tag = self._peer(dst, "dst", other_than_self=True), _tag(tag, self._max_tag)
        backend = self._open_cpu_backend()
        data, why = _pickle(obj)
        backend.send(torch.tensor([-1 if why else data.numel()], dtype=torch.int64), dst, tag, False)
        if why is not None:  # the receiver got -1 and raises too
            raise _unpicklable(obj, why)
        backend.send(data, dst, tag, False)

    def recv_object(self, src: int, *, tag: int = 0) -> Any:
        """The object rank ``src`` sent with :meth:`send_object`."""
        src, tag = self._peer(src, "src", other_than_self=True), _tag(tag, self._max_tag)
        backend = self._open_cpu_backend()
        size = torch.empty(1, dtype=torch.int64)
        backend.recv(size, src, tag, False)
        if size.item() < 0:
            raise CommError(f"recv_object: rank {src}'s obj could not be pickled (see the error on that rank)")
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        backend.recv(data, src, tag, False)
        return pickle.loads(data.numpy().tobytes())

    def _open_cpu_backend(self) -> Backend:
        if self._closed:
            raise CommError("this communicator was closed")
        return self.backends[self.routes["cpu"].backend]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (pickled), in rank order."""
        backend = self._open_cpu_backend()
        data, why = _pickle(obj)
        sizes = torch.empty(self.world_size, dtype=torch.int64)
        backend.all_gather(sizes, torch.tensor([-1 if why else data.numel()], dtype=torch.int64), False)
        if why is not None:
            raise _unpicklable(obj, why)
        if (sizes < 0).any():
            bad = [r for r in range(self.world_size) if sizes[r] < 0]
            raise CommError(f"all_gather_object: the obj of rank(s) {bad} could not be pickled "
                            "(see the error on those ranks)")
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        blocks = torch.empty((self.world_size, longest), dtype=torch.uint8)
        backend.all_gather(blocks, padded, False)
        return [pickle.loads(blocks[r, : int(sizes[r])].numpy().tobytes()) for r in range(self.world_size)]

    # ---- groups -------------------------------------------------------------------------------

    def split(self, color: int | None) -> Communicator | None:
        """A communicator per ``color`` (as ``MPI_Comm_split`` without a key): the ranks that pass the same
        color, numbered in rank order; None on a rank passing ``color=None``. Collective over this
        communicator."""
        valid = color is None or (isinstance(color, int) and not isinstance(color, bool))
        colors = self.all_gather_object(color if valid else type(color).__name__)  # a str: that rank's bad color
        bad = [f"{c} on rank {r}" for r, c in enumerate(colors) if isinstance(c, str)]
        if bad:
            raise TypeError(f"color: expected an int or None on every rank, got {', '.join(bad)}")
        members = [] if color is None else [r for r, c in enumerate(colors) if c == color]
        parts = {name: b.split(members) for name, b in self.backends.items()}
        if color is None:
            return None
        topology = Topology(tuple(dataclasses.replace(self.topology.ranks[r], rank=i) for i, r in enumerate(members)))
        child = Communicator({n: b for n, b in parts.items() if b is not None}, topology, self.device, self.routes,
                             check_peers=self.check_peers)
        self._children = [c for c in self._children if not c._closed] + [child]
        return child

    def describe(self) -> str:
        """The ranks and the transport each kind of tensor takes, as plain text."""
        routes = "\n".join(f"{kind} tensors: {r.backend}{' via host copies' if r.staged else ''} ({r.reason})"
                           for kind, r in sorted(self.routes.items()))
        return f"{self.topology.table()}\n{routes}"

    def close(self) -> None:
        """Release the transports, and those of the communicators split from this one (closed first); every
        communicator concerned is unusable afterwards. Safe to call twice.

        When this communicator started torch.distributed (:func:`ninefold.comm.init`), its process groups
        and their threads are gone when ``close`` returns, and ``init`` can meet the job again."""
        if self._closed:
            return
        self._closed = True
        for child in reversed(self._children):
            child.close()
        for backend in self.backends.values():
            backend.close()
        for release in self._owns:
            release()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        routes = ", ".join(f"{k}: {r.backend}{'+host' if r.staged else ''}" for k, r in sorted(self.routes.items()))
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, {routes})"

    # ---- plumbing -----------------------------------------------------------------------------

    def _stage_in(self, tensor: torch.Tensor, route: Route) -> torch.Tensor:
        return tensor.cpu() if route.staged else tensor

    @staticmethod
    def _stage_out(tensor: torch.Tensor, device: torch.device, route: Route) -> torch.Tensor:
        return tensor.to(device) if route.staged else tensor

    def _in_place(self, tensor: torch.Tensor, route: Route, call, async_op: bool):
        """Run ``call`` on a contiguous (and, when staged, host) copy of ``tensor`` and write the result back."""
        work_on = self._stage_in(tensor, route)
        if not work_on.is_contiguous():
            work_on = work_on.contiguous()
        work = call(self.backends[route.backend], work_on, async_op and not route.staged)

        def finish() -> None:
            if work_on is not tensor:
                tensor.copy_(work_on)
        if async_op:
            return _Staged(work, finish)
        work.wait()
        finish()
        return tensor

    @staticmethod
    def _finish(work: Work, result: Callable[[], torch.Tensor], async_op: bool):
        if not async_op:
            work.wait()
            return result()
        return _Result(work, result)


class _Result:
    """A Work whose ``result`` is the collective's output tensor, valid after :meth:`wait`."""

    def __init__(self, work: Work, make: Callable[[], torch.Tensor]):
        self._work, self._make, self._value = work, make, None

    def wait(self) -> torch.Tensor:
        if self._value is None:
            self._work.wait()
            self._value = self._make()
        return self._value

    @property
    def result(self) -> torch.Tensor:
        """The output; waits for it if needed."""
        return self.wait()

    def is_completed(self) -> bool:
        """Whether the operation has finished; True also means ``result`` is ready."""
        if self._value is None and self._work.is_completed():
            self.wait()
        return self._value is not None


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share memory (a transport must not write where it still reads)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _tag(tag: Any, upper: int) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= upper:
        raise ValueError(f"tag: expected an int in 0..{upper} (the transports' common bound), got {tag!r}")
    return tag


def _pickle(obj: Any) -> tuple[torch.Tensor, str | None]:
    """``obj`` pickled into bytes and None, or no bytes and why it cannot be pickled (the caller tells its
    peers before it raises). Returns no exception object: one kept in a frame would tie that frame, and the
    communicator in it, into a reference cycle (see :meth:`Communicator.close`)."""
    try:
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8), None
    except Exception as e:  # pickle raises PicklingError, TypeError, AttributeError...
        return torch.empty(0, dtype=torch.uint8), f"{type(e).__name__}: {e}"


def _unpicklable(obj: Any, why: str) -> TypeError:
    return TypeError(f"obj: expected a picklable object, got {type(obj).__name__} ({why})")


def _sig(sig: tuple) -> str:
    what, shape, dtype, device, *extra = sig
    more = f" {extra}" if extra else ""
    return f"{what} {list(shape)} {dtype.removeprefix('torch.')} on {device}{more}"


__all__ = ["Communicator", "CommError", "ReduceOp", "DoneWork", "parse_op"]
