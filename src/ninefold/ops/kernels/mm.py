"""Matrix products: ``mm``, ``bmm`` and ``addmm``, accumulated in float32.

Every program owns one ``BLOCK_M x BLOCK_N`` tile of the output and walks the matching row of
``BLOCK_M x BLOCK_K`` tiles of the left operand and column of ``BLOCK_K x BLOCK_N`` tiles of the
right one.
"""

import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor
from ninefold.ops.kernels._checks import check_same, check_tensor

BLOCK_M = Symbol("BLOCK_M", meta=True, lower_bound=64, upper_bound=256)
BLOCK_N = Symbol("BLOCK_N", meta=True, lower_bound=64, upper_bound=256)
BLOCK_K = Symbol("BLOCK_K", meta=True, lower_bound=32, upper_bound=64)


def arrangement(a, b, c, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K):
    c_tiles = c.tile((BLOCK_M, BLOCK_N))
    # One row of A-tiles per output tile: middle level (K tiles,), inner (BLOCK_M, BLOCK_K).
    a_rows = a.tile((BLOCK_M, BLOCK_K)).tile((1, -1)).expand((-1, c_tiles.shape[1]))
    a_rows.dtype = a_rows.dtype.squeeze(0)
    # One column of B-tiles per output tile: middle level (K tiles,), inner (BLOCK_K, BLOCK_N).
    b_cols = b.tile((BLOCK_K, BLOCK_N)).tile((-1, 1)).expand((c_tiles.shape[0], -1))
    b_cols.dtype = b_cols.dtype.squeeze(1)
    return a_rows, b_cols, c_tiles


def application(a, b, c):
    acc = nl.zeros(c.shape, dtype=nl.float32)
    for k in range(a.shape[0]):
        acc += nl.dot(a[k], b[k])
    c = acc  # noqa: F841


def arrangement_batched(a, b, c, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K):
    c_tiles = c.tile((1, BLOCK_M, BLOCK_N))
    c_tiles.dtype = c_tiles.dtype.squeeze(0)
    a_rows = a.tile((1, BLOCK_M, BLOCK_K)).tile((1, 1, -1)).expand((-1, -1, c_tiles.shape[2]))
    a_rows.dtype = a_rows.dtype.squeeze((0, 1))
    a_rows.dtype.dtype = a_rows.dtype.dtype.squeeze(0)
    b_cols = b.tile((1, BLOCK_K, BLOCK_N)).tile((1, -1, 1)).expand((-1, c_tiles.shape[1], -1))
    b_cols.dtype = b_cols.dtype.squeeze((0, 2))
    b_cols.dtype.dtype = b_cols.dtype.dtype.squeeze(0)
    return a_rows, b_cols, c_tiles


def arrangement_addmm(bias, a, b, beta, alpha, c, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K):
    a_rows, b_cols, c_tiles = arrangement(a, b, c, BLOCK_M, BLOCK_N, BLOCK_K)
    return bias.tile((BLOCK_M, BLOCK_N)), a_rows, b_cols, beta, alpha, c_tiles


def application_addmm(bias, a, b, beta, alpha, c):
    acc = nl.zeros(c.shape, dtype=nl.float32)
    for k in range(a.shape[0]):
        acc += nl.dot(a[k], b[k])
    bias_tile = bias
    c = beta * bias_tile.to(nl.float32) + alpha * acc  # noqa: F841


mm_kernel = nd.make(arrangement, application, tuple(Tensor(2) for _ in range(3)))
bmm_kernel = nd.make(arrangement_batched, application, tuple(Tensor(3) for _ in range(3)))
addmm_kernel = nd.make(
    arrangement_addmm,
    application_addmm,
    (Tensor(2), Tensor(2), Tensor(2), Tensor(0), Tensor(0), Tensor(2)),
)


def _check_operands(a, b, ndim):
    check_tensor("a", a, ndim)
    check_tensor("b", b, ndim)
    check_same(("a", "b"), (a, b))
    if a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"b: shape {tuple(b.shape)} does not multiply a of shape {tuple(a.shape)}")


def mm(a, b, **blocks):
    """Return ``a @ b`` for ``a [M, K]`` and ``b [K, N]`` in their dtype."""
    _check_operands(a, b, 2)
    c = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    mm_kernel(a, b, c, **blocks)
    return c


def bmm(a, b, **blocks):
    """Return ``a @ b`` for ``a [B, M, K]`` and ``b [B, K, N]``."""
    _check_operands(a, b, 3)
    c = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=a.dtype, device=a.device)
    bmm_kernel(a, b, c, **blocks)
    return c


def addmm(bias, a, b, beta=1.0, alpha=1.0, **blocks):
    """Return ``beta * bias + alpha * (a @ b)``; ``bias`` broadcasts to ``[M, N]``."""
    _check_operands(a, b, 2)
    check_tensor("bias", bias)
    check_same(("a", "bias"), (a, bias))
    shape = (a.shape[0], b.shape[1])
    try:
        bias = bias.expand(shape)
    except RuntimeError:
        raise ValueError(f"bias: shape {tuple(bias.shape)} does not broadcast to {shape}") from None
    c = torch.empty(shape, dtype=a.dtype, device=a.device)
    addmm_kernel(bias, a, b, float(beta), float(alpha), c, **blocks)
    return c
