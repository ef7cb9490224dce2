"""``ops.add_rms_norm_linear`` and ``ops.silu_and_mul_linear`` against float64 references and the
unfused operator pairs; argument errors name the fused operator."""

import pytest
import torch
from tests.ops.helpers import DTYPE_IDS, DTYPES, assert_close, call, impl_params, randn

import ninefold.ops as ops
from ninefold.ops import references as ref


def _skip_unless_registered(op, impl, device, dtype):
    found = next(i for i in ops.registry.all_implementations(op) if i.name == impl)
    if dtype not in found.dtypes:
        pytest.skip(f"{impl} does not take {dtype} on {device}")


@pytest.mark.parametrize("device,impl", impl_params("add_rms_norm_linear"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows, n, k, with_bias", [(1, 48, 256, False), (3, 24, 64, True), (1, 4096, 4096, False)])
def test_add_rms_norm_linear_matches_reference(device, impl, dtype, rows, n, k, with_bias):
    _skip_unless_registered("add_rms_norm_linear", impl, device, dtype)
    x, r = randn(rows, k, dtype=dtype, device=device, seed=1), randn(rows, k, dtype=dtype, device=device, seed=2)
    g = randn(k, dtype=dtype, device=device, seed=3)
    w = randn(n, k, dtype=dtype, device=device, seed=4, scale=k ** -0.5)
    bias = randn(n, dtype=dtype, device=device, seed=5) if with_bias else None
    y, total = call("add_rms_norm_linear", impl, x, r, g, w, 1e-5, bias)
    normed, want_total = ref.add_rms_norm(x, r, g, 1e-5)
    want = ref.linear(normed.to(dtype), w, bias)  # the normalised row is rounded, as the unfused pair does
    assert_close(total, want_total, dtype)
    assert_close(y, want, dtype, scale=4.0)
    unfused, unfused_total = ops.add_rms_norm(x, r, g, 1e-5)
    assert torch.equal(total, unfused_total)


@pytest.mark.parametrize("device,impl", impl_params("silu_and_mul_linear"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows, n, k, with_bias", [(1, 40, 512, False), (2, 16, 64, True), (1, 4096, 14336, False)])
def test_silu_and_mul_linear_matches_reference(device, impl, dtype, rows, n, k, with_bias):
    _skip_unless_registered("silu_and_mul_linear", impl, device, dtype)
    x = randn(rows, 2 * k, dtype=dtype, device=device, seed=1)
    w = randn(n, k, dtype=dtype, device=device, seed=2, scale=k ** -0.5)
    bias = randn(n, dtype=dtype, device=device, seed=3) if with_bias else None
    y = call("silu_and_mul_linear", impl, x, w, bias)
    want = ref.linear(ref.silu_and_mul(x).to(dtype), w, bias)
    assert_close(y, want, dtype, scale=4.0)


def test_errors_name_the_fused_operator():
    x, r, g, w = torch.randn(1, 64), torch.randn(1, 64), torch.randn(64), torch.randn(8, 64)
    with pytest.raises(ValueError, match=r"^add_rms_norm_linear: weight must be \[N, 64\]"):
        ops.add_rms_norm_linear(x, r, g, torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"^add_rms_norm_linear: residual must have x's shape"):
        ops.add_rms_norm_linear(x, r[:, :32], g, w)
    with pytest.raises(ValueError, match=r"^add_rms_norm_linear: .*eps"):
        ops.add_rms_norm_linear(x, r, g, w, -1.0)
    with pytest.raises(TypeError, match=r"^add_rms_norm_linear: .*float64"):
        ops.add_rms_norm_linear(x, r, g, w.double())
    with pytest.raises(ValueError, match=r"^silu_and_mul_linear: the last dimension of x must be even"):
        ops.silu_and_mul_linear(torch.randn(1, 63), w)
    with pytest.raises(ValueError, match=r"^silu_and_mul_linear: weight must be \[N, 64\]"):
        ops.silu_and_mul_linear(torch.randn(1, 128), torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"^silu_and_mul_linear: bias"):
        ops.silu_and_mul_linear(torch.randn(1, 128), w, torch.randn(7))


@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_weights_run_the_norm_or_gate_then_linear_fp8(rows):
    """An ``Fp8Weight`` takes the unfused pair with ``linear_fp8`` where no fused kernel runs (here the CPU)."""
    k, n = 64, 24
    x, r, g = torch.randn(rows, k), torch.randn(rows, k), torch.randn(k)
    w8 = ops.Fp8Weight.quantize(torch.randn(n, k))
    bias = torch.randn(n)
    y, total = ops.add_rms_norm_linear(x, r, g, w8, 1e-5, bias)
    normed, want_total = ops.add_rms_norm(x, r, g, 1e-5)
    assert torch.equal(total, want_total) and torch.equal(y, ops.linear_fp8(normed, w8, bias))
    a = torch.randn(rows, 2 * k)
    assert torch.equal(ops.silu_and_mul_linear(a, w8), ops.linear_fp8(ops.silu_and_mul(a), w8))
    # an FP8 weight and a dense one of the same shape are chosen for apart (the tuning bucket says which)
    key = ops.fused_linear._add_rms_norm_linear_key(x, r, g, w8, 1e-5)
    dense = ops.fused_linear._add_rms_norm_linear_key(x, r, g, w8.dequantize(), 1e-5)
    assert key[2] == (*dense[2], 8) and all(isinstance(v, int) for v in key[2])  # (tuning files take integers)


def test_fp8_errors_name_the_fused_operator():
    x, r, g = torch.randn(1, 64), torch.randn(1, 64), torch.randn(64)
    with pytest.raises(ValueError, match=r"^add_rms_norm_linear: x's last dimension must be weight's K = 32"):
        ops.add_rms_norm_linear(x, r, g, ops.Fp8Weight.quantize(torch.randn(8, 32)))
    with pytest.raises(ValueError, match=r"^silu_and_mul_linear: weight must be \[N, 64\] \(half of x's last "
                                         r"dimension\), got \(8, 32\)"):
        ops.silu_and_mul_linear(torch.randn(1, 128), ops.Fp8Weight.quantize(torch.randn(8, 32)))
    with pytest.raises(ValueError, match=r"^add_rms_norm_linear: bias"):
        ops.add_rms_norm_linear(x, r, g, ops.Fp8Weight.quantize(torch.randn(8, 64)), 1e-5, torch.randn(7))
