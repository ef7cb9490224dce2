"""bench.dsl_pingpong: attention with two query halves per program, checked on the CPU.

The hand-written Triton kernel and the DSL kernel run under Triton's interpreter (and the DSL one
on its cpu backend) against attention computed in float64, causal and not, at sizes that are not
multiples of the blocks; both compile for sm_90 through ``triton.compile`` without a GPU.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from ninefold.bench import dsl as bench
from ninefold.bench import dsl_pingpong as pp
from ninefold.ops.kernels import attention

INTERPRETED = """
import math, torch
from ninefold.bench import dsl as bench, dsl_pingpong as pp
torch.manual_seed(0)
cases = ((1, 2, 200, 32, 32, 16, True), (2, 1, 96, 16, 16, 16, False), (1, 1, 64, 16, 32, 16, True))
for dtype in (torch.float32, torch.float16):
    for b, h, s, d, bm, bn, issue_both in cases:
        for causal in (True, False):
            q, k, v = (torch.randn(b, h, s, d, dtype=dtype) for _ in range(3))
            want = bench._sdpa_float64(q, k, v, causal)
            got = pp.pair_attention(q, k, v, causal, bm, bn, 4, 2, issue_both=issue_both)
            print("hand", str(dtype)[6:], s, causal, bench.relative_error(got, want))
            o = torch.empty_like(q)
            pp.pair_kernel(4, 2, "rows", "hoist")(q, k, v, 1 / math.sqrt(d), causal, o, BLOCK_M=bm, BLOCK_N=bn,
                                                  backend="interpret")
            print("dsl", str(dtype)[6:], s, causal, bench.relative_error(o, want))
"""


def _interpreted(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.split() for line in done.stdout.splitlines()]


def test_both_kernels_are_attention_under_the_interpreter():
    lines = _interpreted(INTERPRETED)
    assert len(lines) == 2 * 2 * 3 * 2  # kernels x dtypes x shapes x causal
    for kind, dtype, s, causal, error in lines:
        limit = 1e-5 if dtype == "float32" else 5e-3
        assert float(error) < limit, (kind, dtype, s, causal, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dsl_pair_kernel_on_the_cpu_backend(dtype):
    torch.manual_seed(0)
    for s, causal in ((200, True), (200, False), (33, True)):
        q, k, v = (torch.randn(2, 3, s, 32, dtype=dtype) for _ in range(3))
        want = bench._sdpa_float64(q, k, v, causal)
        o = torch.empty_like(q)
        pp.pair_kernel(4, 2)(q, k, v, 1 / math.sqrt(32), causal, o, BLOCK_M=32, BLOCK_N=16)
        assert bench.relative_error(o, want) < {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]


def test_pipelined_unscaled_application_on_the_cpu_backend():
    torch.manual_seed(0)
    kernel = bench._fixed(attention.arrangement, pp.pipelined_unscaled_application, attention.tensors(), 4, 3)
    for s, causal in ((200, True), (72, False)):
        q, k, v = (torch.randn(1, 2, s, 32) for _ in range(3))
        o = torch.empty_like(q)
        kernel(q, k, v, 1 / math.sqrt(32), causal, o, BLOCK_M=32, BLOCK_N=16)
        assert bench.relative_error(o, bench._sdpa_float64(q, k, v, causal)) < 1e-5


ROWS = """
import json, torch
from ninefold.bench import dsl as bench, dsl_pingpong as pp
pp.DEVICE = bench.SWEEP_DEVICE = "cpu"
bench._gpu_time = lambda fn: 1e-3  # no GPU timer here: every row that passes its check reads 1 ms
bench.PROGRESS_LINES = False
rows = pp.attention_rows(b=1, h=2, s=128, d=16, dtype=torch.float16, hand=((32, 16, 4, 2, ()), (16, 32, 4, 2, ())),
                         dsl=((32, 16, 4, 2, "rows", "hoist"),), unscaled=((32, 16, 4, 2),))
