"""All-reduce of small CPU tensors through shared memory, for the ranks of one host.

Gloo takes about 0.6 ms for a 4 KiB all-reduce between two processes of one host (docs/perf/comm.md);
a tensor-parallel decode step makes two per layer. Here each rank copies its tensor into its own slot
of a shared segment, publishes a sequence number, waits until every rank has published, and sums the
slots in rank order: every rank computes the same bits, with no socket in the way. Two slot sets
alternate between calls, so a rank writing call n+2 never overwrites data a slower rank still reads
for call n (it cannot pass call n+1 before every rank has finished call n).

The publish-then-read protocol relies on stores becoming visible in program order (x86-64's memory
model); elsewhere :func:`available` says no and callers keep the communicator's all-reduce.
"""

from __future__ import annotations

import mmap
import os
import platform
import sys
import time
import uuid

import numpy as np
import torch

from ninefold.comm.backends.base import CommError

DEFAULT_MAX_BYTES = 4 << 20
_SHM_DIR = "/dev/shm"
_FLAG_BYTES = 64  # one cache line per rank's sequence number
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}
_DTYPES = (*_NUMPY, torch.bfloat16)


def available(comm) -> bool:
    """Whether ``comm``'s ranks can all-reduce through shared memory: more than one, all on this host, Linux x86-64."""
    hosts = {r.host for r in comm.topology.ranks}
    return (comm.world_size > 1 and len(hosts) == 1 and sys.platform.startswith("linux")
            and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(_SHM_DIR))


