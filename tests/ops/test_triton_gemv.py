"""The Triton GEMV behind ``linear`` for a few rows: compiles for sm_90, matches float64 in the interpreter."""


import pytest
import torch

triton = pytest.importorskip("triton")

from .helpers import run_interpreted  # noqa: E402

# Runs in a child process with TRITON_INTERPRET=1 (set before Triton is imported).
CHECK = r"""
import torch
from ninefold.ops.triton import gemv
torch.manual_seed(0)
cases = [(1, 48, 64, False), (3, 33, 200, True), (16, 17, 1000, False), (5, 130, 96, True)]
for m, n, k, with_bias in cases:
    x = torch.randn(m, k) if m % 2 else torch.randn(m, k + 7)[:, :k]  # even m: rows with a padded stride
    w = torch.randn(n, k)
    b = torch.randn(n) if with_bias else None
    assert gemv.supports(x, w, b) is None, gemv.supports(x, w, b)
    y = gemv.linear(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    err = (y.double() - ref).abs().max().item()
    assert y.shape == (m, n) and y.dtype == torch.float32, (y.shape, y.dtype)
    assert err < 1e-3 * k ** 0.5, (m, n, k, err)
x = torch.randn(2, 3, 40)
w = torch.randn(24, 40)
y = gemv.linear(x, w)
assert y.shape == (2, 3, 24) and torch.allclose(y, x @ w.T, atol=1e-4)
assert "at most 16" in gemv.supports(torch.randn(17, 40), w)
assert "contiguous" in gemv.supports(torch.randn(40, 2).T, w)
print("gemv ok")
"""


def test_gemv_matches_float64_in_the_interpreter():
    run = run_interpreted(["-c", CHECK], timeout=300)
    assert "gemv ok" in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_compiles_for_sm90(dtype):
    from ninefold.ops import workloads
    from ninefold.ops.triton import aot

    target = aot.parse_target("cuda:90")
    found = aot.variants("linear", dtype, workloads.shapes("llama-8b"))
    assert found
    for variant in found:
        compiled = aot.compile_variant(variant, dtype, target)
        assert ".target sm_90" in compiled.asm["ptx"]
        assert len(compiled.asm["cubin"]) > 1000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemv_cuda_matches_float64(m, dtype):
    from ninefold.ops.triton import gemv

    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in ((6144, 4096), (4096, 14336), (100, 72)):
        x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
        b = torch.randn(n, device="cuda", generator=g).to(dtype)
        y = gemv.linear(x, w, b)
        ref = x.double() @ w.double().T + b.double()
        tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
        torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)
