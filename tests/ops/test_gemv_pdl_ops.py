"""The one-row GEMV implementations (``ninefold.ops.triton.gemv_pdl_ops``) behind ``ops.linear``,
``ops.add_rms_norm_linear`` and ``ops.silu_and_mul_linear``, against float64 references."""

import os

import pytest
import torch

pytest.importorskip("triton")

from ninefold.ops.triton import gemv_pdl_ops as go  # noqa: E402

from .helpers import run_interpreted  # noqa: E402

# Runs with TRITON_INTERPRET=1: the implementations register for the CPU in float32 (pinned).
CHECK = r"""
import torch
import ninefold.ops as ops
from ninefold.ops import references as ref
torch.manual_seed(0)
from ninefold.ops.triton import gemv_pdl_ops as go
n, k = 40, 512
w, g = torch.randn(n, k), torch.randn(k)
for prologue in ("none", "add_rms_norm", "silu_and_mul"):  # the few-rows GEMV runs where a table lists the call
    for bucket in (4, 16, 32):
        go.ROWS_OVERRIDE[(n, k, prologue, bucket)] = (16, 128, 2, 4, 2)
with ops.use(linear="triton_row", add_rms_norm_linear="triton", silu_and_mul_linear="triton"):
    for rows in (1, 3, 16, 21):  # one row: the batch-1 GEMV; 2..32: the few-rows GEMV
        x, r, a = torch.randn(rows, k), torch.randn(rows, k), torch.randn(rows, 2 * k)
        assert ops.choose("add_rms_norm_linear", x, r, g, w, 1e-5, None) == "triton"
        assert ops.choose("silu_and_mul_linear", a, w, None) == "triton"
        assert ops.choose("linear", x, w, None) == "triton_row"
        y, total = ops.add_rms_norm_linear(x, r, g, w, 1e-5)
        normed, want_total = ref.add_rms_norm(x, r, g, 1e-5)
        assert y.shape == (rows, n) and total.shape == (rows, k)
        assert torch.allclose(total.double(), want_total, atol=1e-6), ("residual", rows)
        assert torch.allclose(y.double(), ref.linear(normed, w), atol=1e-3, rtol=1e-4), ("add_rms_norm_linear", rows)
        y = ops.silu_and_mul_linear(a, w)
        assert torch.allclose(y.double(), ref.linear(ref.silu_and_mul(a), w), atol=1e-3, rtol=1e-4), ("silu", rows)
        x3 = torch.randn(rows, 1, k)
        assert torch.allclose(ops.linear(x3, w).double(), ref.linear(x3, w), atol=1e-3, rtol=1e-4), ("linear", rows)
    # 33 rows, a rows bucket no table lists, or the few-rows path turned off: the pinned implementation steps
    # aside (with a warning)
    import os
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x2, r2 = torch.randn(33, k), torch.randn(33, k)
        assert ops.choose("add_rms_norm_linear", x2, r2, g, w, 1e-5, None) == "vendor"
        assert ops.choose("add_rms_norm_linear", x2[:2], r2[:2], g, w, 1e-5, None) == "vendor"  # bucket 2
        os.environ["NINEFOLD_GEMV_ROWS"] = "0"
        assert ops.choose("add_rms_norm_linear", x2[:3], r2[:3], g, w, 1e-5, None) == "vendor"
        assert ops.choose("add_rms_norm_linear", x2[:1], r2[:1], g, w, 1e-5, None) == "triton"
print("ok")
"""


def test_implementations_match_float64_in_the_interpreter():
    done = run_interpreted(["-c", CHECK])
    assert done.stdout.strip().endswith("ok"), done.stdout[-3000:]


