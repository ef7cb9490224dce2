"""``linear`` through cuBLASLt with a measured algorithm per shape (``linear`` implementation ``cublaslt``).

torch's ``F.linear`` runs the algorithm cuBLAS's heuristic ranks first. Between 160 and 256 rows
(the large decode batches of the engine) that choice leaves much of an H200 idle. This
implementation runs, for shapes ``ninefold.ops.cublaslt.tuning`` has measured, the fastest of the
algorithms cuBLASLt offers, and ``F.linear`` everywhere else (untuned shapes, a bias, layouts it does
not take), so it is never slower than the vendor path by more than a dictionary lookup.

Measured on the H200 (``python -m ninefold.bench.decode_gemm --impls vendor,cublaslt``): cuBLASLt offers 8
algorithms per Llama-3-8B decode shape; the fastest beats the default by 0-20% per shape (o_proj at
160-224 rows the most), within the measurement's own spread at most shapes. Offline throughput with
every decode size tuned was the same as with cuBLAS (docs/perf/llm.md, seventh session), so it
registers below cuBLAS: pin it (``NINEFOLD_OPS=linear=cublaslt``) or let a tuning table choose it.
``NINEFOLD_CUBLASLT_SEARCH=exhaustive`` also tries every tile, stage count and K split cuBLASLt accepts
(87-477 configurations per decode shape): on the H200 the winners were the same kernel family as the
heuristic's, o_proj at 208 rows 18.8 -> 16.0 us and down_proj 48.1 -> 43.6 us, qkv and gate_up within 1%
(docs/perf/llm.md, eighth session).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ninefold.ops.cublaslt import binding, tuning
from ninefold.ops.gemm_operands import plain_product, unsupported
from ninefold.ops.registry import register

DTYPES = (torch.float16, torch.bfloat16)


def supports(x, weight, bias=None) -> str | None:
    """``None`` when the cuBLASLt path can take these arguments, else why not."""
    return unsupported(x, weight, DTYPES)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with the tuned cuBLASLt algorithm for this shape, or ``F.linear``."""
    k = x.shape[-1]
    if not plain_product(x, weight, bias, DTYPES, ALIGNMENT):
        return F.linear(x, weight, bias)
    m, n = x.numel() // k, weight.shape[0]
    algo = tuning.choice(m, n, k, x.dtype, x.device) if _usable() else None
    if algo is None:
        return F.linear(x, weight, bias)
    out = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    binding.matmul(x.view(m, k), weight, out.view(m, n), algo)
    return out


ALIGNMENT = 256  # the heuristic's default assumption about operand addresses (cuBLASLt's MIN_ALIGNMENT_*)


@functools.cache
def _usable() -> bool:
    return binding.available()  # asked on the first call, not at import (no CUDA context before it is needed)


def register_cuda() -> None:
    """Register ``linear`` implementation ``cublaslt``, below cuBLAS: it runs where pinned
    (``NINEFOLD_OPS=linear=cublaslt``) or a tuning table picks it (see docs/perf/llm.md, seventh session)."""
    if torch.cuda.is_available():
        register("linear", "cublaslt", devices=("cuda",), dtypes=DTYPES, supports=supports,
                 priority={"cuda": -5})(linear)
