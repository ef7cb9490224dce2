"""Differential tests of arrangements: the ``cpu`` backend, the generated Triton (under the interpreter,
and on a GPU where there is one) and the index maps of ``Tensor.eval`` must agree element for element.

Every case arranges one input ``x`` into a hierarchy (grid, optionally a middle level the application
loops over, tile) and runs four applications on it:

* ``copy``: the hierarchy written out whole, into an output of the hierarchy's shape (every level's
  dimensions concatenated) arranged the same way, so each element shows its value or ``other`` (0);
* ``sum``: one sum per program over the tile (and the middle level's loop);
* ``axes``: sums over each tile axis with ``keep_dims`` (the tile's shape, expanded dimensions included);
* ``store``: ``y = 2 * x`` with ``y`` arranged exactly as ``x``: the elements the hierarchy reaches are
  doubled, the others keep their sentinel, nothing outside ``y``'s view is touched.

The references come from ``Tensor.eval`` (the source index of every element, -1 where masked); the
window cases also check ``eval`` against windows counted by loops. Values are small integers, so sums
are exact in any order. Sizes are small and not multiples of the tiles.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor

BACKENDS = ["cpu", "interpret"] + (["triton"] if torch.cuda.is_available() else [])
SENTINEL = 99.0
B = Symbol("B", constexpr=True)  # a compile-time tile size
N = Symbol("N")  # a run-time size


@dataclass
class Case:
    name: str
    arrange: object  # Tensor -> arranged Tensor
    shape: tuple
    symbols: dict = field(default_factory=dict)  # Symbol -> value
    layout: str = "contiguous"  # of the input: contiguous, strided, transposed, broadcast
    dtype: torch.dtype = torch.float32


def levels(outer, inner, middle=None):
    """An arrangement: ``outer(x)`` with its dtype rearranged by ``inner`` (and ``middle`` above it)."""

    def arrange(x):
        t = outer(x)
        if middle is None:
            t.dtype = inner(t.dtype)
        else:
            m = middle(t.dtype)
            m.dtype = inner(m.dtype)
            t.dtype = m
        return t

    return arrange


def _grid_of_tiles(x):
    t = x.tile((1, 3)).tile((1, -1))
    t.dtype = t.dtype.squeeze(0)
    return t


CASES = [
    # tile: strides smaller and larger than the tile, dilation, floor_mode, -1, symbols
    Case("tile", lambda x: x.tile((4,)), (10,)),
    Case("tile_overlapping", lambda x: x.tile((4,), strides=(2,)), (11,), layout="strided"),
    Case("tile_gaps", lambda x: x.tile((3,), strides=(5,)), (13,)),
    Case("tile_dilated", lambda x: x.tile((3,), strides=(2,), dilation=(2,)), (13,), layout="strided"),
    Case("tile_dilated_floor", lambda x: x.tile((3,), strides=(2,), dilation=(2,), floor_mode=True), (13,)),
    Case("tile_floor", lambda x: x.tile((4,), floor_mode=True), (10,)),
    Case("tile_2d", lambda x: x.tile((2, 3)), (5, 7), layout="transposed"),
    Case("tile_whole_rows", lambda x: x.tile((-1, 3)), (5, 7), layout="broadcast"),
    Case("tile_symbol", lambda x: x.tile((B, 3), strides=(-1, 2)), (5, 7), {B: 2}, layout="strided"),
    Case("tile_runtime_symbol", lambda x: x.tile((N,)), (13,), {N: 3}),
    Case("window_longer_than_dim", lambda x: x.tile((5,), strides=(2,)), (3,)),
    Case("window_longer_than_dim_2d", lambda x: x.tile((2, 6), strides=(1, 1)), (3, 4), layout="strided"),
    # the grid's size inside the padded grid's mask: computed in the kernel, where `//` truncates
    Case("pad_windows_longer_than_dim", lambda x: x.tile((5,), strides=(2,)).pad(((1, 1),)), (3,)),
    # pad, permute, flatten (exclusive end_dim), ravel, squeeze/unsqueeze
    Case("pad_then_tile", lambda x: x.pad(((2, 1),)).tile((4,)), (9,), layout="strided"),
    Case("pad_dilated_windows", lambda x: x.pad(((2, 2),)).tile((3,), strides=(2,), dilation=(2,)), (9,)),
    Case("pad_the_grid", lambda x: x.tile((3,)).pad(((1, 1),)), (7,)),
    Case("pad_permute_2d", lambda x: x.pad(((1, 0), (0, 2))).permute((1, 0)).tile((3, 2)), (4, 5), layout="transposed"),
    Case("permute_the_grid", lambda x: x.tile((2, 3)).permute((1, 0)), (5, 7)),
    Case("flatten_then_tile", lambda x: x.flatten().tile((4,)), (3, 5), layout="strided"),
    Case("flatten_exclusive_end", lambda x: x.flatten(0, 2).tile((4, 2)), (3, 5, 3), layout="transposed"),
    Case("flatten_the_grid", lambda x: x.tile((2, 2)).permute((1, 0)).flatten(), (5, 7)),
    Case("flatten_then_pad", lambda x: x.flatten().pad(((2, 3),)).tile((4,)), (3, 5)),
    Case("ravel_levels", lambda x: x.tile((2, 3)).ravel().tile((1, 1, 2, 3)), (5, 7), layout="strided"),
    Case("unsqueeze_then_tile", lambda x: x.unsqueeze(0).tile((1, 4)), (9,)),
    Case("squeeze_the_grid", lambda x: x.tile((1, 4)).squeeze(0), (1, 9)),
    # __getitem__: steps, negative steps, None, Ellipsis, ints, out-of-range slice bounds
    Case("slice_step", lambda x: x[::2].tile((3,)), (13,), layout="strided"),
    Case("slice_negative_step", lambda x: x[8:1:-3].tile((2,)), (10,)),
    Case("slice_none_ellipsis", lambda x: x[None, ..., 1::2].tile((1, 2, 2)), (4, 9), layout="transposed"),
    Case("int_index", lambda x: x[-1].tile((4,)), (3, 9), layout="strided"),
    Case("slice_bounds_out_of_range", lambda x: x[-20:40:3].tile((2,)), (13,)),
    Case("slice_reversed_out_of_range", lambda x: x[40:-40:-2].tile((3,)), (13,), layout="strided"),
    Case("slice_the_grid", lambda x: x.tile((2, 4))[1:, ::-1], (7, 13)),
    # expand on the grid and on the tile level
    Case("expand_the_grid", lambda x: x.tile((1, -1)).expand((-1, 3)), (4, 5), layout="strided"),
    Case("expand_tile_rows", levels(lambda x: x.tile((1, -1)), lambda t: t.expand((3, -1))), (4, 5)),
    Case("expand_tile_runtime", levels(lambda x: x.tile((1, 4)), lambda t: t.expand((N, -1))), (3, 9), {N: 3}),
    Case("expand_then_pad", levels(lambda x: x.tile((1, 3)), lambda t: t.expand((4, -1)).pad(((1, 0), (0, 1)))),
         (3, 7), layout="transposed"),
    Case("expand_flattened_source", levels(lambda x: x.flatten().tile((4,)), lambda t: t.unsqueeze(0).expand((3, -1))),
         (3, 5), layout="strided"),
    Case("expand_then_reverse", levels(lambda x: x.tile((1, 3)), lambda t: t.expand((3, -1))[::-1, ::-1]), (3, 7)),
    Case("tile_reads_no_tile_index", levels(lambda x: x.tile((1, 1)), lambda t: t.expand((3, 4))), (3, 5)),
    Case("tile_reads_no_tile_index_1d", levels(lambda x: x.tile((1,)), lambda t: t.expand((5,))), (7,),
         layout="strided"),
    # the tile level rearranged
    Case("tile_permuted", levels(lambda x: x.tile((2, 3)), lambda t: t.permute((1, 0))), (5, 7), dtype=torch.float16),
    Case("tile_flattened", levels(lambda x: x.tile((2, 3)), lambda t: t.permute((1, 0)).flatten()), (5, 7),
         layout="strided"),
    Case("tile_padded", levels(lambda x: x.tile((3,)), lambda t: t.pad(((1, 2),))), (10,)),
    Case("tile_reversed_step", levels(lambda x: x.tile((5,)), lambda t: t[::-2]), (12,), layout="strided"),
    Case("tile_int_index", levels(lambda x: x.tile((2, 3)), lambda t: t[:, -1]), (5, 7)),
    Case("tile_slice_symbol", levels(lambda x: x.tile((B,)), lambda t: t[-7:9]), (13,), {B: 5}),
    Case("tile_unsqueezed", levels(lambda x: x.tile((3,)), lambda t: t[:, None]), (10,), layout="strided"),
    # tiles of tiles: a middle level the application loops over
    Case("tiles_of_tiles", levels(lambda x: x.tile((5,)), lambda t: t, lambda m: m.tile((2,))), (12,)),
    Case("tiles_of_tiles_2d", levels(lambda x: x.tile((4, 6)), lambda t: t.permute((1, 0)), lambda m: m.tile((3, 4))),
         (9, 13), layout="transposed"),
    Case("tiles_of_overlapping_tiles", levels(lambda x: x.tile((6,), strides=(4,)), lambda t: t,
                                              lambda m: m.tile((4,), strides=(2,))), (15,), layout="strided"),
    Case("tiles_of_tiles_expanded", levels(lambda x: x.tile((1, 6)), lambda t: t.expand((3, -1)),
                                           lambda m: m.tile((1, 4))), (3, 13)),
    Case("tiles_of_padded_tiles", levels(lambda x: x.tile((6,)), lambda t: t, lambda m: m.pad(((1, 1),)).tile((3,))),
         (14,)),
    Case("grid_of_tiles", _grid_of_tiles, (4, 10), layout="strided"),
]


def _seeded_windows(count=10, seed=2024):
    """Window tilings of 1-D and 2-D sources drawn from a fixed seed (windows longer than the dimension,
    strides below and above the tile, dilations, floor mode)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        ndim = 1 + i % 2
        shape = tuple(rng.randint(1, 9) for _ in range(ndim))
        tile = tuple(rng.randint(1, 6) for _ in range(ndim))
        strides = tuple(rng.choice((-1, 1, 2, 3, 5)) for _ in range(ndim))
        dilation = tuple(rng.choice((1, 1, 2, 3)) for _ in range(ndim))
        floor_mode = rng.random() < 0.3
        out.append((shape, tile, strides, dilation, floor_mode))
    return out


