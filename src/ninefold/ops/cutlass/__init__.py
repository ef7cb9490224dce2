"""``linear`` through CUTLASS's Hopper GEMMs with a measured configuration per shape (implementation ``cutlass``).

Between 64 and 256 rows (the large decode batches) cuBLAS gives some Llama-3.1-8B layers fewer
output tiles than the H200 has SMs (docs/perf/llm.md). ``ninefold.ops.cutlass`` compiles CUTLASS 3's
warp-specialized TMA kernels with stream-K and split-K schedulers and with the operands swapped
(``build.py``; ``python -m ninefold.ops.cutlass.build``, once, no GPU needed) and runs, for shapes
``tuning`` has measured, the fastest of them, and ``F.linear`` everywhere else (untuned shapes, other
dtypes, a bias, devices other than sm_90). Without a built library it runs ``F.linear``. It registers
below cuBLAS: pin it (``NINEFOLD_OPS=linear=cutlass``) or let a tuning table choose it.

With ``NINEFOLD_CUTLASS_PDL=1``, and where the batched-decode kernels launch with PDL
(:func:`ninefold.ops.triton.pdl.wanted`), these GEMMs launch with PDL too: their set-up may overlap the kernel
before them and the kernel after them may launch during their epilogue. Off by default: in the engine it made
offline throughput 1.5-2.1% slower on an H100 while the row and attention kernels around it also launch with
PDL, and no faster with either of those off (docs/perf/ops.md, "CUTLASS GEMMs with PDL").
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F

from ninefold.ops.gemm_operands import plain_product, unsupported
from ninefold.ops.registry import register

DTYPES = (torch.bfloat16,)
ALIGNMENT = 16  # TMA needs 16-byte aligned operand addresses


def supports(x, weight, bias=None) -> str | None:
    """``None`` when the CUTLASS path can take these arguments, else why not."""
    return unsupported(x, weight, DTYPES)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with the tuned CUTLASS configuration for this shape, or ``F.linear``."""
    from ninefold.ops.cutlass import binding, tuning

    k = x.shape[-1]
    if not plain_product(x, weight, bias, DTYPES, ALIGNMENT) or k % 8 or weight.shape[0] % 8 or not _usable(x.device):
        return F.linear(x, weight, bias)
    m, n = x.numel() // k, weight.shape[0]
    picked = tuning.choice(m, n, k, x.device)
    if picked is None:
        return F.linear(x, weight, bias)
    out = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    binding.matmul(x.view(m, k), weight, out.view(m, n), *picked, pdl=_pdl(x.device))
    return out


def _pdl(device: torch.device) -> bool:
    """Whether to launch with PDL on ``device``: ``NINEFOLD_CUTLASS_PDL=1`` and PDL available there (read at every
    call, so at CUDA-graph capture)."""
    if os.environ.get("NINEFOLD_CUTLASS_PDL", "0") != "1":
        return False
    try:
        from ninefold.ops.triton import pdl
    except ImportError:  # no Triton: none of the kernels around this one launch with PDL either
        return False
    return pdl.wanted(device, "NINEFOLD_CUTLASS_PDL")


@functools.cache
def _usable(device: torch.device) -> bool:
    """Whether the library is built and its CUDA runtime works on ``device`` (an sm_90 GPU); asked once per device,
    with a warning saying why not where the library exists but cannot run (say, a driver older than its CUDA)."""
    from ninefold.ops.cutlass import binding

    if torch.cuda.get_device_capability(device)[0] != 9 or binding.unavailable() is not None:
        return False
    try:
        binding.workspace_bytes(0, 64, 64, 64, device=device.index if device.index is not None else None)
    except binding.CutlassError as error:
        warnings.warn(f"ninefold.ops.cutlass: the library cannot run on {device} ({error}); linear uses F.linear",
                      stacklevel=3)
        return False
    return True


def register_cuda() -> None:
    """Register ``linear`` implementation ``cutlass`` below cuBLAS (pinned with ``NINEFOLD_OPS=linear=cutlass``)."""
    if torch.cuda.is_available():
        register("linear", "cutlass", devices=("cuda",), dtypes=DTYPES, supports=supports,
                 priority={"cuda": -6})(linear)
