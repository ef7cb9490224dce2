"""Operator implementations over the batch-1 GEMV (``ninefold.ops.triton.gemv_pdl``) and its
few-rows sibling (``ninefold.ops.triton.gemv_rows``, 2..32 rows).

- :func:`linear` (``triton_row`` of ``ops.linear``): ``x @ weight.T`` for 1..32 rows;
- :func:`add_rms_norm_linear` (``triton`` of ``ops.add_rms_norm_linear``): the residual add and
  RMSNorm in the GEMV's prologue;
- :func:`silu_and_mul_linear` (``triton`` of ``ops.silu_and_mul_linear``): SwiGLU in the prologue;
- :func:`linear_fp8` (``triton_pdl`` of ``ops.linear_fp8``): 1..16 rows of an ``Fp8Weight``, whose codes
  both GEMVs stream (as the two fused operators do for FP8 weights). FP8 calls run only where a launch
  table measured on Hopper lists them (``FP8_TABLE``, ``FP8_ROWS_TABLE``, or the table files' entries with
  ``"weight": "fp8"``, which ``python -m ninefold.bench.fp8_gemv`` writes), on compute capability 9.x;
  elsewhere the unfused pair runs, with ``linear_fp8``'s own few-rows GEMV.

Each covers 1..32 rows on CUDA in bf16/fp16 without bias, K a multiple of the tile (the ``supports_*``
functions name what they refuse); dispatch falls back to the vendor implementations otherwise.
Measured on the H200 (``python -m ninefold.bench.decode_chain``, 8B shapes, 32 layers, context 256,
CUDA graphs, run 2 at 16:21 UTC): the GEMV beats cuBLAS on every shape (q/k/v 12.9 vs 16.7 us, o 9.4
vs 13.1, down 29.3 vs 31.9; gate_up and lm_head by 2-5%), and the decode step through these
operators took 4.290 ms per token without PDL and 4.157 ms with it (85% of the copy-bandwidth
roofline), against 4.653 ms with cuBLAS and the separate norm/activation kernels. PDL is on where
Triton and the GPU support it (sm_90+) and no trimmed build is active (its binaries are plain launches);
``NINEFOLD_GEMV_PDL=0`` turns it off.
The 2..32-row path runs only for calls that ``ROWS_TABLE`` or the ``NINEFOLD_GEMV_ROWS_TABLE`` file lists
with a configuration (the others, and all of them under ``NINEFOLD_GEMV_ROWS=0``, go to cuBLAS and the
unfused pairs). The shipped table lists none: on the H200 the kernel lost to cuBLAS with its fused
prologues, and without them won on o, down and lm_head in isolation but not reproducibly in the engine
(``docs/perf/ops.md``, "GEMV for 2..32 rows").
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors without PDL (how the CPU tests reach them).
"""

from __future__ import annotations

import functools
import json
import os

import torch

from ninefold.ops.fp8 import Fp8Weight
from ninefold.ops.triton import gemv_pdl, gemv_rows, launch

