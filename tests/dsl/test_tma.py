"""The experimental TMA load mode (``Kernel.tma``): box-shaped tiles read through descriptors."""

import math
import os
import subprocess
import sys

import pytest
import torch

import ninefold.dsl as nd
from ninefold.dsl.backends.triton import compile_for_target
from ninefold.ops.kernels import attention

INTERPRETED = """
import math, torch
import ninefold.dsl as nd
from ninefold.ops.kernels import attention as A
torch.manual_seed(0)
kernel = nd.make(A.arrangement, A.application, A.tensors(), num_warps=4, num_stages=2)
kernel.tma = True
for causal, s in ((True, 200), (False, 96)):
    q, k, v = (torch.randn(1, 2, s, 64, dtype=torch.float16) for _ in range(3))
    o = torch.empty_like(q)
    kernel(q, k, v, 1 / math.sqrt(64), causal, o, BLOCK_M=64, BLOCK_N=32, backend="triton")
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    print((o.double() - want).abs().max().item())
sources = {v[0].source for key, v in kernel._cache.items() if isinstance(key, tuple) and key[0] == "triton"}
print(min(source.count("_desc.load(") for source in sources))
"""


def test_tma_attention_is_right_under_the_interpreter():
    # sizes that are not multiples of the blocks: the descriptors' zero fill stands for the masks
    done = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    *errors, loads = done.stdout.split()
    assert all(float(e) < 2e-3 for e in errors) and len(errors) == 2
    assert int(loads) == 5  # q, and k and v in both loops


