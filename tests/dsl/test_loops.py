"""Loops whose bounds differ between programs: the cpu backend runs them together, masked."""

import pytest
import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor

COLS = Symbol("COLS", meta=True, lower_bound=4, upper_bound=64)


def arrangement(x, totals, prefix, COLS=COLS):
    def row_tiles(t):  # programs: rows; middle level: the row's column tiles
        t = t.tile((1, COLS)).tile((1, -1))
        t.dtype = t.dtype.squeeze(0)
        return t

    return row_tiles(x), totals.tile((1, 1)), row_tiles(prefix)


def application(x, totals, prefix):
    """Row ``i`` sums its first ``i + 1`` tiles (tile by tile into ``prefix``), then the rest x 10."""
    row = nl.max(totals.offsets(0))
    first = nl.minimum(row + 1, x.shape[0])
    acc = nl.zeros((), dtype=nl.float32)
    for j in range(first):
        acc += nl.sum(x[j].to(nl.float32))
        prefix[j] = x[j] * 0 + acc
    for j in range(first, x.shape[0]):
        acc += 10 * nl.sum(x[j].to(nl.float32))
    totals = acc  # noqa: F841


kernel = nd.make(arrangement, application, (Tensor(2), Tensor(2), Tensor(2)))


def reference(x, cols):
    x = x.double()
    rows, n = x.shape
    tiles = [x[:, j : j + cols].sum(1) for j in range(0, n, cols)]
    totals = torch.zeros(rows, dtype=torch.float64)
    prefix = torch.full((rows, n), -1.0, dtype=torch.float64)
    for i in range(rows):
        acc = 0.0
        for j, t in enumerate(tiles):
            if j <= i:
                acc += t[i].item()
                prefix[i, j * cols : (j + 1) * cols] = acc
            else:
                acc += 10 * t[i].item()
        totals[i] = acc
    return totals, prefix


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
@pytest.mark.parametrize("cols", [4, 8])
def test_per_program_loop_bounds(backend, cols):
    x = torch.randn(7, 37, generator=torch.Generator().manual_seed(cols))
    totals = torch.empty(7, 1)
    prefix = torch.full((7, 37), -1.0)
    kernel(x, totals, prefix, COLS=cols, backend=backend)
    want_totals, want_prefix = reference(x, cols)
    torch.testing.assert_close(totals[:, 0].double(), want_totals, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(prefix.double(), want_prefix, atol=1e-4, rtol=1e-5)


def application_tuples(x, totals, prefix):
    """``application`` with its running sum updated by tuple assignments (flat and nested)."""
    row = nl.max(totals.offsets(0))
    first = nl.minimum(row + 1, x.shape[0])
    acc = nl.zeros((), dtype=nl.float32)
    steps = nl.zeros((), dtype=nl.float32)
    for j in range(first):
        acc, steps = acc + nl.sum(x[j].to(nl.float32)), steps + 1
        prefix[j] = x[j] * 0 + acc
    for j in range(first, x.shape[0]):
        (acc, (steps, _)) = (acc + 10 * nl.sum(x[j].to(nl.float32)), (steps + 1, j))
    totals = acc + steps * 0  # noqa: F841


tuple_kernel = nd.make(arrangement, application_tuples, (Tensor(2), Tensor(2), Tensor(2)))


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_tuple_assignments_keep_the_values_of_programs_outside_their_range(backend):
    # Rows have different loop ranges; a tuple assignment must not overwrite the values of the rows
    # whose range is over (it did on the cpu backend: only single-name targets were blended).
    x = torch.randn(7, 37, generator=torch.Generator().manual_seed(3))
    totals = torch.empty(7, 1)
    prefix = torch.full((7, 37), -1.0)
    tuple_kernel(x, totals, prefix, COLS=8, backend=backend)
    want_totals, want_prefix = reference(x, 8)
    torch.testing.assert_close(totals[:, 0].double(), want_totals, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(prefix.double(), want_prefix, atol=1e-4, rtol=1e-5)
