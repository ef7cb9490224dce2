"""The benchmark's warp-specialized attention rows (``--sweep sdpa-ws``): checked on the CPU."""

import subprocess
import sys

import pytest

from ninefold.bench import dsl as bench


def _cpu_timer(fn):
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_warp_specialized_attention_is_causal_attention_under_the_interpreter():
    # the hand-written kernel with and without warp specialization, one masked loop and two loops
    code = (
        "import torch\n"
        "from ninefold.bench import dsl\n"
        "dsl.SWEEP_DEVICE = 'cpu'\n"
        "torch.manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 2, 256, 64, dtype=torch.float16) for _ in range(3))\n"
        "want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)\n"
        "for flags in (('ws',), ('ws', 'two-loops'), ()):\n"
        "    info = {}\n"
        "    got = dsl._ws_attention_call(q, k, v, 64, 32, 4, 2, flags, info)\n"
        "    print('ws-' + '-'.join(flags), (got.double() - want).abs().max().item())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    errors = dict(line.split() for line in done.stdout.splitlines())
    assert set(errors) == {"ws-ws", "ws-ws-two-loops", "ws-"}
    assert all(float(e) < 2e-3 for e in errors.values()), errors


def _compile_ws(bm, bn, warps, stages, ws=True, one_loop=True):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "seq": "i32", "total": "i32", "scale": "fp32"}
    const = {"BM": bm, "BN": bn, "D": 128, "WS": ws, "ONE_LOOP": one_loop}
    sig.update({name: "constexpr" for name in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    return triton.compile(ASTSource(bench._ws_attention, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


@pytest.mark.parametrize("bm,bn,stages", [(128, 64, 2), (128, 128, 2)])
def test_warp_specialized_attention_compiles_to_producer_and_two_consumers_for_sm90(bm, bn, stages):
    compiled = _compile_ws(bm, bn, 4, stages)
    info = bench._compiled_info(compiled)
    assert info["num_warps"] == 12  # 4 asked for: a producer warpgroup and two consumer warpgroups
    assert info["setmaxnreg"] > 0 and "ttg.warp_specialize(" in compiled.asm["ttgir"]
    # data partitioning: each consumer warpgroup multiplies bm/2 query rows
    assert f"tensor<{bm // 2}x128xbf16, #ttg.dot_op" in compiled.asm["ttgir"]
    assert "cp.async.bulk.tensor" in compiled.asm["ptx"] and "wgmma.mma_async" in compiled.asm["ptx"]


def test_without_warp_specialize_the_kernel_keeps_its_warps():
    info = bench._compiled_info(_compile_ws(128, 64, 8, 3, ws=False))
    assert info["num_warps"] == 8 and info["setmaxnreg"] == 0


def test_two_warp_specialized_loops_fail_the_sm90_pass():
    # what the ONE_LOOP form works around (Triton 3.6 and 3.9 alike); the sweep reports such a
    # variant as a failed row
    pytest.importorskip("triton")
    with pytest.raises(Exception, match="PassManager::run failed"):
        _compile_ws(128, 64, 4, 2, one_loop=False)


def test_sdpa_ws_sweep_on_cpu_checks_its_rows(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "SWEEP_DEVICE", "cpu")
    monkeypatch.setattr(bench, "_gpu_time", _cpu_timer)
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path / "cache"))
    (block,) = bench.sweep_sdpa_ws(shrink=32)
    configs = [row["config"] for row in block["rows"]]
    assert configs[0] == "torch sdpa (as dispatched)" and configs[1].startswith("dsl pipelined 64x64")
    assert all(row["ok"] for row in block["rows"]), block["rows"]
