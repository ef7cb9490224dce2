"""Where the ranks run, and which transport each kind of tensor takes from there.

Every rank describes itself (:func:`describe_rank`: host, device, GPU identity); the communicator
gathers those into a :class:`Topology`, and :meth:`Topology.choose` picks the transport for CUDA and
for CPU tensors from it:

- CUDA tensors take NCCL when every rank has its own GPU (NCCL refuses two ranks on one GPU);
  otherwise a CUDA-aware MPI; otherwise they are staged through host memory over the CPU transport.
- CPU tensors take MPI when the processes were started by an MPI launcher (its shared-memory and
  network transports are what the launcher set up), otherwise Gloo.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import torch

BACKEND_NAMES = ("nccl", "gloo", "mpi")


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """What one rank reports about itself."""

    rank: int
    host: str
    pid: int
    device_type: str  # "cuda" or "cpu"
    device_index: int | None
    gpu_uuid: str | None  # identifies the physical GPU across CUDA_VISIBLE_DEVICES renumbering
    gpu_name: str | None


@dataclasses.dataclass(frozen=True)
class Route:
    """The transport for one kind of tensor: ``backend`` directly, or ``backend`` over host copies (``staged``)."""

    backend: str
    staged: bool
    reason: str


def describe_rank(rank: int, device: torch.device) -> RankInfo:
    """This process's :class:`RankInfo` for ``device`` (a CUDA device of this process, or the CPU)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "")) or f"{socket.gethostname()}:{index}"
        return RankInfo(rank, socket.gethostname(), os.getpid(), "cuda", index, uuid, props.name)
    return RankInfo(rank, socket.gethostname(), os.getpid(), device.type, None, None, None)


@dataclasses.dataclass(frozen=True)
class Topology:
    """The ranks of a communicator, in rank order."""

    ranks: tuple[RankInfo, ...]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The distinct hosts, in order of their lowest rank."""
        return tuple(dict.fromkeys(r.host for r in self.ranks))

    def ranks_on(self, host: str) -> tuple[int, ...]:
        """The ranks running on ``host``."""
        return tuple(r.rank for r in self.ranks if r.host == host)

    def local_rank(self, rank: int) -> int:
        """``rank``'s position among the ranks of its host."""
        return self.ranks_on(self.ranks[rank].host).index(rank)

    @property
    def all_cuda(self) -> bool:
        return all(r.device_type == "cuda" for r in self.ranks)

    def shared_gpus(self) -> list[tuple[int, ...]]:
        """Groups of ranks that drive the same physical GPU (empty when every rank has its own)."""
        by_gpu: dict[str, list[int]] = {}
        for r in self.ranks:
            if r.gpu_uuid is not None:
                by_gpu.setdefault(r.gpu_uuid, []).append(r.rank)
        return [tuple(v) for v in by_gpu.values() if len(v) > 1]

    def choose(self, device_type: str, available: set[str], *, mpi_launched: bool = False,
               mpi_cuda_aware: bool = False) -> Route | None:
        """The transport for tensors of ``device_type`` given the ``available`` backends, or None if none can carry them."""
        if device_type == "cuda":
            return self._choose_cuda(available, mpi_cuda_aware, mpi_launched)
        if mpi_launched and "mpi" in available:
            return Route("mpi", False, "started by an MPI launcher")
        if "gloo" in available:
            return Route("gloo", False, "CPU tensors")
        if "mpi" in available:
            return Route("mpi", False, "CPU tensors; Gloo unavailable")
        return None

    def _choose_cuda(self, available: set[str], mpi_cuda_aware: bool, mpi_launched: bool) -> Route | None:
        shared = self.shared_gpus()
        if "nccl" in available and self.all_cuda and not shared:
            where = "one host" if len(self.hosts) == 1 else f"{len(self.hosts)} hosts"
            return Route("nccl", False, f"every rank has its own GPU ({where})")
        why = ("ranks " + ", ".join("/".join(map(str, g)) for g in shared) + " share a GPU") if shared else (
            "NCCL unavailable" if "nccl" not in available else "not every rank has a GPU")
        if "mpi" in available and mpi_cuda_aware:
            return Route("mpi", False, f"CUDA-aware MPI ({why})")
        cpu = self.choose("cpu", available, mpi_launched=mpi_launched)
        if cpu is None:
            return None
        return Route(cpu.backend, True, f"through host memory ({why})")

    def table(self) -> str:
        """A plain-text table of the ranks: host, pid, device."""
        lines = ["rank  host                  pid      device"]
        for r in self.ranks:
            dev = f"cuda:{r.device_index} {r.gpu_name}" if r.device_type == "cuda" else r.device_type
            lines.append(f"{r.rank:<5} {r.host[:21]:<21} {r.pid:<8} {dev}")
        return "\n".join(lines)