WINDOWS = _seeded_windows()
LAYOUTS = ("contiguous", "strided", "transposed")
CASES += [
    Case(f"seeded_window_{i}", lambda x, w=w: x.tile(w[1], strides=w[2], dilation=w[3], floor_mode=w[4]), w[0],
         layout=LAYOUTS[i % 3] if len(w[0]) > 1 else LAYOUTS[i % 2])
    for i, w in enumerate(WINDOWS)
]


# ---------------------------------------------------------------- applications


def copy_tile(x, y):
    y = x  # noqa: F841


def copy_middle(x, y):
    for k in range(x.shape[0]):
        y[k] = x[k]


def copy_middle_2d(x, y):
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            y[i, j] = x[i, j]


def sum_tile(x, z):
    z = nl.sum(x)  # noqa: F841


def sum_middle(x, z):
    acc = nl.sum(x[0]) * 0
    for k in range(x.shape[0]):
        acc += nl.sum(x[k])
    z = acc  # noqa: F841


def sum_middle_2d(x, z):
    acc = nl.sum(x[0, 0]) * 0
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            acc += nl.sum(x[i, j])
    z = acc  # noqa: F841


def sum_axis_0(x, y):
    y = nl.sum(x, axis=0, keep_dims=True)  # noqa: F841


def sum_axis_1(x, y):
    y = nl.sum(x, axis=1, keep_dims=True)  # noqa: F841


