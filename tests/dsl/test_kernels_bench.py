"""python -m ninefold.bench.dsl: the --cpu mode end to end, and its NineToothed loader without NineToothed."""

import json
import subprocess
import sys

import pytest
import torch

from ninefold.bench import dsl as bench


@pytest.mark.slow
def test_cpu_mode_writes_table_json_and_plot(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ninefold.bench.dsl", "--cpu", "--only", "add", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "add/cpu" in done.stdout and "ceilings:" in done.stdout
    report = json.loads((tmp_path / "dsl_bench_cpu.json").read_text())
    (row,) = report["workloads"]
    assert row["name"] == "add"
    nf, peer = row["results"]["ninefold"], row["results"]["torch"]
    assert nf["ok"] and peer["ok"] and nf["rel_error"] <= 1e-4
    assert nf["seconds"] > 0 and 0 < nf["fraction_of_ceiling"]
    assert isinstance(nf["cached_first_call_s"], float)  # the second process ran the kernel
    assert (tmp_path / "dsl_bench_cpu.png").read_bytes()[:4] == b"\x89PNG"


def test_ninetoothed_column_is_na_when_it_does_not_import(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ninetoothed", None)  # makes `import ninetoothed` fail
    result = bench.ninetoothed_kernels(tmp_path)
    assert isinstance(result, str) and result.startswith("n/a")


def test_relative_error_and_fraction():
    want = torch.tensor([1.0, -4.0])
    assert bench.relative_error(torch.tensor([1.0, -3.0]), want) == 0.25
    w = bench._mm("cpu", torch.float32, 2, 3, 4)
    ceilings = {"copy_bytes_per_s": 1.0, "mm_flops_per_s": {"torch.float32": 48.0}}
    assert bench._fraction(w, 1.0, ceilings) == 1.0  # 2*2*3*4 = 48 flops in 1 s at 48 flop/s
    assert bench._fraction(w, 2.0, ceilings) == 0.5


def _cpu_timer(fn):
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_sweeps_check_every_configuration_on_cpu_tensors(tmp_path, monkeypatch):
    # the sweeps' own code (fixed configurations, multi-row variants, re-tuning) on the cpu
    # backend; only the CUDA stopwatch is replaced by a CPU one
    monkeypatch.setattr(bench, "SWEEP_DEVICE", "cpu")
    monkeypatch.setattr(bench, "_gpu_time", _cpu_timer)
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path / "cache"))
    report = bench.run_sweep("memory", str(tmp_path), shrink=128)  # (the sdpa sweep is slow on CPUs)
    report["sweeps"] += bench.sweep_mm(shrink=128)
    names = [block["workload"] for block in report["sweeps"]]
    assert {n.split()[0] for n in names} == {"add", "silu", "rms_norm", "softmax", "rope", "mm"}
    for block in report["sweeps"]:
        for row in block["rows"]:
            assert row["ok"], (block["workload"], row)
    rms = next(b for b in report["sweeps"] if b["workload"].startswith("rms_norm"))
    assert any(r["config"] == "8 rows w16" for r in rms["rows"])
    assert sum(r["config"].startswith("re-tuned") for r in report["sweeps"][-1]["rows"]) == bench.TUNE_REPEATS
    assert json.loads((tmp_path / "dsl_sweep.json").read_text())["sweeps"]


def test_plain_triton_attention_references_are_causal_attention():
    # the sweep's hand-written Triton kernels (pointer and TMA-descriptor loads) under Triton's
    # interpreter, against float64 torch
    code = (
        "import torch, math\n"
        "from ninefold.bench import dsl\n"
        "torch.manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 2, 256, 64, dtype=torch.float16) for _ in range(3))\n"
        "want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)\n"
        "for mode in ('pointers', 'tma'):\n"
        "    got = dsl._plain_attention(q, k, v, mode, 128, 64, 4, 2)\n"
        "    print(mode, (got.double() - want).abs().max().item())\n"
        "for flags in ((), ('pipe', 'lazy'), ('pipe', 'persist')):\n"
        "    got = dsl._fa_attention_call(q, k, v, 64, 32, 4, 2, flags)\n"
        "    print('fa-' + '-'.join(flags), (got.double() - want).abs().max().item())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    errors = dict(line.split() for line in done.stdout.splitlines())
    assert set(errors) == {"pointers", "tma", "fa-", "fa-pipe-lazy", "fa-pipe-persist"}
    assert all(float(e) < 2e-3 for e in errors.values()), errors


def test_hand_written_fa_attention_compiles_for_sm90():
    # every flag of the FA-trick kernel at once (pipelined q k^T, lazy rescale, persistent grid)
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"q_desc": "tensordesc<bf16[128, 128]>", "k_desc": "tensordesc<bf16[64, 128]>", "v_desc": "tensordesc<bf16[64, 128]>",
           "o_ptr": "*bf16", "seq": "i32", "heads": "i32", "scale": "fp32"}
    const = {"BM": 128, "BN": 64, "D": 128, "PIPE": True, "LAZY": True, "PERSIST": True, "LPT": False}
    sig.update({name: "constexpr" for name in const})
    compiled = triton.compile(ASTSource(bench._fa_attention, sig, const), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "num_stages": 3})
    assert "wgmma.mma_async" in compiled.asm["ptx"] and "cp.async.bulk.tensor" in compiled.asm["ptx"]


