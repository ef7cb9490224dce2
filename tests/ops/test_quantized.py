"""linear_int4 / Int4Weight against float64 dequantization done here, from the codes, scales and offsets."""

import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import references as ref

from .helpers import DTYPE_IDS, DTYPES, assert_close, call, impl_params, randn


def _affine(n, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand((n, k // group), generator=g) * 0.02 + 0.001
    offsets = -8 * scales + torch.randn((n, k // group), generator=g) * 0.01
    return codes, scales, offsets


def _dense64(codes, scales, offsets, group):
    n, k = codes.shape
    w = codes.double().reshape(n, k // group, group) * scales.double()[..., None] + offsets.double()[..., None]
    return w.reshape(n, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("linear_int4"))
@pytest.mark.parametrize("lead,n,k,group,bias,strided", [
    ((1,), 16, 32, 32, False, False),
    ((3,), 33, 64, 32, True, False),  # N not a multiple of 16: padded rows
    ((2, 5), 70, 256, 64, False, True),  # 3-D, non-contiguous x
    ((17,), 48, 256, 128, True, True),
    ((4,), 7, 512, 256, False, False),
])
def test_linear_int4_matches_float64_dequantization(device, impl, dtype, lead, n, k, group, bias, strided):
    codes, scales, offsets = _affine(n, k, group, seed=n + k)
    weight = ops.Int4Weight(codes.to(device), scales.to(device), offsets.to(device), group)
    x = randn(*lead, k, dtype=dtype, device=device, strided=strided, seed=1)
    b = randn(n, dtype=dtype, device=device, seed=3) if bias else None
    out = call("linear_int4", impl, x, weight, b)
    assert out.shape == (*lead, n)
    expected = x.double().cpu() @ _dense64(codes, scales, offsets, group).T
    if b is not None:
        expected = expected + b.double().cpu()
    # bf16/f16 runs also round the group scales to x's dtype (as the CPU kernel does): a few ulps more.
    assert_close(out, expected, dtype, scale=4)
    assert_close(out, ref.linear_int4(x, weight, b), dtype, scale=4)


def test_weight_round_trips_codes_and_dequantizes_exactly():
    codes, scales, offsets = _affine(40, 128, 32, seed=7)
    weight = ops.Int4Weight(codes, scales, offsets, 32)
    assert torch.equal(weight.codes(), codes)
    # float32 dequantization from float32 scales: only the float32 rounding of offset + 8 scale
    torch.testing.assert_close(weight.dequantize().double(), _dense64(codes, scales, offsets, 32), atol=1e-6, rtol=0)
    assert weight.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_empty_batch():
    codes, scales, offsets = _affine(16, 64, 32)
    out = ops.linear_int4(torch.zeros(0, 64), ops.Int4Weight(codes, scales, offsets, 32))
    assert out.shape == (0, 16)


@pytest.mark.parametrize("make,match", [
    (lambda c, s, o: ops.Int4Weight(c.float(), s, o, 32), "codes must be an integer"),
    (lambda c, s, o: ops.Int4Weight(c, s, o, 16), "group_size must be one of"),
    (lambda c, s, o: ops.Int4Weight(c[:, :48], s, o, 32), "multiple of group_size"),
    (lambda c, s, o: ops.Int4Weight(c, s[:, :1], o, 32), "scales must have shape"),
    (lambda c, s, o: ops.Int4Weight(c, s, o.int(), 32), "offsets must be a floating-point"),
    (lambda c, s, o: ops.Int4Weight(c.int() + 1, s, o, 32), r"codes must lie in \[0, 15\]"),
])
def test_bad_weights_are_refused(make, match):
    codes, scales, offsets = _affine(16, 64, 32)
    with pytest.raises((TypeError, ValueError), match=match):
        make(codes, scales, offsets)


def test_bad_calls_name_the_argument():
    codes, scales, offsets = _affine(16, 64, 32)
    weight = ops.Int4Weight(codes, scales, offsets, 32)
    with pytest.raises(ValueError, match="x's last dimension must be weight's K = 64"):
        ops.linear_int4(torch.zeros(2, 32), weight)
    with pytest.raises(TypeError, match="weight must be an ninefold.ops.Int4Weight"):
        ops.linear_int4(torch.zeros(2, 64), torch.zeros(16, 64))
    with pytest.raises(TypeError, match="x must be a floating-point"):
        ops.linear_int4(torch.zeros(2, 64, dtype=torch.int32), weight)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.linear_int4(torch.zeros(2, 64), weight, torch.zeros(15))
    with pytest.raises(TypeError, match="bias is bfloat16 but x is float32"):
        ops.linear_int4(torch.zeros(2, 64), weight, torch.zeros(16, dtype=torch.bfloat16))


def test_cpu_uses_torch_int4_kernel():
    codes, scales, offsets = _affine(16, 64, 32)
    weight = ops.Int4Weight(codes, scales, offsets, 32)
    if not weight.cpu_kernel:
        pytest.skip("this torch has no CPU int4pack kernel")
    assert ops.choose("linear_int4", torch.zeros(1, 64, dtype=torch.bfloat16), weight) == "vendor"
