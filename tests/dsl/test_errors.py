"""Every call-time error names the parameter, what was given and what was expected."""

import pytest
import torch

import ninefold.dsl as nd
from ninefold.dsl import Symbol, Tensor, block_size

BLOCK = block_size()
WIDTH = Symbol("WIDTH", constexpr=True)


def pair_arrangement(x, y, BLOCK=BLOCK):
    return x.tile((BLOCK,)), y.tile((BLOCK,))


def copy_application(x, y):
    y = x  # noqa: F841


copy = nd.make(pair_arrangement, copy_application, (Tensor(1), Tensor(1)))


def fixed_arrangement(x, y):
    return x.tile((4,)), y.tile((8,))


mismatched = nd.make(fixed_arrangement, copy_application, (Tensor(1), Tensor(1)))


def squeeze_arrangement(x, y):
    rows = x.tile((1, WIDTH)).squeeze(1)  # one tile per row only when WIDTH covers the row
    return rows, y.tile((1, WIDTH)).squeeze(1)


squeezing = nd.make(squeeze_arrangement, copy_application, (Tensor(2), Tensor(2)))


def test_wrong_number_of_tensors():
    with pytest.raises(TypeError, match=r"takes 2 positional arguments \(x, y\), got 1"):
        copy(torch.ones(3))


def test_outermost_shapes_that_disagree():
    with pytest.raises(ValueError, match=r"outermost shapes .* disagree: x \(3,\) but y \(2,\)"):
        mismatched(torch.ones(12), torch.ones(12))


def test_squeezed_dimension_that_is_not_one_at_the_call():
    x = torch.ones(3, 10)
    y = torch.empty(3, 10)
    squeezing(x, y, WIDTH=10)
    assert torch.equal(y, x)
    with pytest.raises(ValueError, match=r"argument x: squeeze: dimension 1 must have size 1, but it is 2"):
        squeezing(x, y, WIDTH=5)


def test_wrong_ndim():
    with pytest.raises(ValueError, match=r"argument y has 2 dims \(shape \(2, 2\)\), expected 1"):
        copy(torch.ones(4), torch.ones(2, 2))


def test_mixed_devices():
    with pytest.raises(ValueError, match=r"mixed devices \(x on cpu, y on meta\)"):
        copy(torch.ones(4), torch.empty(4, device="meta"))


def test_dtype_the_backend_cannot_run():
    x = torch.ones(4, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"argument x has dtype torch.complex64; the cpu backend runs"):
        copy(x, x.clone())
    b = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"argument x is bfloat16, which the interpret backend refuses"):
        copy(b, b.clone(), backend="interpret")


def test_triton_backend_refuses_cpu_tensors():
    with pytest.raises(ValueError, match=r"backend 'triton' needs GPU tensors; x is on cpu"):
        copy(torch.ones(4), torch.ones(4), backend="triton")


def test_keyword_symbols():
    x, y = torch.ones(2, 4), torch.empty(2, 4)
    with pytest.raises(TypeError, match=r"missing keyword argument\(s\) WIDTH"):
        squeezing(x, y)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'HEIGHT'"):
        squeezing(x, y, WIDTH=4, HEIGHT=3)
    with pytest.raises(TypeError, match=r"keyword WIDTH must be an int, got str"):
        squeezing(x, y, WIDTH="4")


def test_non_tensor_and_bad_backend():
    with pytest.raises(TypeError, match=r"argument x must be a torch.Tensor, got list"):
        copy([1, 2], torch.ones(2))
    with pytest.raises(ValueError, match=r"backend='cuda' is not one of"):
        copy(torch.ones(2), torch.ones(2), backend="cuda")


def test_make_checks_its_arguments():
    with pytest.raises(ValueError, match=r"takes 2 parameters \('x', 'y'\), but 3 tensors were given"):
        nd.make(pair_arrangement, copy_application, (Tensor(1), Tensor(1), Tensor(1)))
    with pytest.raises(TypeError, match=r"must be ninefold.dsl.Tensor, got int for 'x'"):
        nd.make(pair_arrangement, copy_application, (1, Tensor(1)))


