"""Where the batched-decode kernels launch with programmatic dependent launch (PDL).

With PDL (Hopper and later) a kernel may become resident while the kernel before it still runs: it
calls ``gdc_launch_dependents`` early so the next PDL kernel can do the same, and ``gdc_wait``
before it reads anything the kernel before produced or writes anything at all. Every program waits
unconditionally, so a kernel's completion still implies its predecessors'.
"""

from __future__ import annotations

import os

import torch


def wanted(device: torch.device, switch: str) -> bool:
    """Whether a kernel family launches with PDL on ``device``: where the decode kernels do
    (:func:`ninefold.ops.triton.decode.pdl_wanted`: sm_90+, a Triton with the API, no trimmed build,
    ``NINEFOLD_GEMV_PDL``/``NINEFOLD_DECODE_PDL`` not 0) and the family's own ``switch`` variable is
    not ``0``. Read at every call, so at CUDA-graph capture."""
    from ninefold.ops.triton import decode

    return os.environ.get(switch, "1") != "0" and decode.pdl_wanted(device)