class SharedMemoryAllReduce:
    """Sums of CPU tensors of up to ``max_bytes`` over ``comm``'s ranks through one shared segment.

    Collective to create (every rank of ``comm``; a segment that cannot be allocated, e.g. a small
    ``/dev/shm``, is a CommError on every rank); ``close()`` releases it. Larger tensors, other devices and
    other operations are the caller's to send through ``comm``. A wait for the other ranks ends with a
    CommError after ``timeout_s``, or as soon as ``peers_gone()`` (called now and then while waiting)
    returns a description of ranks that are gone.
    """

    def __init__(self, comm, max_bytes: int = DEFAULT_MAX_BYTES, timeout_s: float = 600.0, peers_gone=None):
        if not available(comm):
            raise CommError("a shared-memory all-reduce needs two or more ranks, all on one Linux x86-64 host")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0 or max_bytes % 64:
            raise ValueError(f"max_bytes: expected a positive multiple of 64, got {max_bytes!r}")
        self.rank, self.world_size = comm.rank, comm.world_size
        self.max_bytes, self.timeout_s, self.peers_gone = max_bytes, timeout_s, peers_gone
        size = self.world_size * _FLAG_BYTES + 2 * self.world_size * max_bytes
        self._map = self._attach(comm, _create(size) if comm.rank == 0 else None, size)
        buf = memoryview(self._map)
        self._flags = np.ndarray((self.world_size, _FLAG_BYTES // 8), dtype=np.int64, buffer=buf)[:, 0]
        self._slots = np.ndarray((2, self.world_size, max_bytes), dtype=np.uint8, buffer=buf,
                                 offset=self.world_size * _FLAG_BYTES)
        self._calls = 0

    @staticmethod
    def _attach(comm, created, size: int) -> mmap.mmap:
        """Every rank maps the segment rank 0 ``created``; a rank that cannot is a CommError on every rank.
        Rank 0 keeps its descriptor (the segment's only name) open until every rank has tried."""
        fd = created[0] if created else None
        try:
            path, problem = comm.broadcast_object(created[1:] if created else None)
            if problem is not None:
                raise CommError(f"shared-memory all-reduce: {problem}")
            mine = mapped = None
            try:
                own = fd if fd is not None else os.open(path, os.O_RDWR)
                try:
                    mapped = mmap.mmap(own, size)
                finally:
                    if own != fd:
                        os.close(own)
            except OSError as error:
                mine = f"rank {comm.rank} cannot map {path}: {error.strerror or error}"
            try:
                problems = [p for p in comm.all_gather_object(mine) if p is not None]  # every rank has tried
            except BaseException:
                if mapped is not None:
                    mapped.close()
                raise
            if problems:
                if mapped is not None:
                    mapped.close()
                raise CommError(f"shared-memory all-reduce: {'; '.join(problems)}")
            return mapped
        finally:
            if fd is not None:
                os.close(fd)

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether ``all_reduce`` takes ``tensor``: a CPU float32/float64/float16/bfloat16 tensor of at most
        ``max_bytes``."""
        return (tensor.device.type == "cpu" and tensor.dtype in _DTYPES
                and tensor.numel() * tensor.element_size() <= self.max_bytes)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` becomes the sum over the ranks, in place (rank order, so the same bits everywhere)."""
        if not self.fits(tensor):
            raise ValueError(f"tensor: expected a CPU float32/float64/float16/bfloat16 tensor of at most "
                             f"{self.max_bytes} bytes, got "
                             f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        if self._flags is None:
            raise CommError("this shared-memory all-reduce is closed")
        self._calls += 1
        call, nbytes = self._calls, tensor.numel() * tensor.element_size()
        slots = self._slots[call % 2]
        flat = tensor.detach().contiguous().view(-1)
        slots[self.rank, :nbytes] = flat.view(torch.uint8).numpy()
        self._flags[self.rank] = call  # published after the data (stores are seen in order on x86-64)
        self._wait_for(call)
        parts = [slots[r, :nbytes] for r in range(self.world_size)]
        total = _sum(parts, tensor.dtype)
        out = tensor.detach()
        if out.is_contiguous() and tensor.dtype in _NUMPY:
            out.view(-1).numpy().view(np.uint8)[:] = total  # numpy, one thread: no OpenMP team spinning beside the other ranks
        else:
            out.copy_(torch.from_numpy(total).view(tensor.dtype).view(tensor.shape))
        return tensor

    def _wait_for(self, call: int) -> None:
        flags = self._flags
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while flags.min() < call:
            spins += 1
            os.sched_yield()  # the rank it waits for may need this core
            if spins % 4096 == 0:
                now = time.monotonic()
                late = [r for r in range(self.world_size) if flags[r] < call]
                gone = self.peers_gone() if self.peers_gone is not None else None
                if gone:
                    raise CommError(f"shared-memory all-reduce {call}: waiting for ranks {late}, but {gone}")
                if now > deadline:
                    raise CommError(f"shared-memory all-reduce {call}: ranks {late} did not arrive within "
                                    f"{self.timeout_s:g} s")

    def close(self) -> None:
        """Release this rank's mapping of the segment (idempotent)."""
        if self._flags is None:
            return
        self._flags = self._slots = None
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view of a slot: the mapping goes with the last reference
            pass


def _create(size: int) -> tuple[int | None, str | None, str | None]:
    """Rank 0: (descriptor, path, None) of a new segment of ``size`` bytes with its memory reserved now (a
    tmpfs too small for it is this error, not a SIGBUS at the first large call), or (None, None, why).

    The file's name goes at once: the other ranks open it through this process's descriptor
    (``/proc/<pid>/fd/<fd>``), so a rank stopped at any moment (a launcher's SIGTERM) leaves nothing in
    ``/dev/shm``; the memory is freed when the last rank unmaps it."""
    path = os.path.join(_SHM_DIR, f"ninefold-{uuid.uuid4().hex}")
    fd = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        os.posix_fallocate(fd, 0, size)
        return fd, f"/proc/{os.getpid()}/fd/{fd}", None
    except OSError as error:
        if fd is not None:
            os.close(fd)
        return None, None, f"cannot reserve {size} bytes in {_SHM_DIR}: {error.strerror or error}"


def _sum(parts: list[np.ndarray], dtype: torch.dtype) -> np.ndarray:
    """The rank-order sum of the byte slots ``parts`` holding ``dtype`` values, as an array of ``dtype``'s
    bytes (float16 and bfloat16 accumulate in float32). numpy, so the sum stays on this rank's thread."""
    if dtype is torch.bfloat16:  # numpy has no bfloat16: widen the bits (bfloat16 is float32's top half)
        wide = [(p.view(np.uint16).astype(np.uint32) << 16).view(np.float32) for p in parts]
        total = wide[0].copy()
        for w in wide[1:]:
            total += w
        return torch.from_numpy(total).to(torch.bfloat16).view(torch.uint8).numpy()
    kind = _NUMPY[dtype]
    if kind is np.float16:
        total = parts[0].view(kind).astype(np.float32)
        for p in parts[1:]:
            total += p.view(kind)
        return total.astype(np.float16).view(np.uint8)
    total = parts[0].view(kind).copy()
    for p in parts[1:]:
        total += p.view(kind)
    return total.view(np.uint8)