N = Symbol("N", constexpr=True)


def sized_arrangement(x, y, BLOCK=BLOCK):
    return x.tile((BLOCK,)), y.tile((BLOCK,))


sized = nd.make(sized_arrangement, copy_application, (Tensor(shape=(N,)), Tensor(shape=(N,))))


@pytest.mark.parametrize("n", [4, 8])
def test_symbolic_source_size_must_match_the_tensor(n):
    base = torch.zeros(16)
    x, y = torch.arange(6.0), base[:6]
    with pytest.raises(ValueError, match=rf"argument x has size 6 in dim 0, but its shape declares N there, which is {n} \(N={n}\)"):
        sized(x, y, N=n, BLOCK=4)
    assert not base.any(), "the kernel wrote before the check"
    sized(x, y, N=6, BLOCK=4)
    assert torch.equal(y, x)


TILE = Symbol("TILE", constexpr=True)
BOUNDED = Symbol("BOUNDED", constexpr=True, lower_bound=2, upper_bound=8)


def constexpr_tiles(x, y):
    return x.tile((TILE,)), y.tile((TILE,))


def bounded_tiles(x, y):
    return x.tile((BOUNDED,)), y.tile((BOUNDED,))


constexpr_tiled = nd.make(constexpr_tiles, copy_application, (Tensor(1), Tensor(1)))
bounded_tiled = nd.make(bounded_tiles, copy_application, (Tensor(1), Tensor(1)))


@pytest.mark.parametrize("value", [0, -1, -4])
def test_constexpr_tile_size_must_be_positive(value):
    y = torch.full((10,), -7.0)
    with pytest.raises(ValueError, match=rf"keyword TILE is a size in the arrangement and must be >= 1, got {value}"):
        constexpr_tiled(torch.arange(10.0), y, TILE=value)
    assert (y == -7.0).all()


@pytest.mark.parametrize("value", [1, 64])
def test_constexpr_symbol_bounds_are_checked(value):
    with pytest.raises(ValueError, match=rf"keyword BOUNDED={value} is out of its symbol's bounds; accepted: 2\.\.8"):
        bounded_tiled(torch.zeros(4), torch.zeros(4), BOUNDED=value)
    y = torch.zeros(4)
    bounded_tiled(torch.ones(4), y, BOUNDED=8)
    assert torch.equal(y, torch.ones(4))


@pytest.mark.parametrize("kernel, keyword", [(copy, "BLOCK"), (bounded_tiled, "BOUNDED")])
@pytest.mark.parametrize("value", [True, False])
def test_bool_keyword_is_refused(kernel, keyword, value):
    with pytest.raises(TypeError, match=rf"keyword {keyword} must be an int, got bool {value}"):
        kernel(torch.zeros(4), torch.zeros(4), **{keyword: value})


def any_size_arrangement(x, y, BLOCK=Symbol("BLOCK", meta=True, power_of_two=False)):
    return x.tile((BLOCK,)), y.tile((BLOCK,))


any_size = nd.make(any_size_arrangement, copy_application, (Tensor(1), Tensor(1)))


@pytest.mark.parametrize("value", [3, 6])
def test_meta_block_size_must_be_a_power_of_two(value):
    with pytest.raises(ValueError, match=rf"keyword BLOCK is a block size and must be a power of two .*got {value}"):
        copy(torch.zeros(10), torch.zeros(10), BLOCK=value)
    x, y = torch.arange(10.0), torch.zeros(10)  # a symbol declared power_of_two=False takes any size
    any_size(x, y, BLOCK=value)
    assert torch.equal(y, x)


@pytest.mark.parametrize("name", ["backend", "self"])
def test_symbol_named_like_a_call_parameter_is_refused_when_the_kernel_is_made(name):
    symbol = Symbol(name, constexpr=True)

    def arrangement(x, y):
        return x.tile((symbol,)), y.tile((symbol,))

    with pytest.raises(ValueError, match=rf"a symbol is named '{name}', which the kernel call takes for itself"):
        nd.make(arrangement, copy_application, (Tensor(1), Tensor(1)))
