"""In-kernel functions (``import ninefold.dsl.language as nl``).

Applications are compiled, not called: the triton backend prints ``nl.f`` as the matching Triton
function, and the cpu backend runs the application with these definitions, on torch tensors whose
*trailing* dimensions are the program grid (``BATCH.ndim`` of them). Every value in a cpu run keeps
those trailing dimensions (size 1 when it does not vary across programs), so tiles of different
ranks and per-program scalars broadcast as in Triton, ``axis`` arguments count tile dimensions and
subscripts leave the grid dimensions alone.

Indices given to a middle level (``x[k]``) must be in range, as loop variables over
``range(x.shape[0])`` are: masks guard the tiles' overhang, not out-of-range middle indices.
"""

from __future__ import annotations

import builtins
import threading

import torch

float16 = torch.float16
bfloat16 = torch.bfloat16
float32 = torch.float32
float64 = torch.float64
int8 = torch.int8
int16 = torch.int16
int32 = torch.int32
int64 = torch.int64
uint8 = torch.uint8
int1 = torch.bool

DTYPES = {
    "float16": float16,
    "bfloat16": bfloat16,
    "float32": float32,
    "float64": float64,
    "int8": int8,
    "int16": int16,
    "int32": int32,
    "int64": int64,
    "uint8": uint8,
    "int1": int1,
}

# Names of the functions below that the triton backend translates; see backends/triton_names.py.
FUNCTIONS = (
    "zeros full arange dot sum max min argmax argmin exp exp2 log log2 sqrt rsqrt sigmoid abs "
    "maximum minimum where erf tanh pow trans cdiv cos sin fma clamp cast"
).split()


class _Batch(threading.local):
    ndim = 0
    shape: tuple = ()


BATCH = _Batch()


def _axis(x, axis):
    ndim = x.ndim - BATCH.ndim
    if axis < -ndim or axis >= ndim:
        raise ValueError(f"axis={axis} is out of range for a {ndim}-dim tile")
    return axis % ndim


def _tile_dims(x):
    return tuple(range(x.ndim - BATCH.ndim))


def _batch_first(x):
    g = BATCH.ndim
    return x.movedim(tuple(range(x.ndim - g, x.ndim)), tuple(range(g))) if g else x


def _batch_last(x):
    g = BATCH.ndim
    return x.movedim(tuple(range(g)), tuple(range(x.ndim - g, x.ndim))) if g else x


def _as_tensor(x, like=None):
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x, dtype=like.dtype if isinstance(like, torch.Tensor) else None)


def _shape(shape):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return tuple(int(s) for s in shape)


def zeros(shape, dtype=float32):
    """A tile of zeros of ``shape`` (on cpu: one per program, so it can accumulate in place)."""
    return torch.zeros(_shape(shape) + tuple(BATCH.shape), dtype=dtype)


def full(shape, value, dtype=float32):
    """A tile of ``shape`` filled with ``value`` (on cpu: one per program)."""
    return torch.full(_shape(shape) + tuple(BATCH.shape), value, dtype=dtype)


def arange(start, end):
    """``start, start + 1, ..., end - 1`` as an int32 tile."""
    return torch.arange(int(start), int(end), dtype=torch.int32).reshape((-1,) + (1,) * BATCH.ndim)


def dot(input, other, acc=None, out_dtype=float32, **_):
    """Matrix product of two 2-D tiles, accumulated and returned in ``out_dtype`` for floats."""
    input, other = _batch_first(input), _batch_first(other)
    if input.dtype == torch.float64 or other.dtype == torch.float64:
        out = torch.matmul(input.to(torch.float64), other.to(torch.float64))
    elif input.is_floating_point():
        out = torch.matmul(input.to(out_dtype), other.to(out_dtype))
    else:
        out = torch.matmul(input.to(torch.int64), other.to(torch.int64)).to(torch.int32)
    out = _batch_last(out)
    return out if acc is None else acc + out


