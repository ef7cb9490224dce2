"""The float32 CPU ``linear`` for bfloat16/float16 where torch has no fast GEMM in those dtypes."""

import pytest
import torch
import torch.nn.functional as F

from ninefold import ops
from ninefold.ops import cpu_upcast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_takes_many_rows_where_the_half_gemm_is_slow(monkeypatch, dtype):
    x, w = torch.empty(16, 64, dtype=dtype), torch.empty(32, 64, dtype=dtype)
    monkeypatch.setattr(cpu_upcast, "native_half_gemm", lambda d: False)
    assert cpu_upcast.supports(x, w) is None
    assert "8 rows" in cpu_upcast.supports(x[:8], w)
    monkeypatch.setattr(cpu_upcast, "native_half_gemm", lambda d: True)
    assert "fast" in cpu_upcast.supports(x, w)


def test_dispatch_follows_this_cpu():
    x, w = torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(32, 64, dtype=torch.bfloat16)
    slow = not cpu_upcast.native_half_gemm(torch.bfloat16)
    assert (ops.choose("linear", x, w) == "cpu_upcast") == slow
    assert ops.choose("linear", x[:4], w) != "cpu_upcast"
    assert ops.choose("linear", x.float(), w.float()) != "cpu_upcast"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_result_is_the_float32_product_rounded_once(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 96, generator=g).to(dtype)
    w, b = torch.randn(40, 96, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    out = cpu_upcast.linear(x, w, b)
    assert out.dtype == dtype and out.shape == (3, 7, 40)
    assert torch.equal(out, F.linear(x.float(), w.float(), b.float()).to(dtype))
    exact = x.double() @ w.double().T + b.double()
    ulp = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
    assert ((out.double() - exact).abs() <= ulp * exact.abs() + 1e-6).all()