def sum_axis_2(x, y):
    y = nl.sum(x, axis=2, keep_dims=True)  # noqa: F841


def double_tile(x, y):
    y = x * 2  # noqa: F841


def double_middle(x, y):
    for k in range(x.shape[0]):
        y[k] = x[k] * 2


def double_middle_2d(x, y):
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            y[i, j] = x[i, j] * 2


COPY = {(): copy_tile, (1,): copy_middle, (2,): copy_middle_2d}
SUM = {(): sum_tile, (1,): sum_middle, (2,): sum_middle_2d}
DOUBLE = {(): double_tile, (1,): double_middle, (2,): double_middle_2d}
SUM_AXIS = (sum_axis_0, sum_axis_1, sum_axis_2)


# ---------------------------------------------------------------- helpers


def hierarchy_like(y, ndims):
    """``y`` (of the hierarchy's shape: every level's dims concatenated) arranged into levels of ``ndims``."""
    g, total = ndims[0], sum(ndims)
    t = y.tile((1,) * g + (-1,) * (total - g))
    if total > g:
        t = t.squeeze(tuple(range(g, total)))
    inner = t.dtype.squeeze(tuple(range(g)))
    if len(ndims) == 3:
        m = ndims[1]
        middle = inner.tile((1,) * m + (-1,) * (total - g - m))
        middle = middle.squeeze(tuple(range(m, total - g)))
        middle.dtype = middle.dtype.squeeze(tuple(range(m)))
        inner = middle
    t.dtype = inner
    return t


