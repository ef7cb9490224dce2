"""4-bit weights: ``Int4Weight`` and ``linear_int4(x, weight, bias=None)``.

An ``Int4Weight`` is an ``[N, K]`` matrix stored as 4-bit codes ``q`` in ``[0, 15]`` with one scale
and one offset per group of ``group_size`` consecutive values of a row:
``w[n, k] = q[n, k] * scales[n, g] + offsets[n, g]`` with ``g = k // group_size``. GGUF's
Q4_0 (offset ``-8 d``), Q4_1 (offset ``m``) and Q4_K (per 32-value sub-block) are all of this form.

On CPUs the codes are kept in the layout of torch's int4 GEMM kernel
(``torch._weight_int4pack_mm_for_cpu``, which computes ``(q - 8) * s + z`` per group, so
``s = scale`` and ``z = offset + 8 scale``), rows padded to a multiple of 16 as it requires.
Elsewhere they stay as plain nibbles and the generic implementation dequantizes per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninefold.ops import spec
from ninefold.ops.dispatch import Operator
from ninefold.ops.registry import register

GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU kernel accepts
_ROW_MULTIPLE = 16  # the CPU kernel packs rows in tiles of 16


def _cpu_kernel_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


class Int4Weight:
    """A ``[N, K]`` weight as 4-bit codes with a scale and an offset per ``group_size`` values.

    Build it with ``Int4Weight(codes, scales, offsets, group_size)``: ``codes`` integer
    ``[N, K]`` with values in ``[0, 15]``, ``scales`` and ``offsets`` floating ``[N, K // group_size]``
    (``w = codes * scales + offsets`` per group). ``group_size`` is one of 32, 64, 128, 256 and
    divides ``K``. The tensors' device is the weight's device.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int):
        spec.tensor("Int4Weight", "codes", codes, ndim=2)
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise TypeError(f"Int4Weight: codes must be an integer tensor, got {spec.dtype_name(codes.dtype)}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
            raise ValueError(f"Int4Weight: group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        n, k = codes.shape
        if k % group_size or k == 0:
            raise ValueError(f"Int4Weight: codes has K = {k} columns, which must be a positive multiple of "
                             f"group_size {group_size}")
        for name, t in (("scales", scales), ("offsets", offsets)):
            spec.tensor("Int4Weight", name, t, ndim=2)
            spec.floating("Int4Weight", name, t)
            spec.shape("Int4Weight", name, t, (n, k // group_size), " (one per group of each row)")
            spec.same_device("Int4Weight", "codes", codes, **{name: t})
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
            raise ValueError(f"Int4Weight: codes must lie in [0, 15], got values from {int(codes.min())} "
                             f"to {int(codes.max())}")
        self.shape = (n, k)
        self.group_size = group_size
        self.device = codes.device
        scales, offsets = scales.float(), offsets.float()
        self.cpu_kernel = self.device.type == "cpu" and _cpu_kernel_available()
        if self.cpu_kernel:
            rows = -(-n // _ROW_MULTIPLE) * _ROW_MULTIPLE
            padded = torch.zeros((rows, k), dtype=torch.int32)
            padded[:n] = codes
            self.packed = torch._convert_weight_to_int4pack_for_cpu(padded, 1)
            sz = torch.zeros((k // group_size, rows, 2), dtype=torch.float32)
            sz[:, :n, 0] = scales.T
            sz[:, :n, 1] = (offsets + 8 * scales).T
        else:
            c = codes.to(torch.uint8)
            self.packed = c[:, 0::2] | (c[:, 1::2] << 4)  # low nibble: even column
            sz = torch.stack((scales, offsets + 8 * scales), dim=-1).transpose(0, 1)
        # torch's layout [K/G, N(padded), 2]: (scale, zero) with w = (q - 8) * scale + zero
        self.scales_and_zeros = sz.contiguous()
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {torch.float32: self.scales_and_zeros}

    def scales_and_zeros_as(self, dtype: torch.dtype) -> torch.Tensor:
        """``scales_and_zeros`` in ``dtype`` (the CPU kernel wants the activations' dtype); cached."""
        sz = self._by_dtype.get(dtype)
        if sz is None:
            sz = self._by_dtype[dtype] = self.scales_and_zeros.to(dtype)
        return sz

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes plus float32 scales and zeros (other dtypes' copies excluded)."""
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 4

    def codes(self) -> torch.Tensor:
        """The codes ``[N, K]`` as uint8 in ``[0, 15]``."""
        n, k = self.shape
        if not self.cpu_kernel:
            p = self.packed
            return torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(n, k)
        # The CPU layout is the kernel's own: read it back through the kernel with an identity input
        # (scale 1, zero 8 makes each output the code itself, exactly).
        rows = self.packed.shape[0]
        ones = torch.zeros((k // self.group_size, rows, 2), dtype=torch.float32)
        ones[..., 0] = 1
        ones[..., 1] = 8
        eye = torch.eye(k, dtype=torch.float32)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, ones)[:, :n].T.round().to(torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` matrix in ``dtype`` (computed in float32 from the float32 scales and zeros)."""
        n, k = self.shape
        g = self.group_size
        sz = self.scales_and_zeros[:, :n].transpose(0, 1)  # [N, K/G, 2]
        q = self.codes().to(device=sz.device, dtype=torch.float32).reshape(n, k // g, g)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k).to(dtype)

    def __repr__(self) -> str:
        return f"Int4Weight(shape={self.shape}, group_size={self.group_size}, device={self.device})"


def _linear_int4_key(x, weight, bias=None):
    spec.tensor("linear_int4", "x", x, min_ndim=1)
    spec.floating("linear_int4", "x", x)
    if not isinstance(weight, Int4Weight):
        raise TypeError(f"linear_int4: weight must be an ninefold.ops.Int4Weight, got {type(weight).__name__}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise spec.OpError(f"linear_int4: x's last dimension must be weight's K = {k}, got shape {tuple(x.shape)}")
    if x.device != weight.device:
        raise spec.OpError(f"linear_int4: weight is on {weight.device} but x is on {x.device}; "
                           "move them to one device")
    if bias is not None:
        spec.tensor("linear_int4", "bias", bias)
        spec.shape("linear_int4", "bias", bias, (n,), " (weight's N)")
        spec.same_device("linear_int4", "x", x, bias=bias)
        spec.same_dtype("linear_int4", "x", x, bias=bias)
    m = x.numel() // max(k, 1)
    return x.device, x.dtype, (spec.pow2(m), n, k), bias is not None


def linear_int4(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a 4-bit ``Int4Weight`` ``[N, K]``: x ``[..., K]`` -> ``[..., N]``.

    x is float16, bfloat16 or float32 (any layout); the result has x's dtype. bias ``[N]`` has
    x's dtype. Group scales and zeros are applied in x's dtype on CPUs (as torch's kernel does).
    """
    return _LINEAR_INT4.call(x, weight, bias)


_LINEAR_INT4 = Operator("linear_int4", linear_int4, _linear_int4_key)


def _cpu_packed(x, weight, bias):
    return None if weight.cpu_kernel else "the weight was not packed for torch's CPU int4 kernel"


@register("linear_int4", "vendor", devices=("cpu",), supports=_cpu_packed, priority={"cpu": 10})
def _linear_int4_cpu(x, weight, bias):
    k = weight.shape[1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch._weight_int4pack_mm_for_cpu(x2, weight.packed, weight.group_size, weight.scales_and_zeros_as(x.dtype))
    n = weight.shape[0]
    if out.shape[1] != n:
        out = out[:, :n]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


@register("linear_int4", "dequantize", devices=("cpu", "cuda", "mps", "xpu"))
def _linear_int4_dequantize(x, weight, bias):
    """Any device: dequantize to x's dtype, then a dense matmul (slow, for devices without a kernel)."""
    return F.linear(x, weight.dequantize(x.dtype), bias)
