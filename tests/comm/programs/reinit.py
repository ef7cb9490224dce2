"""A rank of a job that meets, closes and meets again in the same processes, three times: init() after
close(), with rank 0 closing last so that the other ranks reach its old store first, the third time with
the job given explicitly (under ``ninefold launch``).

Prints ``[rank] MEETING <n> <seconds init and one all_reduce took>``; after each close(), no Gloo or TCPStore
thread may be left (an assertion).
"""

from __future__ import annotations

import os
import time

import torch
from collectives import transport_threads

import ninefold.comm as nc


def meet(n: int) -> nc.Communicator:
    backend = os.environ.get("COMM_BACKEND", "auto")
    if n < 2 or "RANK" not in os.environ:
        return nc.init(backend, device="cpu", timeout_s=20)
    env = os.environ
    return nc.init(backend, device="cpu", timeout_s=20, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                   init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}")


for n in range(3):
    start = time.monotonic()
    comm = meet(n)
    assert comm.all_reduce(torch.ones(2)).tolist() == [float(comm.world_size)] * 2
    print(f"[{comm.rank}] MEETING {n} {time.monotonic() - start:.2f}", flush=True)
    if comm.rank == 0:
        time.sleep(1.0)
    comm.close()
    left = transport_threads()
    assert not left, f"threads left after close(): {left}"