def layout(t, kind):
    """``t`` with the same values in another memory layout."""
    if kind == "strided":  # every other element of a larger buffer, in every dim
        big = torch.full([2 * s for s in t.shape], SENTINEL, dtype=t.dtype)
        view = big[tuple(slice(None, None, 2) for _ in t.shape)]
        view.copy_(t)
        return view
    if kind == "transposed" and t.ndim > 1:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if kind == "broadcast" and t.ndim > 1:
        return t[:1].expand(t.shape)  # stride 0 in dim 0 (its values are row 0's)
    return t.clone()


def source_values(case, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, case.shape, generator=g).to(case.dtype)
    if case.layout == "broadcast":
        x = x[:1].expand(case.shape).contiguous()
    return x


def index_map(case):
    probe = Tensor(len(case.shape))
    arranged = case.arrange(probe)
    return arranged.eval({probe: {"shape": case.shape}, **case.symbols}), [lv.ndim for lv in arranged.levels()]


def gathered(x, index):
    """``x``'s elements at a ``Tensor.eval`` index map, 0 where it is -1."""
    index = torch.from_numpy(index)
    values = x.reshape(-1)[index.clamp(min=0)]
    return torch.where(index >= 0, values, torch.zeros((), dtype=x.dtype))


def run(kernel, args, backend, symbols):
    if backend == "triton":
        moved = [a.cuda() for a in args]
        kernel(*moved, backend=backend, **symbols)
        args[-1].copy_(moved[-1].cpu())  # the output
    else:
        kernel(*args, backend=backend, **symbols)


