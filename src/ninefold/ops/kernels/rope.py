"""Rotary position embedding, neox (halves) or interleaved (even/odd pairs) layout.

The arrangement cuts the rotated features of every head into its two halves with ``tile``: the
neox halves are ``[0, R/2)`` and ``[R/2, R)``; the interleaved halves are the even and the odd
features (a dilation of 2). Each program rotates a ``BLOCK_T x BLOCK_H`` block of tokens and heads.
"""

import functools

import torch

import ninefold.dsl as nd
from ninefold.dsl import Symbol, Tensor
from ninefold.ops.kernels._checks import FLOAT_DTYPES, check_same, check_tensor

HALF = Symbol("HALF", constexpr=True, upper_bound=256)
BLOCK_T = Symbol("BLOCK_T", meta=True, lower_bound=1, upper_bound=16)
BLOCK_H = Symbol("BLOCK_H", meta=True, lower_bound=4, upper_bound=16)


def arrangement(x, cos, sin, out, interleaved=False, HALF=HALF, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H):
    def halves(t):
        if interleaved:
            t = t.tile((BLOCK_T, BLOCK_H, HALF), strides=(-1, -1, 1), dilation=(1, 1, 2))
        else:
            t = t.tile((BLOCK_T, BLOCK_H, HALF))
        t = t.tile((1, 1, 2))  # both halves go to one program: t[0] and t[1]
        t.dtype = t.dtype.squeeze((0, 1))
        return t

    def per_head(table):
        arranged = table.tile((BLOCK_T, HALF)).unsqueeze(1).expand((-1, x_arranged.shape[1], -1))
        arranged.dtype = arranged.dtype.unsqueeze(1)  # (BLOCK_T, 1, HALF) broadcasts over heads
        return arranged

    x_arranged = halves(x)
    return x_arranged, per_head(cos), per_head(sin), halves(out)


def application(x, cos, sin, out):
    c = cos
    s = sin
    first = x[0]
    second = x[1]
    out[0] = first * c - second * s
    out[1] = second * c + first * s


_tensors = (Tensor(3), Tensor(2), Tensor(2), Tensor(3))
neox_kernel = nd.make(arrangement, application, _tensors)
interleaved_kernel = nd.make(
    functools.partial(arrangement, interleaved=True), application, tuple(Tensor(t.ndim) for t in _tensors)
)


def rotate(x, cos, sin, interleaved=False, **blocks):
    """Rotate the first ``2 * cos.shape[1]`` features of ``x [T, H, D]``; ``cos``/``sin`` are ``[T, R/2]``."""
    check_tensor("x", x, 3)
    check_tensor("cos", cos, 2)
    check_tensor("sin", sin, 2)
    half = cos.shape[1]
    rot = 2 * half
    if cos.shape != sin.shape or cos.shape[0] != x.shape[0] or rot > x.shape[2] or half == 0:
        raise ValueError(
            f"cos/sin: shapes {tuple(cos.shape)}/{tuple(sin.shape)} do not fit x of shape {tuple(x.shape)}"
        )
    if half > 256:
        raise ValueError(f"cos: rotary dims up to 512 are supported, got {rot}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rot < x.shape[2]:
        out[..., rot:] = x[..., rot:]
    kernel = interleaved_kernel if interleaved else neox_kernel
    kernel(x[..., :rot], cos, sin, out[..., :rot], HALF=half, **blocks)
    return out


def rope(q, k, positions, cos_sin_cache, is_neox=True, **blocks):
    """The ops contract: ``cos_sin_cache [max_pos, R]`` holds cos in its first R/2 columns."""
    check_tensor("q", q, 3)
    check_tensor("k", k, 3)
    check_tensor("positions", positions, 1, dtypes=(torch.int32, torch.int64))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, dtypes=FLOAT_DTYPES)
    check_same(("q", "k"), (q, k))
    if positions.shape[0] != q.shape[0] or k.shape[0] != q.shape[0]:
        raise ValueError(
            f"positions: {positions.shape[0]} positions for q/k of {q.shape[0]}/{k.shape[0]} tokens"
        )
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    table = cos_sin_cache.index_select(0, positions)
    half = cos_sin_cache.shape[1] // 2
    cos, sin = table[:, :half], table[:, half:]
    interleaved = not is_neox
    return rotate(q, cos, sin, interleaved, **blocks), rotate(k, cos, sin, interleaved, **blocks)
