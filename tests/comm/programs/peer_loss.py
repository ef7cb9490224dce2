"""Rank 0 all-reduces while rank 1 is gone (MODE=exit) or late (MODE=late): rank 0 must get a CommError, not hang.

Prints ``RESULT <exception type> <seconds>`` on rank 0.
"""

import os
import sys
import time

import torch

import ninefold.comm as nc

comm = nc.init(device="cpu", timeout_s=float(os.environ.get("TIMEOUT_S", "3")))
comm.barrier()
if comm.rank == 1:
    if os.environ["MODE"] == "exit":
        os._exit(0)
    time.sleep(30)
    sys.exit(0)
start = time.monotonic()
try:
    comm.all_reduce(torch.ones(1024))
    print("RESULT none", flush=True)
except nc.CommError as e:
    print(f"RESULT CommError {time.monotonic() - start:.1f} {str(e)[:200]!r}", flush=True)
os._exit(0)