# ---------------------------------------------------------------- the battery


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_backends_agree_with_the_index_map(case):
    index, ndims = index_map(case)
    if len(ndims) not in (2, 3) or (len(ndims) == 3 and ndims[1] > 2):
        raise AssertionError(f"case {case.name}: levels {ndims} are not covered by the applications")
    middle = tuple(ndims[1:2]) if len(ndims) == 3 else ()
    symbols = {s.name: v for s, v in case.symbols.items()}
    x_values = source_values(case)
    x = layout(x_values, case.layout)
    assert torch.equal(x, x_values)
    values = gathered(x_values, index)
    grid = index.shape[: ndims[0]]
    nx = len(case.shape)

    def arranged(y):
        return hierarchy_like(y, ndims)

    checks = [
        ("copy", COPY[middle], arranged, index.shape, values),
        ("sum", SUM[middle], lambda z: z, grid, values.flatten(len(grid)).sum(-1)),
    ]
    if len(ndims) == 2:
        for axis in range(min(ndims[1], len(SUM_AXIS))):
            dim = ndims[0] + axis
            shape = index.shape[:dim] + (1,) + index.shape[dim + 1 :]
            checks.append((f"axis {axis}", SUM_AXIS[axis], arranged, shape, values.sum(dim, keepdim=True)))
    for what, application, out_arrangement, out_shape, want in checks:
        kernel = nd.make(
            lambda x, y, out=out_arrangement: (case.arrange(x), out(y)), application,
            (Tensor(nx), Tensor(len(out_shape))),
            name=f"{case.name}_{application.__name__}",
        )
        for backend in BACKENDS:
            out = torch.full(out_shape, SENTINEL, dtype=case.dtype)
            run(kernel, (x, out), backend, symbols)
            assert torch.equal(out, want), f"{case.name}: {what} on {backend} differs from the index map"

    # stores: y = 2 * x through the same arrangement, into a strided view of a larger buffer
    reached = torch.zeros(x_values.numel(), dtype=torch.bool)
    reached[torch.from_numpy(index[index >= 0])] = True
    want = torch.where(reached.reshape(case.shape), 2 * x_values, torch.full((), SENTINEL, dtype=case.dtype))
    kernel = nd.make(lambda x, y: (case.arrange(x), case.arrange(y)), DOUBLE[middle], (Tensor(nx), Tensor(nx)),
                     name=f"{case.name}_store")
    for backend in BACKENDS:
        buffer = torch.full([2 * s for s in case.shape], SENTINEL, dtype=case.dtype)
        y = buffer[tuple(slice(None, None, 2) for _ in case.shape)]
        run(kernel, (x, y), backend, symbols)
        assert torch.equal(y, want), f"{case.name}: store on {backend} differs from the index map"
        y.fill_(SENTINEL)
        assert torch.equal(buffer, torch.full_like(buffer, SENTINEL)), f"{case.name}: {backend} stored outside y"


# ---------------------------------------------------------------- the bugs, one test each


def windows_by_loops(n, tile, stride, dilation, floor_mode):
    """Starts of the windows along a dimension of ``n``: in floor mode those inside it; otherwise as
    few as reach its end, at least one (windows longer than the dimension overhang and are masked)."""
    stride = tile if stride == -1 else stride
    span = dilation * (tile - 1) + 1
    starts = []
    while True:
        start = len(starts) * stride
        if floor_mode and start + span > n:
            return starts
        starts.append(start)
        if not floor_mode and start + span >= n:
            return starts


@pytest.mark.parametrize("window", WINDOWS, ids=[f"window_{i}" for i in range(len(WINDOWS))])
def test_seeded_windows_match_windows_counted_by_loops(window):
    # A window longer than its dimension once gave a negative (or zero) number of tiles unless its stride
    # was the tile size: `eval` raised a numpy error and kernels silently ran no program.
    shape, tile, strides, dilation, floor_mode = window
    got = Tensor(shape=shape).tile(tile, strides=strides, dilation=dilation, floor_mode=floor_mode).eval()
    per_dim = [windows_by_loops(*args, floor_mode) for args in zip(shape, tile, strides, dilation)]
    want = np.full([len(s) for s in per_dim] + list(tile), -1)
    for outer in np.ndindex(*want.shape[: len(shape)]):
        for inner in np.ndindex(*tile):
            idx = [s[o] + i * d for s, o, i, d in zip(per_dim, outer, inner, dilation)]
            if all(0 <= v < n for v, n in zip(idx, shape)):
                want[outer + inner] = np.ravel_multi_index(idx, shape)
    assert np.array_equal(got, want)


def test_window_longer_than_the_dimension_runs_one_masked_program():
    def arrangement(x, y):
        return x.tile((5,), strides=(1,)), y.tile((5,), strides=(1,))

    kernel = nd.make(arrangement, double_tile, (Tensor(1), Tensor(1)), name="long_window")
    for backend in ("cpu", "interpret"):
        y = torch.zeros(3)
        kernel(torch.arange(1.0, 4.0), y, backend=backend)
        assert torch.equal(y, torch.tensor([2.0, 4.0, 6.0])), backend