def test_tma_attention_compiles_to_tma_copies_for_cuda_90():
    q = torch.empty(2, 4, 1024, 128, dtype=torch.bfloat16)
    args = (q, q, q, 0.08, True, q)
    compiled, generated, _ = compile_for_target(
        attention.kernel, args, {"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3, tma=True
    )
    assert "k_desc.load(" in generated.source and "async_tma_copy" in compiled.asm["ttgir"]


def test_accesses_that_are_not_boxes_stay_pointer_loads():
    def arrangement(x, y, BLOCK=nd.block_size()):
        return x.tile((BLOCK,), dilation=(2,)), y.tile((BLOCK,))  # every other element: not a box

    def application(x, y):
        y = x  # noqa: F841

    kernel = nd.make(arrangement, application, (nd.Tensor(1), nd.Tensor(1)))
    x = torch.empty(1024)
    _, generated, _ = compile_for_target(kernel, (x, torch.empty(1024)), {"BLOCK": 64}, tma=True)
    assert "x_desc" not in generated.source and "tl.load(x_ptr" in generated.source


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tma_attention_matches_sdpa():
    torch.manual_seed(0)
    kernel = nd.make(attention.arrangement, attention.application, attention.tensors(), num_warps=8, num_stages=3)
    kernel.tma = True
    for causal, s in ((True, 1000), (False, 512)):
        q, k, v = (torch.randn(2, 4, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        o = torch.empty_like(q)
        kernel(q, k, v, 1 / math.sqrt(128), causal, o, BLOCK_M=128, BLOCK_N=64)
        kernel(q, k, v, 1 / math.sqrt(128), causal, o, BLOCK_M=128, BLOCK_N=64)  # the warm call
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        assert (o.double() - want).abs().max().item() < 2e-2


ROWS = """
import math, torch
import ninefold.dsl as nd
from ninefold.ops.kernels import attention as A
torch.manual_seed(0)
kernel = nd.make(A.arrangement, A.application, A.tensors(), num_warps=4, num_stages=2)
kernel.tma = "rows"
cases = ((True, 256, False), (True, 200, False), (False, 96, False), (True, 128, True))
for causal, s, strided in cases:
    if strided:  # [B, S, H, D] storage read as [B, H, S, D]: the leading dims cannot be read as one
        q, k, v = (torch.randn(2, s, 2, 64, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    else:
        q, k, v = (torch.randn(2, 2, s, 64, dtype=torch.float16) for _ in range(3))
    o = torch.empty_like(q)
    for _ in range(2):  # the first call and the warm launcher (descriptors rebuilt per call)
        kernel(q, k, v, 1 / math.sqrt(64), causal, o, BLOCK_M=64, BLOCK_N=32, backend="triton")
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    print("error", (o.double() - want).abs().max().item())
for key, value in kernel._cache.items():
    if isinstance(key, tuple) and key[0] == "triton":
        print("source", value[0].source.count("_desc.load("), value[0].source.count("tl.reshape("))
"""


def test_rows_mode_reads_collapsed_views_only_where_the_call_allows():
    # S=256: every tile is a row range of the [B*H*S, D] view (no reshape); S=200 (q, k, v tiles
    # overhang S) and transposed storage keep the 4-D boxes; S=96 non-causal: q overhangs
    # (BLOCK_M 64), k and v (BLOCK_N 32) do not
    done = subprocess.run([sys.executable, "-c", ROWS], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    errors = [float(line[1]) for line in lines if line[0] == "error"]
    assert len(errors) == 4 and all(e < 2e-3 for e in errors), errors
    sources = sorted((int(a), int(b)) for tag, a, b in (line for line in lines if line[0] == "source"))
    assert sources == [(5, 0), (5, 1), (5, 5), (5, 5)]  # loads, reshapes per specialization


def test_collapsible_counts_leading_dims_readable_as_one():
    from ninefold.dsl.backends.triton_codegen import collapsible, descriptor

    x = torch.empty(2, 3, 4, 8)
    assert collapsible(x) == 3
    assert collapsible(x.transpose(1, 2)) == 0
    assert collapsible(x[:, :, :2]) == 1  # dims 0-1 still collapse; dim 2 is cut
    assert collapsible(torch.empty(1, 5, 8).transpose(0, 1)) == 2  # a size-1 dimension's own stride does not count
    desc = descriptor(x, [4, 8], rows=2)
    assert list(desc.shape) == [24, 8] and list(desc.strides) == [8, 1] and list(desc.block_shape) == [4, 8]


def test_rows_mode_attention_compiles_to_tma_copies_without_reshape_for_cuda_90():
    q = torch.empty(2, 4, 1024, 128, dtype=torch.bfloat16)
    compiled, generated, _ = compile_for_target(
        attention.kernel, (q, q, q, 0.08, True, q), {"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3, tma="rows"
    )
    assert "tl.reshape" not in generated.source and generated.source.count("_desc.load(") == 5
    assert compiled.asm["ttgir"].count("async_tma_copy_global_to_local") >= 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_mode_attention_matches_sdpa():
    torch.manual_seed(0)
    kernel = nd.make(attention.arrangement, attention.application, attention.tensors(), num_warps=8, num_stages=3)
    kernel.tma = "rows"
    for causal, s in ((True, 1024), (True, 1000), (False, 512)):
        q, k, v = (torch.randn(2, 4, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        for _ in range(2):  # the first call, then the warm launcher with descriptors rebuilt per call
            o = torch.empty_like(q)
            kernel(q, k, v, 1 / math.sqrt(128), causal, o, BLOCK_M=128, BLOCK_N=64)
            assert (o.double() - want).abs().max().item() < 2e-2


def test_hoisting_moves_only_loads_whose_offsets_are_ready():
    import ast

    from ninefold.dsl.backends.triton_codegen import _hoist_descriptor_loads

    body = ast.parse(
        "s = a + 1\n"
        "k_0 = k_desc.load([j * 4, 0])\n"  # offsets ready at the top: moves
        "m = s * 2\n"
        "v_0 = tl.reshape(v_desc.load([m, 0]), (4, 8))\n"  # reads m, assigned above: stays
        "w = k_0 + v_0\n"
        "u_0 = u_desc.load([w, 0])\n"  # reads w: stays
    ).body
    moved = [ast.unparse(s).split(" =")[0] for s in _hoist_descriptor_loads(body)]
    assert moved == ["k_0", "s", "m", "v_0", "w", "u_0"]


HOISTED = """
import math, torch
import ninefold.dsl as nd
from ninefold.ops.kernels import attention as A
torch.manual_seed(0)
kernel = nd.make(A.arrangement, A.application, A.tensors(), num_warps=4, num_stages=2)
kernel.tma, kernel.hoist = "rows", True
for causal, s in ((True, 256), (False, 96)):
    q, k, v = (torch.randn(1, 2, s, 64, dtype=torch.float16) for _ in range(3))
    o = torch.empty_like(q)
    kernel(q, k, v, 1 / math.sqrt(64), causal, o, BLOCK_M=64, BLOCK_N=32, backend="triton")
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    print("error", (o.double() - want).abs().max().item())
for key, value in kernel._cache.items():
    if isinstance(key, tuple) and key[0] == "triton":
        lines = [line.strip() for line in value[0].source.splitlines()]
        first = next(i for i, line in enumerate(lines) if line.startswith("for j in range("))
        print("loop", lines[first + 1][:3], lines[first + 2][:3])
"""


def test_hoisted_tma_attention_requests_key_and_value_first_and_is_right():
    done = subprocess.run([sys.executable, "-c", HOISTED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert all(float(line[1]) < 2e-3 for line in lines if line[0] == "error")
    loops = [line[1:] for line in lines if line[0] == "loop"]
    assert loops and all(loop == ["k_0", "v_0"] for loop in loops), loops
