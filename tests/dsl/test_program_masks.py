"""Middle levels whose tiles may lie wholly outside the source for some programs only: the mask then
has a term on the program and middle indices alone (a scalar) beside the tile's own terms. Each
backend must load ``other`` there and store nothing (here the tile's row terms exclude those rows too);
Triton 3.9's interpreter rejects a scalar condition ``&`` a block one as a mask, so the interpret
backend's code must not build one (before the fix these cases raised "mask has unsupported dtype")."""

import pytest
import torch

import ninefold.dsl as nd
from ninefold.dsl import Symbol, Tensor

BM = Symbol("BM", meta=True, lower_bound=2, upper_bound=16)


def arrangement(x, y, BM=BM):
    def pairs(t):  # programs: pairs of row tiles; middle level: the two tiles; tile: BM rows x all columns
        t = t.tile((BM, -1)).tile((2, 1))
        t.dtype = t.dtype.squeeze(1)
        return t

    return pairs(x), pairs(y)


def application(x, y):
    for j in range(x.shape[0]):
        y[j] = x[j] * 2 + j


kernel = nd.make(arrangement, application, (Tensor(2, other=0), Tensor(2)))


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
@pytest.mark.parametrize("rows,cols", [(5, 6), (12, 6), (13, 6), (12, 8), (16, 8)])
def test_a_program_whose_second_tile_is_outside_stores_nothing_there(backend, rows, cols):
    # (12, 8): only the program's condition is live (rows and columns fill whole tiles)
    bm = 4
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    buffer = torch.full((rows + 2 * bm, cols), -7.0)
    y = buffer[:rows]  # a store past y's rows would land in the buffer's tail
    kernel(x, y, BM=bm, backend=backend)
    assert (buffer[rows:] == -7.0).all()
    tile_of_row = torch.arange(rows) // bm
    want = x * 2 + (tile_of_row % 2).to(x.dtype)[:, None]
    torch.testing.assert_close(y, want)