def test_gathered_tile_keeps_its_expanded_dimension_on_cpu():
    # The cpu backend's gather (masks of a middle level) returned size 1 where the tile level expands.
    def arrangement(x, z):
        t = x.tile((1, 6))
        m = t.dtype.tile((1, 4))
        m.dtype = m.dtype.expand((3, -1))
        t.dtype = m
        return t, z

    kernel = nd.make(arrangement, sum_middle_2d, (Tensor(2), Tensor(2)), name="gather_expand")
    x = torch.arange(3.0 * 13).reshape(3, 13)
    padded = torch.nn.functional.pad(x, (0, 5))
    want = 3 * padded.reshape(3, 3, 6).sum(-1)  # every tile: its row repeated 3 times
    for backend in ("cpu", "interpret"):
        z = torch.zeros(3, 3)
        kernel(x, z, backend=backend)
        assert torch.equal(z, want), backend


@pytest.mark.parametrize("expand", [(4, -1), (4, 8)], ids=["rows", "whole_tile"])
def test_store_through_an_expanded_tile(expand):
    # The generated store's pointers had size 1 in the expanded dimension (or were one scalar pointer
    # when the tile reads no tile index): Triton refused the full-size value and mask.
    def arrangement(x, y):
        def arrange(t):
            tiles = t.tile((1, 8 if expand[1] == -1 else 1))
            tiles.dtype = tiles.dtype.expand(expand)
            return tiles

        return arrange(x), arrange(y)

    name = "store_expand_" + ("rows" if expand[1] == -1 else "whole")
    kernel = nd.make(arrangement, double_tile, (Tensor(2), Tensor(2)), name=name)
    x = torch.arange(3.0 * 13).reshape(3, 13)
    for backend in ("cpu", "interpret"):
        y = torch.zeros(3, 13)
        kernel(x, y, backend=backend)
        assert torch.equal(y, 2 * x), backend


def test_offsets_of_an_expanded_tile_span_the_whole_tile():
    # `x.offsets()` in the generated Triton lacked the expanded dimension (the cpu backend had it).
    def arrangement(x, z):
        t = x.tile((1, 4))
        t.dtype = t.dtype.expand((4, -1))
        return t, z.tile((1, 1))

    def application(x, z):
        z = nl.sum(nl.sum(x.offsets(), axis=0, keep_dims=True), axis=1, keep_dims=True) * 1.0  # noqa: F841

    kernel = nd.make(arrangement, application, (Tensor(2), Tensor(2)), name="offsets_expand")
    offsets = torch.arange(16.0).reshape(2, 8)
    want = 4 * offsets.reshape(2, 2, 4).sum(-1)
    for backend in ("cpu", "interpret"):
        z = torch.zeros(2, 2)
        kernel(torch.zeros(2, 8), z, backend=backend)
        assert torch.equal(z, want), backend


@pytest.mark.parametrize(
    "key",
    [slice(-20, None), slice(None, 40), slice(-20, -1, 2), slice(40, None, -1), slice(None, -40, -1), slice(2, -2, 3)],
)
def test_slices_of_a_symbolic_size_clamp_like_python(key):
    # Constant bounds outside a symbolic dimension were not clamped: `x[-20:]` of 13 elements had 20
    # (7 masked) and `x[-20:-1:2]` read other elements than numpy's.
    x = Tensor(1)
    assert np.array_equal(x[key].eval({x: {"shape": (13,)}}), np.arange(13)[key])
    assert np.array_equal(Tensor(shape=(13,))[key].eval(), np.arange(13)[key])


# ---------------------------------------------------------------- errors of bad arrangements