# (N, K[, prologue]) -> (block_n, block_k, split_k, num_warps, num_stages, variant): the H200 sweep's
# picks (variant 0: register loop, 1: tl.dot loop, 2: register loop with two tiles in flight).
# Measured 2026-12-03 16:21 UTC by `python -m ninefold.bench.decode_chain` (Llama-3-8B shapes, PDL,
# graphs of 20 back-to-back calls cycling the 32 layers' weights): .notes/gpu10 run 2.
TABLE: dict[tuple, tuple] = {
    (6144, 4096): (16, 512, 1, 4, 2, 0),  # q/k/v: 12.9 us (cuBLAS 16.7)
    (4096, 4096): (16, 512, 1, 4, 2, 2),  # o: 9.4 us (cuBLAS 13.1)
    (28672, 4096): (16, 256, 1, 4, 2, 0),  # gate_up: 54.9 us (cuBLAS 56.0)
    (4096, 14336): (16, 512, 1, 4, 2, 2),  # down: 29.3 us (cuBLAS 31.9)
    (128256, 4096): (32, 256, 1, 4, 2, 0),  # lm_head: 238.1 us (cuBLAS 249.7)
    (6144, 4096, "add_rms_norm"): (16, 512, 1, 4, 2, 0),  # 13.7 us
    (28672, 4096, "add_rms_norm"): (16, 256, 1, 4, 2, 0),  # 56.5 us
    (4096, 14336, "silu_and_mul"): (16, 512, 1, 4, 2, 2),  # 29.3 us
    (128256, 4096, "add_rms_norm"): (32, 256, 1, 4, 2, 0),  # 240.9 us
}
# (N, K, prologue, "fp8") -> the same fields, for FP8 codes (``Fp8Weight``); calls it does not list are declined.
# Where the one-row GEMV beat what FP8 decode otherwise runs (the norm or gate's own kernel, then linear_fp8's
# triton_gemv), in graphs of back-to-back calls over 256 MB of weight copies: H100, 2026-12-07 13:25 UTC,
# `python -m ninefold.bench.fp8_gemv --rows 1,4` (docs/perf/data/fp8_gemv_h100.json). q/k/v (18.5 vs 18.2 us) and
# gate_up (50.9 vs 49.1) lost, and at 4 rows the few-rows GEMV lost on every layer, so FP8_ROWS_TABLE lists none.
# gate_up: the tl.dot loop once it multiplied float16 (``fp8_operand``): H100, 2026-12-07 16:50 UTC, the same bench
# (docs/perf/data/fp8_gemv_f16_dot_h100.json): 44.2 us against 48.5 for the unfused pair (50.6 with bfloat16 dots).
# q/k/v and gate_up from the wider sweep (split-K and 8 warps for the tl.dot loop): H100, 2026-12-07 23:17 UTC, the
# same bench (docs/perf/data/fp8_gemv_sweep_h100.json); FP8 batch-1 decode 255.6 -> 265.5 tok/s with these entries.
# The first layer's bare q/k/v takes the q/k/v entry (the bench writes it so).
FP8_TABLE: dict[tuple, tuple] = {
    (6144, 4096, "add_rms_norm", "fp8"): (64, 256, 2, 4, 3, 1),  # q/k/v: 13.7 us (18.2 before)
    (6144, 4096, "none", "fp8"): (64, 256, 2, 4, 3, 1),
    (4096, 4096, "none", "fp8"): (16, 512, 1, 4, 2, 0),  # o: 9.4 us (13.0 before)
    (28672, 4096, "add_rms_norm", "fp8"): (128, 256, 1, 8, 3, 1),  # gate_up: 43.6 us (48.4 before)
    (4096, 14336, "silu_and_mul", "fp8"): (16, 512, 1, 4, 2, 0),  # down: 33.1 us (39.8 before)
}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_DTYPES = (torch.bfloat16, torch.float16)
OVERRIDE: dict[tuple, tuple] = {}  # (N, K, prologue[, "fp8"]) -> config; benchmarks set it


def _weight_kind(fp8: bool) -> tuple:
    """The end of a launch-table key: ``("fp8",)`` for FP8 codes, nothing for weights of x's dtype."""
    return ("fp8",) if fp8 else ()


