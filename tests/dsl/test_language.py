"""Every ``ninefold.dsl.language`` function on the cpu and interpret backends against torch, and compiled for cuda:90."""

import pytest
import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor
from ninefold.dsl.backends.triton import compile_for_target

ROWS = Symbol("ROWS", meta=True, lower_bound=2, upper_bound=16)
WIDTH = Symbol("WIDTH", constexpr=True)


def arrangement(x, y, out, ROWS=ROWS):
    results = out.tile((1, ROWS, WIDTH)).tile((-1, 1, 1)).squeeze(0)  # programs (rows, 1); middle: the 5 results
    results.dtype = results.dtype.squeeze((1, 2))
    results.dtype.dtype = results.dtype.dtype.squeeze(0)
    return x.tile((ROWS, WIDTH)), y.tile((ROWS, WIDTH)), results


def application(x, y, out):
    a = x.to(nl.float32)
    b = nl.abs(y.to(nl.float32)) + 0.5
    out[0] = nl.exp(a) + nl.exp2(a) + nl.log(b) + nl.log2(b) + nl.sqrt(b) + nl.rsqrt(b)
    out[1] = nl.sigmoid(a) + nl.erf(a) + nl.tanh(a) + nl.pow(b, 1.5) + nl.maximum(a, b) - nl.minimum(a, b)
    out[2] = nl.where(a > 0, a, 0.0) + nl.sum(a, axis=1)[:, None] + nl.max(a, axis=1)[:, None] - nl.min(a, axis=0)[None, :]
    out[3] = nl.dot(a, nl.trans(b)) + nl.zeros(a.shape, dtype=nl.float32) + nl.full(a.shape, 2.0, dtype=nl.float32)
    out[4] = nl.argmax(a, axis=1)[:, None].to(nl.float32) + (a * 0 + a.shape[0]) + nl.cast(a, nl.float16)


kernel = nd.make(arrangement, application, (Tensor(2), Tensor(2), Tensor(3)))


def reference(x, y):
    a, b = x.double(), y.double().abs() + 0.5
    out = torch.empty(5, *x.shape, dtype=torch.float64)
    out[0] = a.exp() + a.exp2() + b.log() + b.log2() + b.sqrt() + b.rsqrt()
    out[1] = a.sigmoid() + torch.erf(a) + a.tanh() + b**1.5 + torch.maximum(a, b) - torch.minimum(a, b)
    rows = 4
    for r in range(0, x.shape[0], rows):
        ta, tb = a[r : r + rows], b[r : r + rows]
        out[2, r : r + rows] = ta.clamp(min=0) + ta.sum(1, keepdim=True) + ta.amax(1, keepdim=True) - ta.amin(0, keepdim=True)
        out[3, r : r + rows] = ta @ tb.T + 2.0
        out[4, r : r + rows] = ta.argmax(1, keepdim=True) + rows + ta
    return out


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_language_functions(backend):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    out = torch.empty(5, 8, 4)
    kernel(x, y, out, WIDTH=4, ROWS=4, backend=backend)
    torch.testing.assert_close(out.double(), reference(x, y), atol=2e-3, rtol=2e-3)


def test_language_functions_compile_for_cuda_90():
    x = torch.empty(32, 16, dtype=torch.float16)  # tl.dot needs 16 x 16 tiles at least
    compiled, generated, _ = compile_for_target(kernel, (x, x, torch.empty(5, 32, 16)), {"WIDTH": 16, "ROWS": 16})
    assert "def tanh(x):" in generated.source and len(compiled.asm["cubin"]) > 1000
