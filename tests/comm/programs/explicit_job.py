"""A rank of a job given to init() explicitly (argv: rank world_size port), with no launcher variables.

Prints ``RESULT <rank> <sum over ranks of rank + 1>``.
"""

import sys

import torch

import ninefold.comm as nc

rank, world, port = (int(a) for a in sys.argv[1:4])
with nc.init(device="cpu", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=60) as comm:
    total = comm.all_reduce(torch.tensor([rank + 1.0]))
    print(f"RESULT {comm.rank} {int(total.item())}", flush=True)
