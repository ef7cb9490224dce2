"""Small hand kernels shared by the GPU self-check and the tests: one definition each.

Each ``*_kernel`` function makes a fresh kernel; the meta symbols' bounds are arguments, since
the self-check tunes over GPU-sized tiles and the tests over tiny ones. (The operator library's
kernels in ``ninefold.ops.kernels`` are standalone on purpose: the benchmark compiles those very
files with NineToothed too.)
"""

import functools

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl.symbol import Symbol, block_size
from ninefold.dsl.tensor import Tensor


def _add_arrangement(x, y, z, BLOCK):
    return x.tile((BLOCK,)), y.tile((BLOCK,)), z.tile((BLOCK,))


def _add_application(x, y, z):
    z = x + y  # noqa: F841


def add_kernel(lower_bound=None, upper_bound=None):
    """``z = x + y`` on 1-D tensors, ``BLOCK`` elements per program."""
    arrangement = functools.partial(_add_arrangement, BLOCK=block_size(lower_bound, upper_bound))
    return nd.make(arrangement, _add_application, (Tensor(1), Tensor(1), Tensor(1)), name="add")


def _row_sum_arrangement(x, out, ROWS, COLS):
    tiles = x.tile((ROWS, COLS)).tile((1, -1))  # programs: row blocks; middle: column tiles
    tiles.dtype = tiles.dtype.squeeze(0)
    return tiles.squeeze(1), out.tile((ROWS,))


def _row_sum_application(x, out):
    acc = nl.zeros((out.shape[0],), dtype=nl.float32)
    for j in range(x.shape[0]):
        acc += nl.sum(x[j].to(nl.float32), axis=1)
    out = acc  # noqa: F841


def row_sum_kernel(rows=(1, 8), cols=(4, 64)):
    """``out = x.sum(1)``: ``ROWS x COLS`` tiles, a loop over the column tiles of a row block."""
    arrangement = functools.partial(
        _row_sum_arrangement,
        ROWS=Symbol("ROWS", meta=True, lower_bound=rows[0], upper_bound=rows[1]),
        COLS=Symbol("COLS", meta=True, lower_bound=cols[0], upper_bound=cols[1]),
    )
    return nd.make(arrangement, _row_sum_application, (Tensor(2), Tensor(1)), name="row_sum")


def _mm_arrangement(a, b, c, BM, BN, BK):
    c_tiles = c.tile((BM, BN))
    a_tiles = a.tile((BM, BK)).tile((1, -1)).expand((-1, c_tiles.shape[1]))
    a_tiles.dtype = a_tiles.dtype.squeeze(0)
    b_tiles = b.tile((BK, BN)).tile((-1, 1)).expand((c_tiles.shape[0], -1))
    b_tiles.dtype = b_tiles.dtype.squeeze(1)
    return a_tiles, b_tiles, c_tiles


def _mm_application(a, b, c):
    acc = nl.zeros(c.shape, dtype=nl.float32)
    for k in range(a.shape[0]):
        acc += nl.dot(a[k], b[k])
    c = acc  # noqa: F841


def mm_kernel(m=(16, 64), n=(16, 64), k=(16, 64)):
    """``c = a @ b``: ``BM x BN`` output tiles, a loop over ``BK``-deep tiles of ``a`` and ``b``."""
    bm, bn, bk = (Symbol(name, meta=True, lower_bound=lo, upper_bound=hi) for name, (lo, hi) in zip(("BM", "BN", "BK"), (m, n, k)))
    arrangement = functools.partial(_mm_arrangement, BM=bm, BN=bn, BK=bk)
    return nd.make(arrangement, _mm_application, (Tensor(2), Tensor(2), Tensor(2)), name="mm")


def _axpy_arrangement(x, alpha, y, BLOCK):
    return x.tile((BLOCK,)), alpha, y.tile((BLOCK,))


def _axpy_application(x, alpha, y):
    y += alpha * x


def axpy_kernel():
    """``y += alpha * x`` (a scalar parameter and an augmented assignment to a parameter)."""
    arrangement = functools.partial(_axpy_arrangement, BLOCK=block_size())
    return nd.make(arrangement, _axpy_application, (Tensor(1), Tensor(0), Tensor(1)), name="axpy")


def softmax_rows_kernel():
    """Row softmax through the ``jit`` form, ``WIDTH`` a (keyword) constexpr of any size."""
    width = Symbol("WIDTH", constexpr=True)

    @nd.jit
    def softmax_rows(x: Tensor(2, other=float("-inf")).tile((1, width)), y: Tensor(2).tile((1, width))):
        shifted = x - nl.max(x)
        e = nl.exp(shifted)
        y = e / nl.sum(e)  # noqa: F841

    return softmax_rows
