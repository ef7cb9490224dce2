"""2-D max pooling: the arrangement lists each window's elements in a row; a program reduces
``BLOCK`` windows. Padding reads ``-inf``; ``ceil_mode`` follows torch (extra bottom/right padding)."""

import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor
from ninefold.ops.kernels._checks import check_tensor

WINDOW_H = Symbol("WINDOW_H", constexpr=True, upper_bound=16)
WINDOW_W = Symbol("WINDOW_W", constexpr=True, upper_bound=16)
STRIDE_H = Symbol("STRIDE_H", constexpr=True)
STRIDE_W = Symbol("STRIDE_W", constexpr=True)
PAD_TOP = Symbol("PAD_TOP", constexpr=True)
PAD_BOTTOM = Symbol("PAD_BOTTOM", constexpr=True)
PAD_LEFT = Symbol("PAD_LEFT", constexpr=True)
PAD_RIGHT = Symbol("PAD_RIGHT", constexpr=True)
BLOCK = Symbol("BLOCK", meta=True, lower_bound=64, upper_bound=512)


def arrangement(x, y, BLOCK=BLOCK):
    padded = x.pad(((0, 0), (0, 0), (PAD_TOP, PAD_BOTTOM), (PAD_LEFT, PAD_RIGHT)))
    windows = padded.tile((1, 1, WINDOW_H, WINDOW_W), strides=(-1, -1, STRIDE_H, STRIDE_W), floor_mode=True)
    # (N, C, P, Q) windows of (1, 1, WINDOW_H, WINDOW_W) -> [N*C*P*Q, WINDOW_H*WINDOW_W]
    windows = windows.ravel().flatten(end_dim=4).flatten(start_dim=1)
    windows = windows.tile((BLOCK, -1)).squeeze(1)
    return windows, y.flatten().tile((BLOCK,))


def application(x, y):
    y = nl.max(x, axis=1)  # noqa: F841


kernel = nd.make(arrangement, application, (Tensor(4, other=float("-inf")), Tensor(4)))


def _output_size(size, window, stride, pad, ceil_mode):
    span = size + 2 * pad - window
    out = (span + stride - 1) // stride + 1 if ceil_mode else span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1  # torch: the last window must start inside the input or the left padding
    return out


def max_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode=False, **blocks):
    """Max over ``kernel_size`` windows of ``x [N, C, H, W]`` (torch's semantics, no dilation)."""
    check_tensor("x", x, 4)
    pairs = []
    for name, value in (
        ("kernel_size", kernel_size),
        ("stride", stride or kernel_size),
        ("padding", padding),
    ):
        pair = (value, value) if isinstance(value, int) else value
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(v, int) for v in pair):
            raise TypeError(f"{name}: expected an int or a pair of ints, got {value!r}")
        pairs.append(pair)
    (kh, kw), (sh, sw), (ph, pw) = pairs
    if kh < 1 or kw < 1 or sh < 1 or sw < 1 or not (0 <= ph <= kh // 2 and 0 <= pw <= kw // 2):
        raise ValueError(
            f"kernel_size/stride/padding: need positive sizes and padding <= half the window, "
            f"got {kernel_size}, {stride}, {padding}"
        )
    if kh > 16 or kw > 16:
        raise ValueError(f"kernel_size: windows up to 16x16 are supported, got {kernel_size}")
    n, c, h, w = x.shape
    p = _output_size(h, kh, sh, ph, ceil_mode)
    q = _output_size(w, kw, sw, pw, ceil_mode)
    if p < 1 or q < 1:
        raise ValueError(f"kernel_size: a {kh}x{kw} window does not fit x of shape {tuple(x.shape)}")
    # Pad the bottom/right so that floor division yields exactly p x q windows.
    bottom = max(0, (p - 1) * sh + kh - h - ph)
    right = max(0, (q - 1) * sw + kw - w - pw)
    y = torch.empty((n, c, p, q), dtype=x.dtype, device=x.device)
    kernel(
        x,
        y,
        WINDOW_H=kh,
        WINDOW_W=kw,
        STRIDE_H=sh,
        STRIDE_W=sw,
        PAD_TOP=ph,
        PAD_BOTTOM=bottom,
        PAD_LEFT=pw,
        PAD_RIGHT=right,
        **blocks,
    )
    return y