BAD_ARRANGEMENTS = {  # id: (arrangement of a (3, 4) tensor, error, message)
    "tile_shape_length": (
        lambda x: x.tile((2,)), ValueError,
        r"tile: tile_shape \(2,\) has 1 entries; this 2-dim level takes 2",
    ),
    "tile_shape_not_a_tuple": (
        lambda x: x.tile(4), TypeError,
        r"tile: tile_shape must be a tuple with one entry per dimension \(2\), got int 4",
    ),
    "tile_size_float": (
        lambda x: x.tile((2.5, 2)), TypeError,
        r"tile: tile_shape\[0\] must be an int or a symbolic .*got float 2.5",
    ),
    "tile_size_none": (
        lambda x: x.tile((None, 2)), TypeError,
        r"tile: tile_shape\[0\] must be an int .*got NoneType None",
    ),
    "tile_size_zero": (
        lambda x: x.tile((0, 2)), ValueError,
        r"tile: tile_shape\[0\] must be a positive size or -1 .*got 0",
    ),
    "strides_length": (lambda x: x.tile((2, 2), strides=(1,)), ValueError, r"tile: strides \(1,\) has 1 entries"),
    "stride_negative": (
        lambda x: x.tile((2, 2), strides=(2, -3)), ValueError,
        r"tile: strides\[1\] must be a positive size or -1",
    ),
    "dilation_float": (
        lambda x: x.tile((2, 2), dilation=(1.5, 1)), TypeError,
        r"tile: dilation\[0\] must be an int .*got float",
    ),
    "expand_negative": (
        lambda x: x.unsqueeze(0).expand((-2, -1, -1)), ValueError,
        r"expand: shape\[0\] must be a size >= 0, or -1",
    ),
    "expand_float": (
        lambda x: x.unsqueeze(0).expand((2.5, -1, -1)), TypeError,
        r"expand: shape\[0\] must be an int .*float 2.5",
    ),
    "pad_float": (lambda x: x.pad(((1.5, 1), (0, 0))), TypeError, r"pad: pad\[0\]\[0\] must be an int .*got float 1.5"),
    "pad_not_pairs": (
        lambda x: x.pad((1, 1)), ValueError,
        r"pad: need one \(before, after\) pair per dimension \(2\), got \(1, 1\)",
    ),
    "flatten_end_dim_str": (
        lambda x: x.flatten(0, "1"), TypeError,
        r"flatten: end_dim must be an int or None, got str '1'",
    ),
    "squeeze_dim_out_of_range": (
        lambda x: x.squeeze(2), ValueError,
        r"squeeze dim=2 is out of range .*; accepted: -2..1",
    ),
    "permute_dim_out_of_range": (
        lambda x: x.permute((0, 2)), ValueError,
        r"permute dim=2 is out of range .*; accepted: -2..1",
    ),
    "int_index_out_of_range": (
        lambda x: x[3], ValueError,
        r"index 3 is out of range for dimension 0 of size 3; accepted: -3..2",
    ),
    "negative_int_index_out_of_range": (
        lambda x: x[:, -5], IndexError,
        r"index -5 is out of range for dimension 1 of size 4; accepted: -4..3",
    ),
    "too_many_indices": (
        lambda x: x[0, 0, 0], ValueError,
        r"too many indices \(3\) for a 2-dim level; accepted: at most 2",
    ),
}


@pytest.mark.parametrize("build, error, message", BAD_ARRANGEMENTS.values(), ids=BAD_ARRANGEMENTS.keys())
def test_bad_arrangements_name_the_argument_the_value_and_what_is_accepted(build, error, message):
    with pytest.raises(error, match=message):
        build(Tensor(shape=(3, 4)))


def test_squeeze_of_a_dimension_that_is_not_one_at_the_call():
    def arrangement(x, y):
        return x.tile((1, B)).squeeze(1), y.tile((1, B)).squeeze(1)

    kernel = nd.make(arrangement, copy_tile, (Tensor(2), Tensor(2)), name="squeeze_at_call")
    x = torch.arange(12.0).reshape(3, 4)
    for backend in ("cpu", "interpret"):
        y = torch.zeros(3, 4)
        kernel(x, y, B=4, backend=backend)
        assert torch.equal(y, x)
        with pytest.raises(ValueError, match=r"argument x: squeeze: dimension 1 must have size 1, but it is 2"):
            kernel(x, y, B=2, backend=backend)


def test_kernel_names_must_be_identifiers():
    # A name that is no identifier once made generated source that failed to compile (a SyntaxError).
    def arrangement(x, y):
        return x.tile((4,)), y.tile((4,))

    with pytest.raises(ValueError, match=r"name='copy-1': a kernel name must be a Python identifier"):
        nd.make(arrangement, copy_tile, (Tensor(1), Tensor(1)), name="copy-1")
    with pytest.raises(ValueError, match=r"kernel_name='2d': a kernel name must be a Python identifier"):
        nd.jit(kernel_name="2d")