# FP8 weights: 1..16 rows through the GEMVs streaming the codes (no table entry needed), more rows through the
# pairs (weight-only, x float32).
CHECK_FP8 = r"""
import warnings
import torch
import ninefold.ops as ops
from ninefold.ops import references as ref
torch.manual_seed(0)
n, k = 40, 512
w8 = ops.Fp8Weight.quantize(torch.randn(n, k))
dense = w8.dequantize(torch.float64)
g = torch.randn(k)
from ninefold.ops.triton import gemv_pdl_ops as go
for prologue in ("none", "add_rms_norm", "silu_and_mul"):  # FP8 GEMVs run only where a launch table lists the call
    go.OVERRIDE[(n, k, prologue, "fp8")] = (16, 128, 2, 4, 2, 0)
    for bucket in (4, 16):
        go.ROWS_OVERRIDE[(n, k, prologue, bucket, "fp8")] = (16, 128, 1, 4, 2)
with ops.use(linear_fp8="triton_pdl", add_rms_norm_linear="triton", silu_and_mul_linear="triton"):
    for rows in (1, 3, 16):
        x, r, a = torch.randn(rows, k), torch.randn(rows, k), torch.randn(rows, 2 * k)
        assert ops.choose("linear_fp8", x, w8, None) == "triton_pdl"
        assert ops.choose("add_rms_norm_linear", x, r, g, w8, 1e-5, None) == "triton"
        assert ops.choose("silu_and_mul_linear", a, w8, None) == "triton"
        y = ops.linear_fp8(x, w8)
        assert torch.allclose(y.double(), x.double() @ dense.T, atol=1e-3, rtol=1e-4), ("linear_fp8", rows)
        y, total = ops.add_rms_norm_linear(x, r, g, w8, 1e-5)
        normed, want_total = ref.add_rms_norm(x, r, g, 1e-5)
        assert torch.allclose(total.double(), want_total, atol=1e-6), ("residual", rows)
        assert torch.allclose(y.double(), normed @ dense.T, atol=1e-3, rtol=1e-4), ("add_rms_norm_linear", rows)
        y = ops.silu_and_mul_linear(a, w8)
        assert torch.allclose(y.double(), ref.silu_and_mul(a) @ dense.T, atol=1e-3, rtol=1e-4), ("silu", rows)
    with warnings.catch_warnings():  # 17 rows, or a call no table lists: the pinned GEMVs step aside for the pair
        warnings.simplefilter("ignore")
        x, r = torch.randn(17, k), torch.randn(17, k)
        assert ops.choose("add_rms_norm_linear", x, r, g, w8, 1e-5, None) == "vendor"
        assert ops.choose("linear_fp8", x, w8, None) != "triton_pdl"
        y, _ = ops.add_rms_norm_linear(x, r, g, w8, 1e-5)
        assert torch.allclose(y.double(), ref.add_rms_norm(x, r, g, 1e-5)[0] @ dense.T, atol=1e-3, rtol=1e-4)
        other = ops.Fp8Weight.quantize(torch.randn(24, k))
        assert ops.choose("add_rms_norm_linear", x[:1], r[:1], g, other, 1e-5, None) == "vendor"
        assert ops.choose("linear_fp8", x[:2], other, None) != "triton_pdl"
print("ok")
"""


def test_fp8_weights_match_float64_in_the_interpreter():
    done = run_interpreted(["-c", CHECK_FP8])
    assert done.stdout.strip().endswith("ok"), done.stdout[-3000:]


@pytest.mark.parametrize("args, reason", [
    ((torch.randn(33, 64), torch.randn(8, 64)), "33 rows: at most 32"),
    ((torch.randn(1, 64), torch.randn(8, 64), torch.randn(8)), "no bias"),
    ((torch.randn(1, 64), torch.randn(8, 64)), "CUDA only"),
])
def test_supports_names_the_reason(args, reason):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter accepts CPU tensors")
    assert reason in go.supports(*args)
    assert reason in go.supports_silu_and_mul_linear(torch.cat([args[0], args[0]], -1), *args[1:])


def test_strided_residual_is_refused():
    x, w, g = torch.randn(1, 64), torch.randn(8, 64), torch.randn(64)
    residual = torch.randn(1, 128)[:, ::2]
    assert "contiguous" in go.supports_add_rms_norm_linear(x, residual, g, w)


def test_configs_cover_their_shapes():
    for key, (_bn, bk, sk, _w, _s, variant) in [*go.TABLE.items(), *go.FP8_TABLE.items()]:
        n, k = key[:2]
        assert k % (bk * sk) == 0 and variant in (0, 1, 2), key
        assert variant != 2 or k // sk >= 2 * bk, key
    assert go.config(1000, 4096)[2] == 2 and go.config(28672, 8192)[2] == 1
    assert go.config(24, 64)[1] == 64