def test_longest_first_arrangement_and_torch_rows_on_cpu(monkeypatch):
    # the sweep's reordered DSL kernel and its torch rows, checked against float64 on the cpu
    import math

    import ninefold.dsl as nd
    from ninefold.ops.kernels import attention

    monkeypatch.setattr(bench, "_gpu_time", _cpu_timer)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 160, 32) for _ in range(3))
    want = bench._sdpa_float64(q, k, v, True)
    assert want.dtype == torch.float64
    kernel = nd.make(bench._lpt_arrangement, attention.application, attention.tensors(), num_warps=4, num_stages=2)
    assert "program_0 = program\n" in kernel.source  # the query-block level is the outermost (slowest) one
    o = torch.empty_like(q)
    kernel(q, k, v, 1 / math.sqrt(32), True, o, BLOCK_M=64, BLOCK_N=32)
    assert (o.double() - want).abs().max().item() < 1e-5
    rows = bench._torch_sdpa_rows(q, k, v, True, want, torch.float32, 1.0)
    assert rows[0]["ok"] and rows[0]["config"].startswith("torch sdpa (dispatch: ")
    assert [r["config"] for r in rows[1:]] == ["torch sdpa flash_attention", "torch sdpa efficient_attention", "torch sdpa cudnn_attention"]


def test_rms_norm_timers_time_every_call_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "SWEEP_DEVICE", "cpu")
    monkeypatch.setattr(bench, "_gpu_time", _cpu_timer)
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))
    (block,) = bench.rms_norm_timers(shrink=64, repeats=2)
    labels = [r["config"] for r in block["rows"]]
    assert labels[0] == "ninefold rms_norm (tuned)" and labels[-1] == "copy of the same bytes"
    for row in block["rows"]:
        assert row["ok"] and len(row["do_bench_s"]) == 2 and row["host_s_per_call"] > 0, row
        assert bench._timer_line(row).strip().startswith(row["config"])


SWEEP_APPS = """
import math, sys, torch
import ninefold.dsl as nd
from ninefold.ops.kernels import attention as A
from ninefold.bench import dsl as bench
torch.manual_seed(0)
backend = sys.argv[1]
dtype = torch.float16 if backend == "triton" else torch.float32
for app in (bench._attention_loads_first, bench._attention_pipelined):
    for grouped in (True, False):
        kernel = nd.make(A.arrangement, app, A.tensors(), num_warps=4, num_stages=2)
        kernel.grouped = grouped
        kernel.tma = "rows" if backend == "triton" else False
        for causal, s, sk, bm, bn in ((True, 256, 256, 64, 32), (True, 200, 200, 64, 32), (True, 64, 160, 32, 32), (False, 96, 96, 64, 32)):
            q = torch.randn(2, 2, s, 32, dtype=dtype)
            k, v = (torch.randn(2, 2, sk, 32, dtype=dtype) for _ in range(2))
            o = torch.empty_like(q)
            kernel(q, k, v, 1 / math.sqrt(32), causal, o, BLOCK_M=bm, BLOCK_N=bn, backend=backend)
            mask = torch.ones(s, sk, dtype=torch.bool).tril(sk - s) if causal else None
            want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
            print(app.__name__, grouped, causal, s, sk, (o.double() - want).abs().max().item())
"""


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_sweep_attention_applications_match_float64(backend):
    # the sweep's DSL variants (tiles loaded first; next scores before this softmax, last tile
    # peeled) in both launch orders, on the cpu backend and (TMA rows mode) under the interpreter
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1" if backend == "triton" else "0"}
    done = subprocess.run([sys.executable, "-c", SWEEP_APPS, backend], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = [float(line.split()[-1]) for line in done.stdout.splitlines()]
    assert len(errors) == 16 and max(errors) < (2e-3 if backend == "triton" else 1e-5), done.stdout


def test_pipelined_attention_in_rows_mode_compiles_for_sm90_without_grouping():
    import ninefold.dsl as nd
    from ninefold.dsl.backends.triton import compile_for_target
    from ninefold.ops.kernels import attention

    kernel = nd.make(attention.arrangement, bench._attention_pipelined, attention.tensors())
    kernel.grouped = False
    q = torch.empty(2, 4, 1024, 128, dtype=torch.bfloat16)
    compiled, generated, _ = compile_for_target(
        kernel, (q, q, q, 0.08, True, q), {"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3, tma="rows"
    )
    assert "group_width" not in generated.source and "tl.reshape" not in generated.source
    assert compiled.asm["ttgir"].count("async_tma_copy_global_to_local") >= 5
    kernel.grouped = True
    _, grouped, _ = compile_for_target(kernel, (q, q, q, 0.08, True, q), {"BLOCK_M": 128, "BLOCK_N": 64}, tma="rows")
    assert "group_width" in grouped.source
