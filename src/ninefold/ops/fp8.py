"""FP8 weights: ``Fp8Weight`` and ``linear_fp8(x, weight, bias=None)``.

An ``Fp8Weight`` is an ``[N, K]`` matrix stored as ``float8_e4m3fn`` codes with one float32 scale per
row (``w[n, k] = codes[n, k] * scales[n]``), half the bytes of bfloat16: what vLLM's ``--quantization fp8``
makes of a bfloat16 checkpoint, with a scale per output channel rather than per tensor.

Implementations:

- ``scaled_mm`` (CUDA, compute capability 8.9 or later, bfloat16 x): x is quantized to FP8 per row
  (one float32 scale per token, a Triton kernel) and multiplied by ``torch._scaled_mm`` with both
  row-wise scales (cuBLASLt/CUTLASS FP8 tensor cores); float32 accumulation, bfloat16 out. Hopper's fast
  FP8 accumulation (``use_fast_accum``) is off: on an H100 it put 2% errors into sums of 14336 products.
- ``triton_pdl`` (Hopper, 1..16 rows without bias, where an FP8 launch table lists the call): the one-row and
  few-rows GEMVs of ``ninefold.ops.triton.gemv_pdl_ops`` streaming the codes, launched with PDL (those GEMVs
  also run ``ops.add_rms_norm_linear`` / ``ops.silu_and_mul_linear`` with an ``Fp8Weight``).
- ``triton_gemv`` (CUDA, compute capability 8.9 or later, 1..16 rows of bfloat16/float16 x): a Triton GEMV that streams the FP8 codes and
  widens them in registers; x keeps its precision (``ninefold.ops.triton.fp8_gemv``).
- ``dequantize`` (any device and dtype): ``F.linear(x, codes * scales)`` in x's dtype: x keeps its
  precision (weight-only FP8), at the cost of the dense weight made on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninefold.ops import spec
from ninefold.ops.dispatch import Operator
from ninefold.ops.quantized import _check_quantized_linear
from ninefold.ops.registry import register

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row keeps a usable scale
GEMV_MAX_ROWS = 16  # steps of at most this many rows run the weight-only GEMV where it applies


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of a 2-D tensor: ``float8_e4m3fn`` codes and one float32 scale per row
    (``amax / 448``), so that ``codes * scales`` is ``x`` to FP8's precision (3 mantissa bits)."""
    amax = x.abs().amax(dim=1, keepdim=True).float() if x.shape[1] else x.new_zeros(x.shape[0], 1, dtype=torch.float32)
    scales = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    codes = (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scales.reshape(-1)


class Fp8Weight:
    """A ``[N, K]`` weight as ``float8_e4m3fn`` codes and one float32 scale per row.

    ``Fp8Weight(codes, scales)``: codes ``[N, K]`` ``torch.float8_e4m3fn``, scales ``[N]`` float32 on the same
    device. ``Fp8Weight.quantize(weight)`` makes one from a floating matrix (per-row absolute maximum).
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        if not isinstance(codes, torch.Tensor) or codes.dtype != FP8 or codes.dim() != 2:
            got = (f"{codes.dtype} with shape {tuple(codes.shape)}" if isinstance(codes, torch.Tensor)
                   else type(codes).__name__)
            raise spec.OpError(f"Fp8Weight: codes must be a 2-D torch.float8_e4m3fn tensor [N, K], got {got}")
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.shape != codes.shape[:1]:
            got = (f"{scales.dtype} with shape {tuple(scales.shape)}" if isinstance(scales, torch.Tensor)
                   else type(scales).__name__)
            raise spec.OpError(f"Fp8Weight: scales must be float32 [{codes.shape[0]}] (one per row), got {got}")
        if scales.device != codes.device:
            raise spec.OpError(f"Fp8Weight: scales are on {scales.device} but codes on {codes.device}")
        self.codes = codes.contiguous()
        self.scales = scales.contiguous()
        self.scales_row = self.scales.view(1, -1)  # the [1, N] form torch._scaled_mm takes

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Fp8Weight:
        """Quantize a floating ``[N, K]`` matrix per row (on its device)."""
        spec.tensor("Fp8Weight.quantize", "weight", weight, ndim=2)
        if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise spec.OpError(f"Fp8Weight.quantize: weight must be float64, float32, float16 or bfloat16, got "
                               f"{weight.dtype}")
        return cls(*quantize_rows(weight))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[N, K]`` matrix ``codes * scales`` in ``dtype``."""
        return (self.codes.float() * self.scales[:, None]).to(dtype)

    def __repr__(self) -> str:
        return f"Fp8Weight(shape={self.shape}, device={self.device})"


def _linear_fp8_key(x, weight, bias=None):
    n, k = _check_quantized_linear("linear_fp8", Fp8Weight, x, weight, bias)
    m = x.numel() // max(k, 1)
    return x.device, x.dtype, (spec.pow2(m), n, k), bias is not None


def linear_fp8(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for an ``Fp8Weight`` ``[N, K]``: x ``[..., K]`` -> ``[..., N]`` in x's dtype.

    On CUDA cards with FP8 tensor cores a bfloat16 x is quantized per row to FP8 as well (W8A8); elsewhere
    the weight is dequantized to x's dtype (weight-only). bias ``[N]`` has x's dtype.
    """
    return _LINEAR_FP8.call(x, weight, bias)


_LINEAR_FP8 = Operator("linear_fp8", linear_fp8, _linear_fp8_key)


def _scaled_mm_supported(x, weight, bias):
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 9):  # (meta: a build recording)
        return "FP8 tensor cores need compute capability 8.9 or later"
    n, k = weight.shape
    if n % 16 or k % 16:
        return f"torch._scaled_mm needs N and K divisible by 16, got N={n}, K={k}"
    return None


@register("linear_fp8", "scaled_mm", devices=("cuda",), dtypes=(torch.bfloat16,), supports=_scaled_mm_supported,
          priority={"cuda": 10})
def _linear_fp8_scaled_mm(x, weight, bias):
    from ninefold.ops.triton.fp8_quant import quantize_rows_fp8

    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        out = x2.new_zeros(0, n)
    else:
        codes, scales = quantize_rows_fp8(x2)
        out = torch._scaled_mm(codes, weight.codes.t(), scale_a=scales, scale_b=weight.scales_row,
                               out_dtype=torch.bfloat16, use_fast_accum=False)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


@register("linear_fp8", "dequantize", devices=("cpu", "cuda", "mps", "xpu"))
def _linear_fp8_dequantize(x, weight, bias):
    """Any device: dequantize to x's dtype, then a dense matmul."""
    return F.linear(x, weight.dequantize(x.dtype), bias)
