"""Arrangement semantics: ``Tensor.eval`` against index maps computed independently with numpy."""

import itertools

import numpy as np
import pytest

from ninefold.dsl import Symbol, Tensor, block_size


def source(shape):
    return np.arange(int(np.prod(shape))).reshape(shape)


def ref_tile(src, tile, strides=None, dilation=None, floor_mode=False):
    """Tiles of ``src`` (an array of flat indices), -1 outside, by explicit loops."""
    tile = [n if t == -1 else t for n, t in zip(src.shape, tile)]
    strides = [t if s in (None, -1) else s for t, s in zip(tile, strides or [None] * len(tile))]
    dilation = dilation or [1] * len(tile)
    outer = []
    for n, t, s, d in zip(src.shape, tile, strides, dilation):
        span = n - d * (t - 1) - 1
        outer.append(span // s + 1 if floor_mode else -(-span // s) + 1)
    out = np.full(outer + tile, -1)
    for o in itertools.product(*map(range, outer)):
        for i in itertools.product(*map(range, tile)):
            idx = [oo * s + ii * d for oo, ii, s, d in zip(o, i, strides, dilation)]
            if all(0 <= x < n for x, n in zip(idx, src.shape)):
                out[o + i] = src[tuple(idx)]
    return out


def test_plain_tensor_is_row_major_arange():
    assert np.array_equal(Tensor(shape=(2, 3)).eval(), [[0, 1, 2], [3, 4, 5]])


@pytest.mark.parametrize(
    "shape, tile, strides, dilation, floor_mode",
    [
        ((10,), (4,), None, None, False),
        ((10,), (4,), None, None, True),
        ((11,), (3,), (1,), None, False),  # overlapping windows
        ((11,), (3,), (2,), (2,), False),  # dilation spaces the elements of a tile
        ((11,), (3,), (2,), (2,), True),
        ((5, 7), (2, 3), None, None, False),
        ((5, 7), (-1, 3), None, None, False),
        ((6, 8), (3, 3), (1, 2), (1, 2), True),
    ],
)
def test_tile_matches_numpy(shape, tile, strides, dilation, floor_mode):
    got = Tensor(shape=shape).tile(tile, strides=strides, dilation=dilation, floor_mode=floor_mode).eval()
    assert np.array_equal(got, ref_tile(source(shape), tile, strides, dilation, floor_mode))


def test_symbolic_tile_with_subs():
    x = Tensor(2)
    bm, bn = block_size(), block_size()
    tiled = x.tile((bm, bn))
    got = tiled.eval({x: {"shape": (5, 6)}, bm: 2, bn: 4})
    assert np.array_equal(got, ref_tile(source((5, 6)), (2, 4)))
    assert np.array_equal(tiled.eval({x: Tensor(shape=(5, 6)), bm: 2, bn: 4}), got)
    assert tiled.dtype.shape == (bm, bn)


def test_expand_squeeze_unsqueeze_permute():
    base = ref_tile(source((6, 4)), (2, 4))  # (3, 1, 2, 4)
    t = Tensor(shape=(6, 4)).tile((2, 4))
    assert np.array_equal(t.expand((-1, 5)).eval(), np.broadcast_to(base, (3, 5, 2, 4)))
    assert np.array_equal(t.squeeze(1).eval(), base[:, 0])
    assert np.array_equal(t.unsqueeze(0).eval(), base[None])
    assert np.array_equal(t.permute((1, 0)).eval(), base.transpose(1, 0, 2, 3))
    with pytest.raises(ValueError, match="only size-1"):
        t.squeeze(0)
    with pytest.raises(ValueError, match="only size-1"):
        t.expand((5, -1))


def test_flatten_end_dim_is_exclusive_and_ravel_flattens_levels():
    src = source((2, 3, 4))
    x = Tensor(shape=(2, 3, 4))
    assert np.array_equal(x.flatten(0, 2).eval(), src.reshape(6, 4))
    assert np.array_equal(x.flatten(start_dim=1).eval(), src.reshape(2, 12))
    assert np.array_equal(x.flatten().eval(), src.reshape(24))
    tiled = x.tile((1, 2, 3))
    raveled = tiled.ravel()
    assert raveled.ndim == 6 and not isinstance(raveled.dtype, Tensor)
    assert np.array_equal(raveled.eval(), ref_tile(src, (1, 2, 3)))


def test_pad_takes_before_after_per_dim_in_order():
    got = Tensor(shape=(3, 4)).pad(((1, 0), (2, 1))).eval()
    assert np.array_equal(got, np.pad(source((3, 4)), ((1, 0), (2, 1)), constant_values=-1))


def test_symbolic_pad_then_window_tiles():
    x = Tensor(2)
    p = Symbol("P", constexpr=True)
    t = x.pad(((p, p), (p, p))).tile((3, 3), strides=(1, 1))
    got = t.eval({x: {"shape": (4, 5)}, p: 1})
    padded = np.pad(source((4, 5)), 1, constant_values=-1)
    assert np.array_equal(got, ref_tile(padded, (3, 3), (1, 1)))


@pytest.mark.parametrize(
    "key",
    [1, -1, slice(1, 6, 2), slice(None, None, -2), slice(5, 1, -1), (None, 2), (Ellipsis, None), (slice(1, None), 0)],
)
def test_getitem_matches_numpy(key):
    src = source((7, 3))
    got = Tensor(shape=(7, 3))[key].eval()
    assert np.array_equal(got, src[key])


def test_getitem_on_symbolic_size():
    x = Tensor(1)
    got = x[1::3].eval({x: {"shape": (11,)}})
    assert np.array_equal(got, np.arange(11)[1::3])


def test_assigning_dtype_rearranges_the_inner_level():
    a = Tensor(shape=(4, 6))
    m = a.tile((2, 3)).tile((1, -1)).expand((-1, 3))
    m.dtype = m.dtype.squeeze(0)
    assert (m.shape, m.dtype.shape, m.dtype.dtype.shape) == ((2, 3), (2,), (2, 3))
    rows = ref_tile(source((4, 6)), (2, 3))  # (2, 2, 2, 3)
    want = np.broadcast_to(rows[:, None], (2, 3, 2, 2, 3))
    assert np.array_equal(m.eval(), want)


def test_meta_operations_do_not_change_their_input():
    x = Tensor(shape=(5, 6))
    t = x.tile((2, 3))
    before = t.eval().copy()
    t.expand((-1, -1)).permute((1, 0))
    s2 = t.tile((1, 1))
    s2.dtype = s2.dtype.squeeze((0, 1))
    assert np.array_equal(t.eval(), before) and np.array_equal(x.eval(), source((5, 6)))
    assert isinstance(t.dtype, Tensor) and t.dtype.shape == (2, 3)


def test_bad_arguments_raise_with_names():
    x = Tensor(2)
    with pytest.raises(ValueError, match="tile_shape"):
        x.tile((2,))
    with pytest.raises(ValueError, match="permutation"):
        x.permute((0, 0))
    with pytest.raises(ValueError, match="end_dim"):
        x.flatten(1, 1)
    with pytest.raises(ValueError, match="pair"):
        x.pad(((1, 1),))
    with pytest.raises(ValueError, match="ndim"):
        Tensor(2, shape=(1, 2, 3))
    with pytest.raises(ValueError, match="constexpr"):
        Tensor(2, constexpr=True)
