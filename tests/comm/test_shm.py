"""``ninefold.comm.shm``: the shared-memory all-reduce between real processes, against the communicator's."""

from __future__ import annotations

import pytest

from ninefold.comm.spawn import spawn

pytestmark = pytest.mark.timeout(180)


def sums(shapes_and_dtypes):
    """Rank body: for each (shape, dtype name), rank-dependent values summed through shared memory and through
    the communicator; returns whether they agree, the shared-memory result's bytes hash, and what was refused."""
    import hashlib

    import torch

    import ninefold.comm as nc
    from ninefold.comm.shm import SharedMemoryAllReduce, available

    comm = nc.init(device="cpu", timeout_s=60)
    try:
        assert available(comm)
        shm = SharedMemoryAllReduce(comm, max_bytes=1 << 16)
        out = []
        for call in range(3):  # the same shapes again: the two slot sets alternate
            for shape, name in shapes_and_dtypes:
                dtype = getattr(torch, name)
                gen = torch.Generator().manual_seed(100 * comm.rank + call)
                x = torch.randn(shape, generator=gen).to(dtype)
                if len(shape) == 2:
                    x = x.t()  # non-contiguous input
                mine = shm.all_reduce(x.clone())
                want = comm.all_reduce(x.clone().float()).to(dtype)
                close = torch.allclose(mine.float(), want.float(), atol=1e-2 if name != "float32" else 1e-5)
                out.append((close, mine.shape == x.shape,
                            hashlib.sha1(mine.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()))
        refused = []
        for bad in (torch.ones(1 << 15), torch.ones(4, dtype=torch.int64)):
            try:
                shm.all_reduce(bad)
            except ValueError as e:
                refused.append(str(e)[:33])
        shm.close()
        shm.close()
        return out, refused
    finally:
        comm.close()


@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_rank_gets_the_same_bits_and_the_communicators_sum(nprocs):
    cases = [((7,), "float32"), ((64, 33), "float32"), ((5, 128), "bfloat16"), ((300,), "float16"), ((9, 3), "float64")]
    results = spawn(sums, nprocs, args=(cases,), timeout_s=150)
    for out, refused in results:
        assert all(close and same_shape for close, same_shape, _ in out), out
        assert refused == ["tensor: expected a CPU float32/fl"] * 2
    hashes = [[h for _, _, h in out] for out, _ in results]
    assert all(h == hashes[0] for h in hashes)  # identical bits on every rank


def setup_abandoned_by_a_peer():
    """Rank body: rank 1 leaves the set-up before its last collective (it raises there and closes its
    communicator); returns (rank, error text, whether rank 0's /dev/shm file still exists)."""
    import os

    import ninefold.comm as nc
    from ninefold.comm import shm

    comm = nc.init(device="cpu", timeout_s=20)
    paths = []
    create = shm._create
    shm._create = lambda size: (lambda made: (paths.append(made[1]), made)[1])(create(size))
    if comm.rank == 1:
        def leave(_obj):
            raise RuntimeError("rank 1 leaves during set-up")
        comm.all_gather_object = leave
    try:
        shm.SharedMemoryAllReduce(comm, max_bytes=1 << 12)
        error = None
    except Exception as e:  # rank 1: its own error; rank 0: the lost peer, from the communicator
        error = f"{type(e).__name__}: {e}"
    finally:
        comm.close()
    return comm.rank, error, [os.path.exists(p) for p in paths]


def test_a_failed_set_up_leaves_no_file_in_dev_shm():
    results = spawn(setup_abandoned_by_a_peer, 2, timeout_s=120)
    (rank0, error0, exists0), (rank1, error1, exists1) = results
    assert error1 == "RuntimeError: rank 1 leaves during set-up" and exists1 == []
    assert error0 is not None, "rank 0's set-up should fail when its peer leaves"
    assert exists0 == [False], f"rank 0 left its segment's file behind ({error0})"


def setup_stopped_by_sigterm(before):
    """Rank body: rank 0 starts the set-up and waits there for rank 1, which sends it SIGTERM instead (what a
    launcher does to the other ranks when one fails)."""
    import os
    import signal
    import time

    import ninefold.comm as nc
    from ninefold.comm.shm import SharedMemoryAllReduce

    comm = nc.init(device="cpu", timeout_s=60)
    pids = comm.all_gather_object(os.getpid())
    if comm.rank == 0:
        SharedMemoryAllReduce(comm, max_bytes=1 << 12)
        return "set up"
    time.sleep(2.0)  # rank 0 has made its segment and waits for this rank to map it
    os.kill(pids[0], signal.SIGTERM)
    time.sleep(30)


def test_a_rank_stopped_during_set_up_leaves_no_file_in_dev_shm():
    import os

    from ninefold.comm.spawn import SpawnError

    before = sorted(n for n in os.listdir("/dev/shm") if n.startswith("ninefold-"))
    with pytest.raises(SpawnError, match="SIGTERM"):
        spawn(setup_stopped_by_sigterm, 2, args=(before,), timeout_s=90)
    left = [n for n in os.listdir("/dev/shm") if n.startswith("ninefold-") and n not in before]
    for name in left:  # (not to leave them to the next run)
        os.unlink(os.path.join("/dev/shm", name))
    assert left == []
