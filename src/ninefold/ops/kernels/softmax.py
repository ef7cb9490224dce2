"""Row softmax: one program per row, the whole row in one tile, float32 arithmetic."""

import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor
from ninefold.ops.kernels._checks import check_tensor, rows

ROW = Symbol("ROW", constexpr=True)


def arrangement(x, y, ROW=ROW):
    return x.tile((1, ROW)), y.tile((1, ROW))


def application(x, y):
    v = x
    v = v.to(nl.float32)
    e = nl.exp(v - nl.max(v))
    y = e / nl.sum(e)  # noqa: F841


kernel = nd.make(arrangement, application, (Tensor(2, other=float("-inf")), Tensor(2)))


def softmax(x, dim=-1):
    """Softmax of ``x`` along ``dim`` in x's dtype."""
    check_tensor("x", x)
    if x.ndim == 0:
        raise ValueError("x: softmax needs at least one dimension, got a scalar")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim: {dim} is out of range for a tensor of {x.ndim} dimensions")
    moved = x.movedim(dim, -1)
    y = torch.empty(moved.shape, dtype=x.dtype, device=x.device)
    kernel(rows(moved), rows(y), ROW=moved.shape[-1])
    return y.movedim(-1, dim)
