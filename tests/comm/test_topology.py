"""Transport choice from the topology (pure: the rank descriptions are built by hand)."""

from __future__ import annotations

import pytest
import torch

from ninefold.comm.topology import RankInfo, Topology, describe_rank


def gpu(rank: int, host: str = "a", index: int = 0, uuid: str | None = None) -> RankInfo:
    return RankInfo(rank, host, 100 + rank, "cuda", index, uuid or f"{host}-gpu{index}", "H200")


def cpu(rank: int, host: str = "a") -> RankInfo:
    return RankInfo(rank, host, 100 + rank, "cpu", None, None, None)


ALL = {"nccl", "gloo", "mpi"}


def test_cuda_tensors_take_nccl_when_every_rank_has_its_own_gpu():
    topo = Topology((gpu(0, index=0), gpu(1, index=1), gpu(2, "b", 0), gpu(3, "b", 1)))
    route = topo.choose("cuda", ALL)
    assert (route.backend, route.staged) == ("nccl", False)
    assert "2 hosts" in route.reason
    assert topo.hosts == ("a", "b") and topo.ranks_on("b") == (2, 3) and topo.local_rank(3) == 1


def test_ranks_sharing_a_gpu_are_staged_through_host_memory():
    topo = Topology((gpu(0, index=0), gpu(1, index=0)))
    assert topo.shared_gpus() == [(0, 1)]
    route = topo.choose("cuda", ALL)
    assert (route.backend, route.staged) == ("gloo", True)
    assert "ranks 0/1 share a GPU" in route.reason
    aware = topo.choose("cuda", ALL, mpi_cuda_aware=True)
    assert (aware.backend, aware.staged) == ("mpi", False)


def test_the_same_gpu_index_on_two_hosts_is_not_shared():
    topo = Topology((gpu(0, "a", 0), gpu(1, "b", 0)))
    assert topo.shared_gpus() == []
    assert topo.choose("cuda", ALL).backend == "nccl"


def test_a_rank_without_gpu_keeps_cuda_tensors_off_nccl():
    topo = Topology((gpu(0), cpu(1)))
    route = topo.choose("cuda", ALL)
    assert route.staged and "not every rank has a GPU" in route.reason


def test_cpu_tensors_take_mpi_only_under_an_mpi_launcher():
    topo = Topology((cpu(0), cpu(1)))
    assert topo.choose("cpu", ALL).backend == "gloo"
    assert topo.choose("cpu", ALL, mpi_launched=True).backend == "mpi"
    assert topo.choose("cpu", {"mpi"}).backend == "mpi"
    assert topo.choose("cpu", {"nccl"}) is None
    assert topo.choose("cuda", {"nccl"}) is None  # CPU-only ranks, and nothing to stage through


def test_without_nccl_cuda_tensors_say_why():
    topo = Topology((gpu(0, index=0), gpu(1, index=1)))
    route = topo.choose("cuda", {"gloo"})
    assert route.staged and "NCCL unavailable" in route.reason


def test_describe_rank_on_the_cpu_and_the_table():
    info = describe_rank(3, torch.device("cpu"))
    assert (info.rank, info.device_type, info.gpu_uuid) == (3, "cpu", None)
    table = Topology((info,)).table()
    assert table.splitlines()[1].startswith("3") and "cpu" in table


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_describe_rank_on_a_gpu_names_the_physical_device():
    info = describe_rank(0, torch.device("cuda", 0))
    assert info.device_type == "cuda" and info.device_index == 0 and info.gpu_uuid and info.gpu_name


def test_staged_cuda_tensors_take_the_cpu_transport_of_an_mpi_launch():
    topo = Topology((gpu(0, index=0), gpu(1, index=0)))  # one GPU shared: staged through host memory
    cpu_route = topo.choose("cpu", {"gloo", "mpi"}, mpi_launched=True)
    cuda_route = topo.choose("cuda", {"gloo", "mpi"}, mpi_launched=True)
    assert cuda_route.staged and cuda_route.backend == cpu_route.backend == "mpi"
