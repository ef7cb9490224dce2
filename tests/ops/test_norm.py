import pytest
import torch

from ninefold.ops import references as ref

from .helpers import DTYPE_IDS, DTYPES, assert_close, call, impl_params, randn


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("rms_norm"))
@pytest.mark.parametrize("shape,strided", [((1, 1), False), ((5, 97), False), ((3, 4, 130), True), ((2, 1000), True)])
def test_rms_norm_matches_reference(device, impl, dtype, shape, strided):
    x = randn(*shape, dtype=dtype, device=device, strided=strided, seed=1, scale=3)
    w = randn(shape[-1], dtype=torch.float32, device=device, seed=2)
    assert_close(call("rms_norm", impl, x, w, 1e-5), ref.rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("add_rms_norm"))
@pytest.mark.parametrize("shape,strided", [((1, 8), False), ((7, 129), True)])
def test_add_rms_norm_returns_norm_and_sum(device, impl, dtype, shape, strided):
    x = randn(*shape, dtype=dtype, device=device, strided=strided, seed=3)
    r = randn(*shape, dtype=dtype, device=device, seed=4)
    w = randn(shape[-1], dtype=dtype, device=device, seed=5)
    out, total = call("add_rms_norm", impl, x, r, w, 1e-6)
    want_out, want_total = ref.add_rms_norm(x, r, w, 1e-6)
    assert_close(total, want_total, dtype)
    assert_close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("softmax"))
@pytest.mark.parametrize("shape,dim,strided", [((1, 1), -1, False), ((6, 1001), -1, True), ((5, 7, 3), 1, False),
                                              ((3, 1001), -1, False), ((2, 20001), -1, False)])
def test_softmax_matches_reference(device, impl, dtype, shape, dim, strided):
    x = randn(*shape, dtype=dtype, device=device, strided=strided, seed=6, scale=4)
    out = call("softmax", impl, x, dim)
    assert_close(out, ref.softmax(x, dim), dtype)