@functools.cache
def _file_table(path: str) -> dict:
    """``NINEFOLD_GEMV_TABLE``: a JSON list of ``{"n", "k", "prologue", "config"}`` (what
    ``python -m ninefold.bench.decode_chain`` writes as ``$OUT/gemv_table.json``), entries for FP8
    weights with ``"weight": "fp8"`` (``python -m ninefold.bench.fp8_gemv``)."""
    try:
        with open(path) as f:
            entries = json.load(f)
        table = {(int(e["n"]), int(e["k"]), str(e["prologue"])) + _weight_kind(e.get("weight") == "fp8"):
                 tuple(int(v) for v in e["config"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"NINEFOLD_GEMV_TABLE={path!r}: expected a JSON list of {{n, k, prologue, config}} "
                         f"entries with 6-integer configs ({error})") from None
    for key, cfg in table.items():
        if len(cfg) != 6:
            raise ValueError(f"NINEFOLD_GEMV_TABLE={path!r}: config of {key} must have 6 integers "
                             f"(block_n, block_k, split_k, num_warps, num_stages, dot), got {cfg}")
    return table


# (N, K, prologue, rows bucket) -> (block_n, block_k, split_k, num_warps, num_stages) of the 2..32-row GEMV,
# or () where cuBLAS and the unfused pair measured faster (the call is then declined, as for a shape not listed). Rows buckets: 2, 4, 8, 16,
# 32 (the row count rounded up to a power of two).
ROWS_TABLE: dict[tuple, tuple] = {}
ROWS_OVERRIDE: dict[tuple, tuple] = {}  # benchmarks set it
# FP8 weights (keys ending in "fp8"), as ROWS_TABLE; calls it does not list are declined (the unfused pair runs).
FP8_ROWS_TABLE: dict[tuple, tuple] = {}
FP8_MAX_ROWS = 16  # more rows: linear_fp8's scaled_mm (FP8 tensor cores)


def rows_bucket(rows: int) -> int:
    """The rows bucket of a call: ``rows`` rounded up to a power of two (2, 4, 8, 16 or 32)."""
    return 1 << max(rows - 1, 1).bit_length()


@functools.cache
def _rows_file_table(path: str) -> dict:
    """``NINEFOLD_GEMV_ROWS_TABLE``: a JSON list of ``{"n", "k", "prologue", "rows", "config"}`` with 5-integer
    configs or ``[]`` (what ``python -m ninefold.bench.gemv_rows`` writes as ``$OUT/gemv_rows_table.json``),
    entries for FP8 weights with ``"weight": "fp8"``."""
    try:
        with open(path) as f:
            entries = json.load(f)
        table = {(int(e["n"]), int(e["k"]), str(e["prologue"]), int(e["rows"])) + _weight_kind(e.get("weight") == "fp8"):
                 tuple(int(v) for v in e["config"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"NINEFOLD_GEMV_ROWS_TABLE={path!r}: expected a JSON list of {{n, k, prologue, rows, "
                         f"config}} entries ({error})") from None
    for key, cfg in table.items():
        if len(cfg) not in (0, 5):
            raise ValueError(f"NINEFOLD_GEMV_ROWS_TABLE={path!r}: config of {key} must have 5 integers "
                             f"(block_n, block_k, split_k, num_warps, num_stages) or none, got {cfg}")
    return table


def rows_config(n: int, k: int, prologue: str = "none", rows: int = 16, fp8: bool = False) -> tuple:
    """The launch configuration of the few-rows GEMV for ``rows`` rows of an ``[n, k]`` weight with
    ``prologue``: ``ROWS_OVERRIDE``, then the ``NINEFOLD_GEMV_ROWS_TABLE`` file, then ``ROWS_TABLE``
    (each by rows bucket). ``()`` (the call is declined: cuBLAS and the unfused pair run) where none
    has the call: the few-rows GEMV runs only where a measurement chose it. FP8 codes (``fp8``) look up
    keys ending in ``"fp8"`` and ``FP8_ROWS_TABLE``."""
    key = (n, k, prologue, rows_bucket(rows)) + _weight_kind(fp8)
    found = ROWS_OVERRIDE.get(key)
    path = os.environ.get("NINEFOLD_GEMV_ROWS_TABLE")
    if found is None and path:
        found = _rows_file_table(path).get(key)
    if found is None:
        found = (FP8_ROWS_TABLE if fp8 else ROWS_TABLE).get(key)
    return found if found is not None else ()


def rows_enabled() -> bool:
    """Whether calls of 2..32 rows may take the few-rows GEMV: yes unless ``NINEFOLD_GEMV_ROWS=0``. Read,
    like the table file, when dispatch first sees a call's signature (its choice is then remembered)."""
    return os.environ.get("NINEFOLD_GEMV_ROWS", "1") != "0"


def config(n: int, k: int, prologue: str = "none", fp8: bool = False) -> tuple | None:
    """The launch configuration for an ``[n, k]`` weight with ``prologue``: ``OVERRIDE``, then the
    ``NINEFOLD_GEMV_TABLE`` file, then ``TABLE``; else split-K over 2 for narrow outputs (fewer than 8192
    columns leave SMs idle) and one K pass otherwise. FP8 codes (``fp8``) look up keys ending in ``"fp8"``
    and ``FP8_TABLE``, with no default: ``None`` where none lists the call."""
    key = (n, k, prologue) + _weight_kind(fp8)
    found = OVERRIDE.get(key)
    path = os.environ.get("NINEFOLD_GEMV_TABLE")
    if found is None and path:
        found = _file_table(path).get(key)
    if found is None:
        found = FP8_TABLE.get(key) if fp8 else TABLE.get(key) or TABLE.get((n, k))
    if found is not None or fp8:
        return found
    block_k = 256 if k % 256 == 0 else 64
    split_k = 2 if n < 8192 and k % (2 * block_k) == 0 else 1
    return 16, block_k, split_k, 4, 2, 0


def _kernel_reason(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, k: int, prologue: str = "none") -> str | None:
    rows = _rows(x)
    if rows > gemv_rows.MAX_ROWS:
        return f"{rows} rows: at most {gemv_rows.MAX_ROWS}"
    if x.device.type in ("cuda", "meta"):  # (meta: a trimmed build recording the launches for a GPU)
        if x.dtype not in _DTYPES:
            return f"dtype {x.dtype}: bfloat16 or float16 only"
    elif not (_INTERPRETED and x.device.type == "cpu"):
        return f"device {x.device.type}: CUDA only (or the CPU under TRITON_INTERPRET=1)"
    fp8 = type(weight) is Fp8Weight
    if fp8:
        if rows > FP8_MAX_ROWS:
            return f"{rows} rows of an FP8 weight: at most {FP8_MAX_ROWS} (linear_fp8's scaled_mm runs more)"
        if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] != 9:
            return "the FP8 launch tables are measured on Hopper (compute capability 9.x)"
        weight = weight.codes
    if weight.stride(1) != 1 or not x.is_contiguous():
        return "weight rows and x must be contiguous"
    if rows > 1:
        if not rows_enabled():
            return f"{rows} rows: the few-rows GEMV is off (NINEFOLD_GEMV_ROWS=0)"
        found = rows_config(weight.shape[0], k, prologue, rows, fp8)
        if not found:
            return (f"{rows} rows of [{weight.shape[0]}, {k}] ({prologue}): no few-rows GEMV configuration measured "
                    f"faster than cuBLAS (ROWS_TABLE, NINEFOLD_GEMV_ROWS_TABLE)")
        _, block_k, split_k, *_ = found
        if k % (block_k * split_k):
            return f"K = {k} is not a multiple of {block_k * split_k}"
        return None
    if rows < 1:
        return "no rows"
    found = config(weight.shape[0], k, prologue, fp8)
    if found is None:
        return (f"one row of an FP8 [{weight.shape[0]}, {k}] ({prologue}): no launch configuration measured "
                "(FP8_TABLE, NINEFOLD_GEMV_TABLE)")
    _, block_k, split_k, *_, variant = found
    if k % (block_k * split_k):
        return f"K = {k} is not a multiple of {block_k * split_k}"
    if variant == 2 and k // split_k < 2 * block_k:
        return f"K = {k} is too short for two tiles of {block_k} in flight per split"
    return None


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """``None`` when :func:`linear` runs this call, else the reason it does not."""
    if bias is not None:
        return "no bias"
    return _kernel_reason(x, weight, weight.shape[1])


def pdl_enabled() -> bool:
    """Whether PDL is wanted: yes unless ``NINEFOLD_GEMV_PDL=0`` (read at every call, so at graph
    capture); it is used only where :func:`ninefold.ops.triton.gemv_pdl.pdl_available` says so."""
    return os.environ.get("NINEFOLD_GEMV_PDL", "1") != "0"


def use_pdl(device: torch.device) -> bool:
    """Whether the GEMVs launch with PDL on ``device``: where :func:`pdl_enabled` and ``launch.pdl_allowed`` (Triton
    and the GPU support it; under a trimmed build, one that holds PDL launches; while a build is recorded, as its
    recording says)."""
    return pdl_enabled() and launch.pdl_allowed(device)


def _launch(x, weight, prologue: str = "none", **kw) -> torch.Tensor:
    """One kernel for ``x`` of 1..32 rows (``[..., width]``, contiguous; 1..16 for an ``Fp8Weight``);
    returns ``[rows, N]`` or ``[N]``."""
    pdl = use_pdl(x.device)
    fp8 = type(weight) is Fp8Weight
    if fp8:
        weight, kw["scales"] = weight.codes, weight.scales
    rows = _rows(x)
    if rows > 1:
        bn, bk, sk, nw, ns = rows_config(weight.shape[0], weight.shape[1], prologue, rows, fp8)
        return gemv_rows.gemv_rows(x.reshape(rows, -1), weight, prologue=prologue, split_k=sk, pdl=pdl, block_n=bn,
                                   block_k=bk, num_warps=nw, num_stages=ns, **kw)
    bn, bk, sk, nw, ns, dot = config(weight.shape[0], weight.shape[1], prologue, fp8)
    return gemv_pdl.gemv_pdl(x.reshape(-1), weight, prologue=prologue, split_k=sk, pdl=pdl, block_n=bn,
                             block_k=bk, num_warps=nw, num_stages=ns, dot=dot == 1, depth=2 if dot == 2 else 1, **kw)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` for 1..32 rows ``x [..., K]`` (``supports`` must have said yes) -> ``[..., N]``."""
    if bias is not None:
        raise ValueError("gemv_pdl_ops.linear: bias is not supported (got a bias tensor); use ops.linear")
    return _launch(x, weight).reshape(*x.shape[:-1], weight.shape[0])


def supports_linear_fp8(x, weight, bias=None) -> str | None:
    """``None`` when :func:`linear_fp8` runs this call (1..16 rows), else the reason it does not."""
    if bias is not None:
        return "no bias"
    return _kernel_reason(x, weight, weight.shape[1])


def linear_fp8(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.linear_fp8`` for 1..16 rows ``x [..., K]`` (``supports_linear_fp8`` must have said yes)."""
    return _launch(x, weight).reshape(*x.shape[:-1], weight.shape[0])


def supports_add_rms_norm_linear(x, residual, norm_weight, weight, eps=1e-6, bias=None) -> str | None:
    """``None`` when :func:`add_rms_norm_linear` runs this call, else the reason it does not."""
    if not (residual.is_contiguous() and norm_weight.is_contiguous()):
        return "residual and norm_weight must be contiguous"
    if bias is not None:
        return "no bias"
    return _kernel_reason(x, weight, weight.shape[1], "add_rms_norm")


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                        eps: float = 1e-6, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.add_rms_norm_linear`` for 1..32 rows in one kernel: every program recomputes the rows'
    norms (the sum rounded to x's dtype first, as ``ops.add_rms_norm`` does); the first writes the sum."""
    total = torch.empty_like(x, memory_format=torch.contiguous_format)
    shape = (-1,) if _rows(x) == 1 else (_rows(x), x.shape[-1])
    y = _launch(x, weight, prologue="add_rms_norm", residual=residual.reshape(shape), norm_weight=norm_weight,
                eps=eps, residual_out=total.reshape(shape))
    return y.reshape(*x.shape[:-1], weight.shape[0]), total


def supports_silu_and_mul_linear(x, weight, bias=None) -> str | None:
    """``None`` when :func:`silu_and_mul_linear` runs this call, else the reason it does not."""
    if bias is not None:
        return "no bias"
    return _kernel_reason(x, weight, weight.shape[1], "silu_and_mul")


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.silu_and_mul_linear`` for 1..32 rows ``x [..., 2K]`` in one kernel (the gate in the prologue)."""
    return _launch(x, weight, prologue="silu_and_mul").reshape(*x.shape[:-1], weight.shape[0])


def register_all() -> None:
    """Register ``triton_row`` for ``linear``, ``triton`` for the two fused operators and ``triton_pdl`` for
    ``linear_fp8`` (CUDA, or the CPU in float32 under the interpreter, where they only run when pinned)."""
    from ninefold.ops.registry import register

    devices = ("cuda", "cpu") if _INTERPRETED else ("cuda",)
    dtypes = (torch.float32,) if _INTERPRETED else _DTYPES
    priority = {"cuda": 20, "cpu": -10}
    register("linear", "triton_row", devices=devices, dtypes=dtypes, supports=supports, priority=priority)(linear)
    register("add_rms_norm_linear", "triton", devices=devices, dtypes=dtypes, supports=supports_add_rms_norm_linear,
             priority=priority)(add_rms_norm_linear)
    register("silu_and_mul_linear", "triton", devices=devices, dtypes=dtypes, supports=supports_silu_and_mul_linear,
             priority=priority)(silu_and_mul_linear)
    # above linear_fp8's few-rows GEMV (triton_gemv, 20) for the one-row calls this takes
    register("linear_fp8", "triton_pdl", devices=devices, dtypes=dtypes, supports=supports_linear_fp8,
             priority={"cuda": 30, "cpu": -10})(linear_fp8)