print(pp.table(rows))
late = pp.attention_rows(b=1, h=1, s=64, d=16, dtype=torch.float16, deadline_s=0)
print(json.dumps([r.get("error", "")[:8] for r in late[1:]]))
print(json.dumps([{k: r.get(k) for k in ("config", "ok", "error")} for r in rows]))
"""


def test_rows_are_checked_then_timed_and_a_bad_configuration_is_a_row():
    done = subprocess.run([sys.executable, "-c", ROWS], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    rows = json.loads(done.stdout.splitlines()[-1])
    assert [r["config"] for r in rows] == [
        "torch sdpa (as dispatched)", "dsl pipelined 64x64 w4 s3 rows hoist (session 4 best)",
        "dsl pair 2x32x16 w4 s2 rows hoist", "dsl pipelined q-unscaled 32x16 w4 s2",
        "triton pair 2x32x16 w4 s2", "triton pair 2x16x32 w4 s2",
    ]
    late = json.loads(done.stdout.splitlines()[-2])  # past the deadline: every row after torch's skipped
    assert len(late) == 1 + len(pp.DSL_CONFIGS) + len(pp.UNSCALED_CONFIGS) + len(pp.HAND_CONFIGS)
    assert set(late) == {"skipped:"}
    ok = {r["config"]: r["ok"] for r in rows}
    assert ok["triton pair 2x16x32 w4 s2"] is False  # bn must divide bm
    assert "ValueError" in rows[5]["error"]
    assert all(value for label, value in ok.items() if label != "triton pair 2x16x32 w4 s2")
    assert "1.000" in done.stdout  # the table's ms column


MAIN = """
import sys, torch
from ninefold.bench import dsl as bench, dsl_pingpong as pp
pp.DEVICE = bench.SWEEP_DEVICE = "cpu"
bench._gpu_time = lambda fn: 1e-3
pp.HAND_CONFIGS, pp.DSL_CONFIGS, pp.UNSCALED_CONFIGS = ((32, 16, 4, 2, ()),), ((32, 16, 4, 2),), ()
pp.STAGES_SET = {"pipelined": (("pipelined", 32, 16, 4, 3),), "dsl": (), "hand": (), "unscaled": ()}
pp.main(["--shape", "1,1,128,16", "--out", sys.argv[1]])
pp.main(["--shape", "1,1,128,16", "--set", "stages"])
"""


def test_main_prints_the_table_and_writes_json(tmp_path):
    import json

    done = subprocess.run([sys.executable, "-c", MAIN, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sdpa causal B1 H1 S128 D16 float16" in done.stdout
    report = json.loads((tmp_path / "dsl_pingpong.json").read_text())
    assert [r["config"] for r in report["rows"]] == [
        "torch sdpa (as dispatched)", "dsl pipelined 64x64 w4 s3 rows hoist (session 4 best)",
        "dsl pair 2x32x16 w4 s2", "triton pair 2x32x16 w4 s2"]
    assert all(r["ok"] and r["seconds"] == 1e-3 for r in report["rows"])
    assert "dsl pipelined 32x16 w4 s3 " in done.stdout and done.stdout.count("dsl pair") == 2  # --set stages


def test_pair_attention_rejects_bad_input():
    q = torch.empty(1, 2, 64, 16)
    with pytest.raises(ValueError, match="q/k/v"):
        pp.pair_attention(q, torch.empty(1, 2, 32, 16), q, True, 32, 16, 4, 2)
    with pytest.raises(ValueError, match="bn"):
        pp.pair_attention(q, q, q, True, 32, 64, 4, 2)


def _compile_hand(bm, bn, warps, stages):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = pp._pair_attention.arg_names
    sig = {"q_desc": f"tensordesc<bf16[{bm},128]>", "k_desc": f"tensordesc<bf16[{bn},128]>",
           "v_desc": f"tensordesc<bf16[{bn},128]>", "o_ptr": "*bf16", "seq": "i32", "scale": "fp32"}
    const = {"BM": bm, "BN": bn, "D": 128, "CAUSAL": True, "EVEN": True, "ISSUE_BOTH": True}
    sig.update({name: "constexpr" for name in const})
    attrs = {(names.index("o_ptr"),): [["tt.divisibility", 16]], (names.index("seq"),): [["tt.divisibility", 16]]}
    constants = {(names.index(name),): value for name, value in const.items()}
    return triton.compile(ASTSource(pp._pair_attention, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def test_hand_written_pair_kernel_compiles_for_sm90():
    ptx = _compile_hand(64, 64, 8, 2).asm["ptx"]
    assert ".target sm_90" in ptx and "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx


def test_dsl_pair_kernel_compiles_for_sm90_with_tma_rows():
    from ninefold.dsl.backends.triton import compile_for_target

    q = torch.empty(4, 32, 4096, 128, dtype=torch.bfloat16)
    compiled, generated, _ = compile_for_target(pp.pair_kernel(8, 2, "rows", "hoist"), (q, q, q, 0.08, True, q),
                                                {"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2, tma="rows")
    assert "q_desc.load(" in generated.source and "tl.reshape" not in generated.source
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    assert compiled.asm["ttgir"].count("async_tma_copy_global_to_local") >= 2 + 2 * 3 - 1  # q halves, k/v per loop
