import pytest
import torch

from ninefold.ops import references as ref

from .helpers import DTYPE_IDS, DTYPES, assert_close, call, impl_params, randn


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("linear"))
@pytest.mark.parametrize("m,n,k,bias,strided", [(1, 1, 1, False, False), (3, 33, 65, True, False),
                                                 (17, 70, 129, False, True), (64, 128, 256, True, True)])
def test_linear_matches_reference(device, impl, dtype, m, n, k, bias, strided):
    x = randn(m, k, dtype=dtype, device=device, strided=strided, seed=1)
    w = randn(n, k, dtype=dtype, device=device, seed=2, scale=k**-0.5)
    b = randn(n, dtype=dtype, device=device, seed=3) if bias else None
    assert_close(call("linear", impl, x, w, b), ref.linear(x, w, b), dtype, scale=4)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("embedding"))
def test_embedding_gathers_rows(device, impl, dtype, ids_dtype):
    weight = randn(50, 24, dtype=dtype, device=device, seed=4)
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(5)).to(device, ids_dtype)
    out = call("embedding", impl, ids, weight)
    assert out.shape == (3, 7, 24)
    assert_close(out, ref.embedding(ids, weight), dtype)
