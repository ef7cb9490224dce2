"""2-D convolution as an implicit GEMM: the arrangement builds the im2col matrix by index maps.

Windows of the padded input become rows of an ``[N*P*Q, C*R*S]`` matrix, the filter becomes
``[C*R*S, K]`` and the output ``[N*P*Q, K]`` (viewed through ``N, P, Q, K``); then the matmul
arrangement and application of ``mm`` do the rest. Nothing is copied.
"""

import torch

import ninefold.dsl as nd
from ninefold.dsl import Symbol, Tensor
from ninefold.ops.kernels import mm
from ninefold.ops.kernels._checks import check_same, check_tensor

PAD_H = Symbol("PAD_H", constexpr=True)
PAD_W = Symbol("PAD_W", constexpr=True)
STRIDE_H = Symbol("STRIDE_H", constexpr=True)
STRIDE_W = Symbol("STRIDE_W", constexpr=True)
# Convolutions have few output pixels (N*P*Q is 576 at NineToothed's paper shape), so smaller tiles
# than mm's keep all SMs busy.
BLOCK_M = Symbol("BLOCK_M", meta=True, lower_bound=32, upper_bound=128)
BLOCK_N = Symbol("BLOCK_N", meta=True, lower_bound=32, upper_bound=128)
BLOCK_K = Symbol("BLOCK_K", meta=True, lower_bound=64, upper_bound=64)


def arrangement(x, w, y, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K):
    _, c, r, s = w.shape
    padded = x.pad(((0, 0), (0, 0), (PAD_H, PAD_H), (PAD_W, PAD_W)))
    # Outer level (N, 1, P, Q): one window per output pixel; inner level (1, C, R, S).
    windows = padded.tile((1, c, r, s), strides=(-1, -1, STRIDE_H, STRIDE_W), floor_mode=True)
    windows = windows.squeeze(1)
    windows.dtype = windows.dtype.squeeze(0)
    columns = windows.ravel().flatten(end_dim=3).flatten(start_dim=1)
    filters = w.flatten(start_dim=1).permute((1, 0))
    pixels = y.permute((0, 2, 3, 1)).flatten(end_dim=3)
    return mm.arrangement(columns, filters, pixels, BLOCK_M, BLOCK_N, BLOCK_K)


kernel = nd.make(
    arrangement,
    mm.application,
    (Tensor(4), Tensor(4, shape_options={"constexpr": True}), Tensor(4)),
)


def _pair(name, value):
    pair = (value, value) if isinstance(value, int) else value
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(v, int) for v in pair):
        raise TypeError(f"{name}: expected an int or a pair of ints, got {value!r}")
    return pair


def conv2d(x, weight, stride=1, padding=0, **blocks):
    """Cross-correlation of ``x [N, C, H, W]`` with ``weight [K, C, R, S]`` (no bias, no groups)."""
    check_tensor("x", x, 4)
    check_tensor("weight", weight, 4)
    check_same(("x", "weight"), (x, weight))
    (sh, sw), (ph, pw) = _pair("stride", stride), _pair("padding", padding)
    if sh < 1 or sw < 1 or ph < 0 or pw < 0:
        raise ValueError(f"stride/padding: need stride >= 1 and padding >= 0, got {stride}, {padding}")
    n, c, h, w = x.shape
    k, c_w, r, s = weight.shape
    if c_w != c:
        raise ValueError(f"weight: {c_w} input channels, but x has {c}")
    p, q = (h + 2 * ph - r) // sh + 1, (w + 2 * pw - s) // sw + 1
    if p < 1 or q < 1:
        raise ValueError(f"weight: a {r}x{s} filter does not fit x of shape {tuple(x.shape)}")
    y = torch.empty((n, k, p, q), dtype=x.dtype, device=x.device)
    kernel(x, weight, y, PAD_H=ph, PAD_W=pw, STRIDE_H=sh, STRIDE_W=sw, **blocks)
    return y
