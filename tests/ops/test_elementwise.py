import pytest

from ninefold.ops import references as ref

from .helpers import DTYPE_IDS, DTYPES, assert_close, call, impl_params, randn


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("add"))
@pytest.mark.parametrize("shapes", [((37,), (37,)), ((3, 5, 7), (7,)), ((4, 1, 9), (1, 6, 9)), ((), (5,))])
def test_add_matches_reference(device, impl, dtype, shapes):
    a = randn(*shapes[0], dtype=dtype, device=device, seed=1)
    b = randn(*shapes[1], dtype=dtype, device=device, seed=2)
    assert_close(call("add", impl, a, b), ref.add(a, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("mul"))
def test_mul_matches_reference_on_strided_inputs(device, impl, dtype):
    a = randn(13, 31, dtype=dtype, device=device, strided=True, seed=3)
    b = randn(31, 13, dtype=dtype, device=device, seed=4).T
    assert not a.is_contiguous() and not b.is_contiguous()
    assert_close(call("mul", impl, a, b), ref.mul(a, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("silu_and_mul"))
@pytest.mark.parametrize("shape,strided", [((1, 2), False), ((7, 2 * 33), False), ((3, 5, 2 * 129), True)])
def test_silu_and_mul_matches_reference(device, impl, dtype, shape, strided):
    x = randn(*shape, dtype=dtype, device=device, strided=strided, seed=5)
    out = call("silu_and_mul", impl, x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(out, ref.silu_and_mul(x), dtype)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("gelu_and_mul"))
def test_gelu_and_mul_matches_reference(device, impl, dtype, approximate, strided):
    x = randn(9, 2 * 45, dtype=dtype, device=device, strided=strided, seed=6, scale=2)
    assert_close(call("gelu_and_mul", impl, x, approximate), ref.gelu_and_mul(x, approximate), dtype)
