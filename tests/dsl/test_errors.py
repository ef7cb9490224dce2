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
