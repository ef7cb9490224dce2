"""Op-level entry points of the PDL GEMV (``ninefold.ops.triton.gemv_pdl_ops``) against float64."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from ninefold.ops import references as ref  # noqa: E402
from ninefold.ops.triton import gemv_pdl_ops as go  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# Runs with TRITON_INTERPRET=1: one row takes the fused kernel, three rows the ops fallback.
CHECK = r"""
import torch
from ninefold.ops import references as ref
from ninefold.ops.triton import gemv_pdl_ops as go
torch.manual_seed(0)
n, k = 40, 512
w = torch.randn(n, k)
g = torch.randn(k)
for rows, fused in ((1, True), (3, False)):
    x, r = torch.randn(rows, k), torch.randn(rows, k)
    assert (go.supports(x, w) is None) == fused
    y, total = go.add_rms_norm_linear(x, r, g, w, 1e-5)
    normed, want_total = ref.add_rms_norm(x, r, g, 1e-5)
    want = ref.linear(normed, w)
    assert y.shape == (rows, n) and total.shape == (rows, k)
    assert torch.allclose(total.double(), want_total, atol=1e-6), "residual"
    assert torch.allclose(y.double(), want, atol=1e-3, rtol=1e-4), ("add_rms_norm_linear", rows)
    a = torch.randn(rows, 2 * k)
    y = go.silu_and_mul_linear(a, w)
    assert torch.allclose(y.double(), ref.linear(ref.silu_and_mul(a), w), atol=1e-3, rtol=1e-4), ("silu", rows)
x = torch.randn(1, 1, k)
assert go.supports(x, w) is None
assert torch.allclose(go.linear(x, w).double(), ref.linear(x, w), atol=1e-3, rtol=1e-4)
print("ok")
"""


def test_fused_kernel_and_fallback_match_float64_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_cpu_without_interpreter_falls_back_to_the_ops():
    torch.manual_seed(1)
    x, r, g, w = torch.randn(1, 64), torch.randn(1, 64), torch.randn(64), torch.randn(24, 64)
    y, total = go.add_rms_norm_linear(x, r, g, w, 1e-6)
    normed, want_total = ref.add_rms_norm(x, r, g, 1e-6)
    assert torch.allclose(total.double(), want_total) and torch.allclose(y.double(), ref.linear(normed, w), atol=1e-4)
    a = torch.randn(1, 128)
    assert torch.allclose(go.silu_and_mul_linear(a, w).double(), ref.linear(ref.silu_and_mul(a), w), atol=1e-4)


@pytest.mark.parametrize("args, reason", [
    ((torch.randn(2, 64), torch.randn(8, 64)), "2 rows"),
    ((torch.randn(1, 64), torch.randn(8, 64), torch.randn(8)), "no bias"),
    ((torch.randn(1, 64), torch.randn(8, 64)), "CUDA only"),
])
def test_supports_names_the_reason(args, reason):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter accepts CPU tensors")
    assert reason in go.supports(*args)


def test_linear_refuses_a_bias():
    with pytest.raises(ValueError, match="bias"):
        go.linear(torch.randn(1, 64), torch.randn(8, 64), torch.randn(8))


def test_default_config_splits_narrow_outputs():
    assert go.config(4096, 4096)[2] == 2 and go.config(28672, 4096)[2] == 1
    n, k = 4096, 14336
    bn, bk, sk, *_ = go.config(n, k)
    assert k % (bk * sk) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_ops_match_float64():
    torch.manual_seed(0)
    dev, dt, k, n = "cuda", torch.bfloat16, 4096, 6144
    x, r, g = (torch.randn(1, k, device=dev, dtype=dt) for _ in range(3))
    w = torch.randn(n, k, device=dev, dtype=dt) / 64
    y, total = go.add_rms_norm_linear(x, r, g[0], w, 1e-5)
    normed, want_total = ref.add_rms_norm(x, r, g[0], 1e-5)
    want = ref.linear(normed.to(dt), w)
    assert torch.equal(total.double(), want_total)
    assert ((y.double() - want).abs().max() / want.abs().max()).item() < 2e-2
