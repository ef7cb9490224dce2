"""The triton backend's launch path, run for real under ``TRITON_INTERPRET=1`` in a child process."""

import os
import subprocess
import sys

SCRIPT = r"""
import torch
from tests.dsl.test_backends import add, axpy, mm, row_sum, softmax_rows

torch.manual_seed(0)
x, y = torch.randn(1001), torch.randn(1001)[:1001]
z = torch.empty(1001)
for _ in range(2):  # the second call takes the cached launch plan
    add(x, y, z, backend="triton")
    assert torch.allclose(z, x + y), "add"
a, b = torch.randn(45, 70), torch.randn(70, 38)
c = torch.empty(45, 38)
mm(a, b, c, backend="triton", BM=16, BN=16, BK=16)
assert torch.allclose(c, a @ b, atol=1e-4), "mm"
m = torch.randn(37, 53)
out = torch.empty(37)
row_sum(m, out, backend="triton")
assert torch.allclose(out, m.sum(1), atol=1e-4), "row_sum"
s = torch.randn(9, 21)
t = torch.empty_like(s)
softmax_rows(s, t, WIDTH=21, backend="triton")
assert torch.allclose(t, torch.softmax(s, 1), atol=1e-6), "softmax"
w = torch.randn(77)
want = w + 2.5 * x[:77]
axpy(x[:77], 2.5, w, backend="triton")
assert torch.allclose(w, want), "axpy"
# warm calls take a prebuilt launcher keyed on shapes, strides, dtypes, devices and scalars
assert len(add._launchers) == 1, add._launchers
xs, ys, zs = torch.randn(2002)[::2], torch.randn(1001), torch.empty(1001)
add(xs, ys, zs, backend="triton")  # other strides: a second launcher
assert torch.allclose(zs, xs + ys), "add strided"
assert len(add._launchers) == 2
for alpha in (2.5, -1.0, 3):  # each scalar value its own entry, each result right
    w = torch.randn(77)
    want = w + alpha * x[:77]
    axpy(x[:77], alpha, w, backend="triton")
    assert torch.allclose(w, want), ("axpy", alpha)
w = torch.randn(77)
want = w + 0.5 * x[:77]
axpy(x[:77], torch.tensor(0.5), w, backend="triton")  # a 0-dim tensor for the scalar: not cached
assert torch.allclose(w, want), "axpy tensor scalar"
assert len(axpy._launchers) == 3, axpy._launchers
# the persistent form: few programs, each looping over output tiles (here 4 per program)
from ninefold.dsl import examples
pm = examples.mm_kernel()
pm.persistent = True
a, b = torch.randn(130, 70), torch.randn(70, 100)
c = torch.empty(130, 100)
pm(a, b, c, backend="triton", BM=16, BN=32, BK=16)
assert torch.allclose(c, a @ b, atol=1e-4), "persistent mm"
assert "tl.num_programs(0)" in next(v for k, v in pm._cache.items() if k[0] == "triton")[0].source
print("launched")
"""


def test_launch_path_under_the_triton_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", NINEFOLD_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "launched" in result.stdout
