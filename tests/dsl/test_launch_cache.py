"""Warm calls go through a launcher cached by shapes, strides, dtypes, devices, alignment, scalars."""

import pytest
import torch

from ninefold.dsl import examples
from ninefold.dsl.kernel import call_key

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_call_key_separates_what_a_launch_depends_on():
    x = torch.zeros(16)
    base = call_key((x, 2.5), {}, None)
    assert call_key((torch.zeros(16), 2.5), {}, None) == base  # same geometry: same launcher
    assert call_key((torch.zeros(17), 2.5), {}, None) != base
    assert call_key((torch.zeros(32)[::2], 2.5), {}, None) != base  # strides
    assert call_key((torch.zeros(16, dtype=torch.float64), 2.5), {}, None) != base
    assert call_key((torch.zeros(17)[1:], 2.5), {}, None) != base  # 4-byte offset: not 16-aligned
    assert call_key((x, 3.5), {}, None) != base and call_key((x, 2), {}, None) != base
    assert call_key((x, 2.5), {"BLOCK": 64}, None) != base
    assert call_key((x, 2.5), {}, "cpu") != base
    assert call_key((x, [1]), {}, None) is None  # not a key: the slow path every time


def test_warm_calls_on_cpu_do_not_build_launchers():
    add = examples.add_kernel()
    x = torch.randn(100)
    z = torch.empty(100)
    for _ in range(2):
        add(x, x, z, backend="cpu")
    assert torch.equal(z, x + x)
    assert add._launchers == {}


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("launch", ["compiled", "jit"])
def test_cuda_warm_calls_stay_correct(launch, monkeypatch):
    if launch == "jit":
        monkeypatch.setenv("NINEFOLD_DSL_TRITON_LAUNCH", "jit")
    add = examples.add_kernel()
    axpy = examples.axpy_kernel()
    base = torch.randn(3001, device="cuda", dtype=torch.float16)
    for offset in (0, 0, 1, 8, 1):  # aligned, again, 2-byte offset, 16-byte offset, misaligned again
        x, y = base[offset : offset + 2000], torch.randn(2000, device="cuda", dtype=torch.float16)
        z = torch.empty(2000, device="cuda", dtype=torch.float16)
        add(x, y, z)
        torch.testing.assert_close(z, x + y)
    for alpha in (0.5, 0.5, -2.0, 3):
        v, w = torch.randn(999, device="cuda"), torch.randn(999, device="cuda")
        want = w + alpha * v
        axpy(v, alpha, w)
        torch.testing.assert_close(w, want)
    assert len(add._launchers) == 2 and len(axpy._launchers) == 3  # 16-byte aligned or not


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_persistent_matmul(dtype):
    """The persistent form on a real GPU: one program per SM walking output tiles, odd sizes."""
    mm = examples.mm_kernel(m=(32, 64), n=(32, 64), k=(32, 64))
    mm.persistent = True
    a = torch.randn(1000, 300, device="cuda", dtype=dtype)
    b = torch.randn(300, 389, device="cuda", dtype=dtype)
    c = torch.empty(1000, 389, device="cuda", dtype=dtype)
    for _ in range(2):  # cold, then the cached launcher
        c.zero_()
        mm(a, b, c, BM=64, BN=32, BK=32)
        want = a.double() @ b.double()
        torch.testing.assert_close(c.double(), want, atol=0.5, rtol=2e-2)
