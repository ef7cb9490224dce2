"""The contract between :class:`ninefold.comm.Communicator` and a transport.

A backend moves and reduces *checked* tensors: the communicator has already made them contiguous,
put them on the right device, checked shapes, dtypes, ranks and the reduction, and picked the
backend for the tensor's device. A backend therefore raises only for what it cannot know before
it talks to its peers (a peer gone, a timeout), as :class:`CommError`.

Every collective takes ``async_op``: False runs it to completion (on CUDA: enqueued on the current
stream, as NCCL does), True returns a :class:`Work` to wait on.
"""

from __future__ import annotations

import abc
import enum
from typing import Protocol

import torch


class CommError(RuntimeError):
    """A collective or point-to-point transfer failed at run time (peer lost, timeout, transport error)."""


class ReduceOp(str, enum.Enum):
    """The reductions every backend offers."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


class Work(Protocol):
    """A collective in flight (``async_op=True``)."""

    def wait(self) -> None:
        """Block until the operation is complete (on CUDA: until it is ordered before the current stream)."""

    def is_completed(self) -> bool:
        """Whether the operation has finished."""


class DoneWork:
    """A :class:`Work` for an operation that completed before it was returned."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class Backend(abc.ABC):
    """One transport over a fixed group of processes.

    ``rank`` and ``world_size`` are this backend's own (a backend made by :meth:`split` numbers its
    members from 0). Tensors handed to a backend are contiguous and on a device the backend said it
    serves; output tensors are preallocated by the caller.
    """

    name: str
    rank: int
    world_size: int
    max_tag: int = 2**31 - 1  # the largest message tag the transport takes

    @abc.abstractmethod
    def unsupported(self, device_type: str, dtype: torch.dtype, op: ReduceOp | None = None) -> str | None:
        """None if tensors of ``device_type``/``dtype`` (reduced with ``op``, if given) can travel here, else why not."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        """Reduce ``tensor`` over all ranks, in place, on every rank."""

    @abc.abstractmethod
    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool) -> Work:
        """``out`` (``world_size * tensor.numel()`` elements) receives every rank's ``tensor`` in rank order."""

    @abc.abstractmethod
    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        """Reduce ``tensor`` over all ranks; rank r receives chunk r (``out``, ``tensor.numel() / world_size`` elements)."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        """Every rank's ``tensor`` becomes rank ``src``'s, in place."""

    @abc.abstractmethod
    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, async_op: bool) -> Work:
        """Rank ``dst``'s ``tensor`` becomes the reduction over all ranks; the others' are left unspecified."""

    @abc.abstractmethod
    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool) -> Work:
        """Chunk j of rank i's ``tensor`` lands as chunk i of rank j's ``out`` (equal chunks along the flat order)."""

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, dst: int, tag: int, async_op: bool) -> Work:
        """Send ``tensor`` to rank ``dst``."""

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, src: int, tag: int, async_op: bool) -> Work:
        """Receive into ``tensor`` from rank ``src``."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return when every rank has reached the barrier."""

    @abc.abstractmethod
    def split(self, ranks: list[int]) -> Backend | None:
        """A backend over ``ranks`` (this backend's numbering, sorted), or None on a rank not among them.

        Collective: every rank of this backend calls it at the same point, each with the ranks of the
        group it joins (several disjoint groups can form in one call, as with ``MPI_Comm_split``: a
        rank passes its own group's members, which include it), or with a list without it to join none.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the transport's resources; the backend is unusable afterwards."""
