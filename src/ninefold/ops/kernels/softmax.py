"""Row softmax in float32 arithmetic.

Rows up to ``WHOLE_ROW_LIMIT`` elements (any length on CPUs): one program per row, the whole row
in one tile. Longer rows on GPUs (a vocabulary, say): the row is cut into ``BLOCK``-element chunks,
a middle level that the program walks twice, first for the running maximum and sum (online
softmax), then to write.
"""

import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor
from ninefold.ops.kernels._checks import check_tensor, rows

WHOLE_ROW_LIMIT = 16384
ROW = Symbol("ROW", constexpr=True)
BLOCK = Symbol("BLOCK", meta=True, lower_bound=1024, upper_bound=8192)


def arrangement(x, y, ROW=ROW):
    return x.tile((1, ROW)), y.tile((1, ROW))


def application(x, y):
    v = x
    v = v.to(nl.float32)
    e = nl.exp(v - nl.max(v))
    y = e / nl.sum(e)  # noqa: F841


def arrangement_chunked(x, y, BLOCK=BLOCK):
    def chunks(t):  # programs (rows, 1); middle level (chunks,); inner (1, BLOCK)
        t = t.tile((1, BLOCK)).tile((1, -1))
        t.dtype = t.dtype.squeeze(0)
        return t

    return chunks(x), chunks(y)


def application_chunked(x, y):
    row_max = nl.full((), float("-inf"), dtype=nl.float32)
    total = nl.zeros((), dtype=nl.float32)
    for j in range(x.shape[0]):
        v = x[j]
        v = v.to(nl.float32)
        new_max = nl.maximum(row_max, nl.max(v))
        total = total * nl.exp(row_max - new_max) + nl.sum(nl.exp(v - new_max))
        row_max = new_max
    for j in range(x.shape[0]):
        v = x[j]
        v = v.to(nl.float32)
        y[j] = nl.exp(v - row_max) / total


kernel = nd.make(arrangement, application, (Tensor(2, other=float("-inf")), Tensor(2)))
chunked_kernel = nd.make(
    arrangement_chunked, application_chunked, (Tensor(2, other=float("-inf")), Tensor(2))
)


def softmax(x, dim=-1, **blocks):
    """Softmax of ``x`` along ``dim`` in x's dtype. Passing ``BLOCK`` forces the chunked kernel."""
    check_tensor("x", x)
    if x.ndim == 0:
        raise ValueError("x: softmax needs at least one dimension, got a scalar")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim: {dim} is out of range for a tensor of {x.ndim} dimensions")
    last = dim in (-1, x.ndim - 1)
    moved = x if last else x.movedim(dim, -1)
    y = torch.empty(moved.shape, dtype=x.dtype, device=x.device)
    # The cpu backend has no register file to overflow: whole rows of any length suit it.
    if "BLOCK" in blocks or (moved.shape[-1] > WHOLE_ROW_LIMIT and x.device.type != "cpu"):
        chunked_kernel(rows(moved), rows(y), **blocks)
    else:
        kernel(rows(moved), rows(y), ROW=moved.shape[-1], **blocks)
    return y if last else y.movedim(-1, dim)
