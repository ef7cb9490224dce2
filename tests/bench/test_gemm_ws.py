"""``ninefold.bench.gemm_ws``'s kernel: values under Triton's interpreter, and the warp-specialized form
it compiles to for sm_90 (running it needs the GPU)."""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

_CHECK = """
import torch, triton
from ninefold.bench.gemm_ws import launch
triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
torch.manual_seed(0)
for m, n, k, cfg in [(40, 96, 256, (128, 64, 64, 2, 1, True)), (130, 64, 512, (128, 64, 64, 2, 2, True)),
                     (70, 128, 256, (256, 64, 64, 3, 4, False)), (130, 64, 512, (128, 64, 64, 3, 4, True, True)),
                     (70, 128, 1024, (256, 64, 64, 3, 16, False, True))]:  # the last two: partials + reduce
    x, w = torch.randn(m, k).half(), torch.randn(n, k).half()
    y = torch.full((m, n), float("nan"), dtype=torch.float16)
    bm, bn, split = cfg[0], cfg[1], cfg[4]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    ws, count = torch.empty(tiles * split * bm * bn), torch.zeros(64, dtype=torch.int32)
    for _ in range(2):  # the second call finds the counters reset by the first
        launch(x, w, y, cfg, ws, count)
        err = ((y.float() - x.float() @ w.float().T).abs().max() / (x.float() @ w.float().T).abs().max()).item()
        assert err < 2e-3 and not count.any(), (m, n, k, cfg, err)
print("ok")
"""


def test_every_split_and_tile_computes_the_product_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.parametrize("split, partials", [(1, False), (4, True)])
def test_warp_specialization_gives_a_producer_and_two_consumer_warpgroups_on_sm90(split, partials):
    from triton.backends.compiler import GPUTarget

    from ninefold.bench.gemm_ws import gemm_ws_kernel

    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32",
                 "M": "i32", "N": "i32", "K": "i32", "SPLIT_STEPS": "i32", "SPLIT_K": "constexpr",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "STAGES": "constexpr",
                 "WS": "constexpr", "PARTIALS": "constexpr"}
    warps = {}
    for ws in (True, False):
        constexprs = {"SPLIT_K": split, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 2, "WS": ws,
                      "PARTIALS": partials}
        source = triton.compiler.ASTSource(fn=gemm_ws_kernel, signature=signature, constexprs=constexprs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
        warps[ws] = (kernel.metadata.num_warps, kernel.asm["ptx"].count("setmaxnreg") > 0)
    assert warps == {True: (12, True), False: (4, False)}
