"""``Kernel.warp_specialize``: the dot loop as ``tl.range(..., warp_specialize=True)`` with TMA
descriptors made in the kernel (triton backend, sm_90); other backends unaffected."""

import math
import os
import subprocess
import sys

import pytest
import torch

import ninefold.dsl as nd
from ninefold.bench import dsl as bench
from ninefold.dsl.backends.triton import compile_for_target
from ninefold.ops.kernels import attention


def _one_loop_kernel(**options):
    kernel = nd.make(attention.arrangement, bench._attention_one_loop, attention.tensors(), **options)
    kernel.warp_specialize = True
    return kernel


INTERPRETED = """
import math, torch
import ninefold.dsl as nd
from ninefold.ops.kernels import attention as A
from ninefold.bench import dsl as bench
torch.manual_seed(0)
kernel = nd.make(A.arrangement, bench._attention_one_loop, A.tensors(), num_warps=4, num_stages=2)
kernel.warp_specialize = True
for causal, s in ((True, 256), (True, 200), (False, 96)):
    q, k, v = (torch.randn(1, 2, s, 64, dtype=torch.float16) for _ in range(3))
    o = torch.empty_like(q)
    kernel(q, k, v, 1 / math.sqrt(64), causal, o, BLOCK_M=64, BLOCK_N=32, backend="triton")
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    print("error", (o.double() - want).abs().max().item())
for key, value in kernel._cache.items():
    if isinstance(key, tuple) and key[0] == "triton":
        src = value[0].source
        print("source", src.count("tl.make_tensor_descriptor("), src.count("warp_specialize=True"), src.count("_desc,"))
"""


def test_warp_specialized_attention_is_right_under_the_interpreter():
    # S = 200 is not a multiple of the blocks: full-shape descriptors there, [B*H*S, D] rows elsewhere
    done = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    errors = [float(line[1]) for line in lines if line[0] == "error"]
    assert len(errors) == 3 and all(e < 2e-3 for e in errors), errors
    sources = [line[1:] for line in lines if line[0] == "source"]
    # q, k and v descriptors made in the kernel, one loop marked, no descriptor arguments
    assert sources and all(s == ["3", "1", "0"] for s in sources), sources


@pytest.mark.parametrize("blocks,stages", [((128, 64), 2), ((128, 128), 2)])
def test_warp_specialized_attention_compiles_to_a_producer_and_two_consumers_for_sm90(blocks, stages):
    q = torch.empty(2, 4, 1024, 128, dtype=torch.bfloat16)
    compiled, generated, _ = compile_for_target(
        _one_loop_kernel(), (q, q, q, 0.08, True, q), {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]}, num_warps=4,
        num_stages=stages,
    )
    assert "tl.range(n_tiles, warp_specialize=True)" in generated.source
    assert generated.source.count("tl.make_tensor_descriptor(") == 3
    assert compiled.metadata.num_warps == 12  # 4 asked for: producer + two consumer warpgroups
    assert "setmaxnreg" in compiled.asm["ptx"] and "ttg.warp_specialize(" in compiled.asm["ttgir"]
    assert f"tensor<{blocks[0] // 2}x128xbf16, #ttg.dot_op" in compiled.asm["ttgir"]  # rows split in two
    assert "cp.async.bulk.tensor" in compiled.asm["ptx"]


def test_warp_specialize_needs_exactly_one_dot_loop():
    # the ops kernel's application has two (unmasked, then masked tiles): Triton's pass would fail
    kernel = nd.make(attention.arrangement, attention.application, attention.tensors())
    kernel.warp_specialize = True
    q = torch.empty(1, 2, 256, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="exactly one loop with a dot.*it has 2"):
        compile_for_target(kernel, (q, q, q, 0.125, True, q), {"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=2)


def test_cpu_backend_ignores_warp_specialize():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 160, 32) for _ in range(3))
    o = torch.empty_like(q)
    _one_loop_kernel()(q, k, v, 1 / math.sqrt(32), True, o, BLOCK_M=64, BLOCK_N=32)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert (o.double() - want).abs().max().item() < 1e-5


def test_without_the_flag_the_source_has_no_warp_specialization():
    kernel = nd.make(attention.arrangement, bench._attention_one_loop, attention.tensors())
    q = torch.empty(2, 4, 1024, 128, dtype=torch.bfloat16)
    _, generated, _ = compile_for_target(kernel, (q, q, q, 0.08, True, q), {"BLOCK_M": 128, "BLOCK_N": 64},
                                         num_warps=4, num_stages=2, tma="rows")
    assert "warp_specialize=True" not in generated.source and "tl.make_tensor_descriptor(" not in generated.source
    assert "q_desc," in generated.source  # host-made descriptors are arguments


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_warp_specialized_attention_matches_sdpa():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1024, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    kernel = _one_loop_kernel(num_warps=4, num_stages=2)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    for _ in range(2):  # first call, then the cached launcher
        o = torch.empty_like(q)
        kernel(q, k, v, 1 / math.sqrt(128), True, o, BLOCK_M=128, BLOCK_N=64)
        assert (o.double() - want).abs().max().item() < 3e-2


def test_tuner_adds_warp_specialized_candidates_only_on_request(monkeypatch):
    from ninefold.dsl import tuning

    q = torch.empty(2, 4, 1024, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(tuning, "tma_candidates_apply", lambda kernel, bound: True)  # as on an sm_90 GPU
    one_loop = nd.make(attention.arrangement, bench._attention_one_loop, attention.tensors())

    def ws_configs(kernel):
        return [c for c in tuning.candidates(kernel, kernel.bind((q, q, q, 0.08, True, q), {})) if c.get("ws")]

    monkeypatch.delenv("NINEFOLD_DSL_TUNE_WS", raising=False)
    assert not ws_configs(one_loop)  # off by default (they lost on the H200)
    monkeypatch.setenv("NINEFOLD_DSL_TUNE_WS", "1")
    configs = tuning.candidates(one_loop, one_loop.bind((q, q, q, 0.08, True, q), {}))
    ws = [c for c in configs if c.get("ws")]
    tma_tiles = [c["meta"] for c in configs if c.get("tma") and c.get("grouped", True) and not c.get("ws")]
    assert ws and all(c["num_warps"] == 4 and c["num_stages"] == 2 and c["tma"] == "rows" for c in ws)
    assert [c["meta"] for c in ws] == tma_tiles  # every TMA tile shape
    assert configs.index(ws[0]) > max(i for i, c in enumerate(configs) if not c.get("ws"))  # after the others
    # the ops kernel's application has two dot loops; a kernel fixed at 8 warps: no such candidates
    assert not ws_configs(nd.make(attention.arrangement, attention.application, attention.tensors()))
    assert not ws_configs(nd.make(attention.arrangement, bench._attention_one_loop, attention.tensors(), num_warps=8))


def test_warp_specialize_refuses_more_than_two_stages():
    # 3 and 4 stages computed NaN on the H200 (Triton 3.6), DSL and hand-written kernels alike
    q = torch.empty(2, 4, 1024, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="warp_specialize with num_stages=3; accepted: num_stages <= 2"):
        compile_for_target(_one_loop_kernel(), (q, q, q, 0.08, True, q), {"BLOCK_M": 128, "BLOCK_N": 64},
                           num_warps=4, num_stages=3)
