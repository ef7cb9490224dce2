"""A rank that starts a communicator, sums a tensor a few times over Gloo, and exits without close():
the exit must be clean (``ninefold.comm`` closes what is left open when the interpreter exits).

Prints ``[rank] SUM <value>``.
"""

from __future__ import annotations

import torch

import ninefold.comm as nc

communicator = nc.init("gloo", device="cpu", timeout_s=30)
tensor = torch.ones(1000)
for _ in range(20):
    communicator.all_reduce(tensor)
print(communicator.rank, "SUM", float(tensor[0]), flush=True)
