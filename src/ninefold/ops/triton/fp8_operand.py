"""The dot-product operand type for FP8 (e4m3) codes: float16, into which a pair of codes widens in one
conversion (``cvt.rn.f16x2.e4m3x2``; bfloat16 takes a second, scalar conversion per code, and at the rate a
decode GEMV or attention kernel streams codes those conversions, not memory, bound it). Every e4m3 code is exact
in float16."""

import triton
import triton.language as tl


@triton.jit
def saturate(x, limit: tl.constexpr):
    """``x`` clamped to ``[-limit, limit]``, NaN kept (PTX ``min``/``max`` ``.NaN``; plain ones would make it a
    bound)."""
    return tl.minimum(tl.maximum(x, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def dot_operand(x, codes_ptr):
    """``x`` as the other operand of a ``tl.dot`` with ``codes_ptr``'s elements: float16 where those are FP8 codes
    and ``x`` is bfloat16 (saturating at float16's +-65504; NaN stays NaN), else ``x`` unchanged (the elements widen
    to its type)."""
    if (codes_ptr.dtype.element_ty == tl.float8e4nv) & (x.dtype == tl.bfloat16):
        x = saturate(x.to(tl.float32), 65504.0).to(tl.float16)
    return x


@triton.jit
def padded_row(x, row0, x_ptr, codes_ptr):
    """The row ``x`` (float32 holding values of ``x_ptr``'s type) as the first of 16 rows (``row0``; the others
    zero) of a ``tl.dot`` operand against ``codes_ptr``'s elements, in the type ``dot_operand`` gives: the clamp
    on the row, before it is padded."""
    if (codes_ptr.dtype.element_ty == tl.float8e4nv) & (x_ptr.dtype.element_ty == tl.bfloat16):
        xp = tl.where(row0, saturate(x, 65504.0)[None, :], 0.0).to(tl.float16)
    else:
        xp = tl.where(row0, x[None, :], 0.0).to(x_ptr.dtype.element_ty)
    return xp
