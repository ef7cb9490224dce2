"""Elementwise add, ``z = x + y`` with broadcasting.

Contiguous operands of one shape run as flat vectors cut into ``BLOCK`` chunks; anything else
(broadcast, strided views) runs on ``[rows, last dim]`` views cut into ``BLOCK_M x BLOCK_N`` tiles,
so no operand is copied.
"""

import torch

import ninefold.dsl as nd
from ninefold.dsl import Symbol, Tensor
from ninefold.ops.kernels._checks import check_same, check_tensor, rows

BLOCK = Symbol("BLOCK", meta=True, lower_bound=1024, upper_bound=8192)
BLOCK_M = Symbol("BLOCK_M", meta=True, lower_bound=1, upper_bound=16)
BLOCK_N = Symbol("BLOCK_N", meta=True, lower_bound=64, upper_bound=1024)


def arrangement_flat(x, y, z, BLOCK=BLOCK):
    return x.tile((BLOCK,)), y.tile((BLOCK,)), z.tile((BLOCK,))


def arrangement_rows(x, y, z, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N):
    tile = (BLOCK_M, BLOCK_N)
    return x.tile(tile), y.tile(tile), z.tile(tile)


def application(x, y, z):
    z = x + y  # noqa: F841


kernel_flat = nd.make(arrangement_flat, application, tuple(Tensor(1) for _ in range(3)))
kernel_rows = nd.make(arrangement_rows, application, tuple(Tensor(2) for _ in range(3)))


def add(x, y, **blocks):
    """Return ``x + y`` (broadcasting; one dtype and device). ``blocks`` fixes block sizes."""
    check_tensor("x", x)
    check_tensor("y", y)
    check_same(("x", "y"), (x, y))
    shape = x.shape
    if y.shape != shape:
        try:
            shape = torch.broadcast_shapes(x.shape, y.shape)
        except RuntimeError:
            raise ValueError(
                f"y: shape {tuple(y.shape)} does not broadcast with x of shape {tuple(x.shape)}"
            ) from None
    z = torch.empty(shape, dtype=x.dtype, device=x.device)
    if x.shape == shape == y.shape and x.is_contiguous() and y.is_contiguous():
        n = z.numel()
        kernel_flat(x.view(n), y.view(n), z.view(n), **blocks)
    else:
        kernel_rows(rows(x.expand(shape)), rows(y.expand(shape)), rows(z), **blocks)
    return z