def _reduce(fn, x, axis, keep_dims):
    if axis is None:
        dims = _tile_dims(x)
        return fn(x, dims, keep_dims) if dims else x
    return fn(x, (_axis(x, axis),), keep_dims)


def sum(input, axis=None, keep_dims=False, dtype=None):  # noqa: A001
    """Sum over ``axis`` (all tile dims when None)."""
    x = input.to(dtype) if dtype is not None else input
    return _reduce(lambda t, d, k: torch.sum(t, d, keepdim=k), x, axis, keep_dims)


def max(input, axis=None, keep_dims=False, **_):  # noqa: A001
    """Maximum over ``axis`` (all tile dims when None)."""
    return _reduce(lambda t, d, k: torch.amax(t, d, keepdim=k), input, axis, keep_dims)


def min(input, axis=None, keep_dims=False, **_):  # noqa: A001
    """Minimum over ``axis`` (all tile dims when None)."""
    return _reduce(lambda t, d, k: torch.amin(t, d, keepdim=k), input, axis, keep_dims)


def argmax(input, axis, keep_dims=False, **_):
    """Index of the maximum along ``axis`` (int32)."""
    return torch.argmax(input, _axis(input, axis), keepdim=keep_dims).to(torch.int32)


def argmin(input, axis, keep_dims=False, **_):
    """Index of the minimum along ``axis`` (int32)."""
    return torch.argmin(input, _axis(input, axis), keepdim=keep_dims).to(torch.int32)


def _unary(fn):
    def apply(x, **_):
        if not isinstance(x, torch.Tensor):
            x = torch.tensor(x, dtype=torch.float32)
        if not x.is_floating_point():
            x = x.to(torch.float32)
        return fn(x)

    return apply


exp = _unary(torch.exp)
exp2 = _unary(torch.exp2)
log = _unary(torch.log)
log2 = _unary(torch.log2)
sqrt = _unary(torch.sqrt)
rsqrt = _unary(torch.rsqrt)
sigmoid = _unary(torch.sigmoid)
erf = _unary(torch.erf)
tanh = _unary(torch.tanh)
cos = _unary(torch.cos)
sin = _unary(torch.sin)


def abs(x):  # noqa: A001
    """Absolute value."""
    return torch.abs(x) if isinstance(x, torch.Tensor) else builtins.abs(x)


def maximum(x, y, **_):
    """Elementwise maximum."""
    return torch.maximum(_as_tensor(x, y), _as_tensor(y, x))


def minimum(x, y, **_):
    """Elementwise minimum."""
    return torch.minimum(_as_tensor(x, y), _as_tensor(y, x))


def clamp(x, min, max, **_):  # noqa: A002
    """Clamp into ``[min, max]``."""
    return torch.clamp(x, min, max)


def where(condition, x, y):
    """``x`` where ``condition`` else ``y``."""
    if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
        x = torch.tensor(x, dtype=torch.float32)
    return torch.where(condition, x, y)


def pow(x, y):  # noqa: A001
    """``x ** y`` elementwise."""
    return torch.pow(x, y)


def fma(x, y, z):
    """``x * y + z``."""
    return x * y + z


def trans(x, *dims):
    """Transpose the last two dims (or permute the tile dims by ``dims``)."""
    ndim = x.ndim - BATCH.ndim
    if not dims:
        return x.transpose(ndim - 2, ndim - 1) if ndim >= 2 else x
    dims = dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
    return x.permute(tuple(d % ndim for d in dims) + tuple(range(ndim, x.ndim)))


def cdiv(x, y):
    """Ceiling division; on tensors ``(x + y - 1) // y`` with Triton's ``//``, which truncates toward zero."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return torch.div(x + y - 1, y, rounding_mode="trunc")
    return (x + y - 1) // y


def cast(x, dtype):
    """Convert to ``dtype``."""
    return x.to(dtype)