def test_pdl_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("NINEFOLD_GEMV_PDL", raising=False)
    assert go.pdl_enabled()
    monkeypatch.setenv("NINEFOLD_GEMV_PDL", "0")
    assert not go.pdl_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weights, rows", [("bf16", 1), ("fp8", 1), ("fp8", 5), ("fp8", 16)])
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_cuda_fused_ops_match_float64_and_replay_in_a_graph(pdl, weights, rows, monkeypatch):
    """One row (the one-row GEMV) and, for FP8 weights, 2..16 rows (the few-rows GEMV, no table entry needed)."""
    import ninefold.ops as ops
    from ninefold.ops import references as ref
    from ninefold.ops.triton import gemv_pdl

    if pdl == "1" and not gemv_pdl.pdl_available():
        pytest.skip("no PDL here")
    if weights == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 codes convert on compute capability 8.9+")
    monkeypatch.setenv("NINEFOLD_GEMV_PDL", pdl)
    torch.manual_seed(0)
    dev, dt, k, n = "cuda", torch.bfloat16, 4096, 6144
    x, r = (torch.randn(rows, k, device=dev, dtype=dt) for _ in range(2))
    g = torch.randn(k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) / 64
    w2 = torch.randn(k, n // 2, device=dev, dtype=dt) / 64
    w3 = torch.randn(n // 4, k, device=dev, dtype=dt) / 64
    if weights == "fp8":
        w, w2, w3 = (ops.Fp8Weight.quantize(t) for t in (w, w2, w3))
        dense = [t.dequantize(torch.float64).cpu() for t in (w, w2, w3)]
        for t, prologue in ((w, "add_rms_norm"), (w2, "silu_and_mul"), (w3, "none")):  # as a measured table would
            monkeypatch.setitem(go.OVERRIDE, (*t.shape, prologue, "fp8"), (16, 512, 1, 4, 2, 2))
            monkeypatch.setitem(go.ROWS_OVERRIDE, (*t.shape, prologue, go.rows_bucket(rows), "fp8"),
                                (32, 256, 1, 4, 3))
        assert ops.choose("linear_fp8", x, w3, None) == "triton_pdl"
    else:
        dense = [w, w2, w3]
    assert ops.choose("add_rms_norm_linear", x, r, g, w, 1e-5, None) == "triton"

    def step():
        y, total = ops.add_rms_norm_linear(x, r, g, w, 1e-5)
        out = ops.silu_and_mul_linear(y, w2)
        return out, y, total, (ops.linear_fp8(out, w3) if weights == "fp8" else ops.linear(out, w3))

    out, y, total, last = step()
    normed, want_total = ref.add_rms_norm(x, r, g, 1e-5)
    want = ref.linear(normed.to(dt), dense[0])
    assert torch.equal(total.cpu().double(), want_total)  # references are float64 on the CPU
    assert ((y.cpu().double() - want).abs().max() / want.abs().max()).item() < 2e-2
    want_out = ref.linear(ref.silu_and_mul(y).to(dt), dense[1])
    assert ((out.cpu().double() - want_out).abs().max() / want_out.abs().max()).item() < 2e-2
    want_last = ref.linear(out, dense[2])
    assert ((last.cpu().double() - want_last).abs().max() / want_last.abs().max()).item() < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, _, _, g_last = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(g_last, last)


def test_launch_table_file_and_override(tmp_path, monkeypatch):
    import json

    path = tmp_path / "table.json"
    path.write_text(json.dumps([{"n": 6144, "k": 4096, "prologue": "add_rms_norm", "config": [64, 128, 2, 8, 3, 1]}]))
    monkeypatch.setenv("NINEFOLD_GEMV_TABLE", str(path))
    assert go.config(6144, 4096, "add_rms_norm") == (64, 128, 2, 8, 3, 1)
    assert go.config(6144, 4096) == go.TABLE[(6144, 4096)]  # not in the file: the shipped table
    monkeypatch.setenv("NINEFOLD_GEMV_TABLE", "")
    assert go.config(6144, 4096, "add_rms_norm") == go.TABLE[(6144, 4096, "add_rms_norm")]
    monkeypatch.setenv("NINEFOLD_GEMV_TABLE", str(path))
    monkeypatch.setitem(go.OVERRIDE, (6144, 4096, "add_rms_norm"), (16, 256, 1, 4, 2, 0))
    assert go.config(6144, 4096, "add_rms_norm") == (16, 256, 1, 4, 2, 0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"n": 1, "k": 2, "prologue": "none", "config": [1, 2]}]))
    monkeypatch.setenv("NINEFOLD_GEMV_TABLE", str(bad))
    with pytest.raises(ValueError, match="NINEFOLD_GEMV_TABLE=.*6 integers"):
        go.config(1, 2)
    monkeypatch.setenv("NINEFOLD_GEMV_TABLE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="NINEFOLD_GEMV_TABLE=.*JSON list"):
        go.config(1, 2)


def test_fp8_entries_are_kept_apart_from_dense_ones_and_nothing_else_runs_fp8(tmp_path, monkeypatch):
    """An FP8 weight runs the GEMVs only with a configuration measured for FP8 codes; a dense entry of the same
    shape is not one."""
    import json

    monkeypatch.delenv("NINEFOLD_GEMV_TABLE", raising=False)
    monkeypatch.delenv("NINEFOLD_GEMV_ROWS_TABLE", raising=False)
    assert go.config(128256, 4096, "add_rms_norm", fp8=True) is None  # (a dense TABLE entry exists for it)
    assert go.config(128256, 4096, "add_rms_norm") is not None
    assert go.rows_config(6144, 4096, "add_rms_norm", 4, fp8=True) == ()
    one, rows = tmp_path / "one.json", tmp_path / "rows.json"
    one.write_text(json.dumps([{"n": 6144, "k": 4096, "prologue": "add_rms_norm", "weight": "fp8",
                                "config": [16, 1024, 1, 4, 2, 2]},
                               {"n": 6144, "k": 4096, "prologue": "add_rms_norm", "config": [64, 128, 2, 8, 3, 1]}]))
    rows.write_text(json.dumps([{"n": 6144, "k": 4096, "prologue": "none", "rows": 4, "weight": "fp8",
                                 "config": [32, 512, 1, 4, 3]},
                                {"n": 6144, "k": 4096, "prologue": "none", "rows": 16, "weight": "fp8", "config": []}]))
    monkeypatch.setenv("NINEFOLD_GEMV_TABLE", str(one))
    monkeypatch.setenv("NINEFOLD_GEMV_ROWS_TABLE", str(rows))
    assert go.config(6144, 4096, "add_rms_norm", fp8=True) == (16, 1024, 1, 4, 2, 2)  # the file before FP8_TABLE
    assert go.config(6144, 4096, "add_rms_norm") == (64, 128, 2, 8, 3, 1)
    assert go.config(6144, 4096, "none", fp8=True) == go.FP8_TABLE[(6144, 4096, "none", "fp8")]  # not in the file
    assert go.config(4096, 4096, "add_rms_norm", fp8=True) is None
    assert go.rows_config(6144, 4096, "none", 3, fp8=True) == (32, 512, 1, 4, 3)
    assert go.rows_config(6144, 4096, "none", 3) == ()  # the dense call is not listed
    assert go.rows_config(6144, 4096, "none", 16, fp8=True) == ()  # listed as declined


def test_rows_table_by_bucket_file_override_and_decline(tmp_path, monkeypatch):
    import json

    assert [go.rows_bucket(r) for r in (2, 3, 4, 5, 8, 9, 16, 17, 32)] == [2, 4, 4, 8, 8, 16, 16, 32, 32]
    monkeypatch.delenv("NINEFOLD_GEMV_ROWS_TABLE", raising=False)
    assert go.rows_config(4096, 4096, "none", 3) == ()  # listed nowhere: declined
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"n": 4096, "k": 4096, "prologue": "none", "rows": 4, "config": [64, 256, 4, 4, 4]},
                                {"n": 4096, "k": 4096, "prologue": "none", "rows": 16, "config": []}]))
    monkeypatch.setenv("NINEFOLD_GEMV_ROWS_TABLE", str(path))
    assert go.rows_config(4096, 4096, "none", 3) == (64, 256, 4, 4, 4)
    assert go.rows_config(4096, 4096, "none", 2) == ()  # bucket 2 is not in the file
    assert go.rows_config(4096, 4096, "none", 16) == ()
    monkeypatch.setitem(go.ROWS_OVERRIDE, (4096, 4096, "none", 4), (16, 256, 1, 4, 3))
    assert go.rows_config(4096, 4096, "none", 4) == (16, 256, 1, 4, 3)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"n": 1, "k": 2, "prologue": "none", "rows": 2, "config": [1, 2]}]))
    monkeypatch.setenv("NINEFOLD_GEMV_ROWS_TABLE", str(bad))
    with pytest.raises(ValueError, match="NINEFOLD_GEMV_ROWS_TABLE=.*5 integers"):
        go.rows_config(1, 2, "none", 2)


def test_a_declined_rows_bucket_is_named(tmp_path, monkeypatch):
    import json

    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"n": 8, "k": 64, "prologue": "none", "rows": 16, "config": []}]))
    monkeypatch.setenv("NINEFOLD_GEMV_ROWS_TABLE", str(path))
    monkeypatch.setattr(go, "_INTERPRETED", True)  # the device check passes for CPU tensors
    x, w = torch.randn(12, 64), torch.randn(8, 64)  # 12 rows: bucket 16
    assert "no few-rows GEMV configuration measured faster" in go._kernel_reason(x, w, 64)
    assert "no few-rows GEMV configuration" in go._kernel_reason(x[:3], w, 64)  # bucket 4: not in the file
    monkeypatch.setitem(go.ROWS_OVERRIDE, (8, 64, "none", 4), (16, 64, 1, 4, 3))
    assert go._kernel_reason(x[:3], w, 64) is None
    monkeypatch.setenv("NINEFOLD_GEMV_ROWS", "0")
    assert "NINEFOLD_GEMV_ROWS=0" in go._kernel_reason(x[:3], w, 64)
