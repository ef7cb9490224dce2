"""``python -m ninefold.bench.decode_attention`` on the CPU: its checks and plumbing through Triton's interpreter."""

import json

import pytest

from ninefold.bench.decode_attention import RAGGED_VARIANTS

from .helpers import run_bench


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_bench_decode_attention_runs_on_the_cpu(tmp_path, kv_cache_dtype):
    run = run_bench("decode_attention", "--device", "cpu", "--replays", "1", "--kv-cache-dtype", kv_cache_dtype,
                    out=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads((tmp_path / "decode_attention.json").read_text())
    assert results["kv_cache_dtype"] == ("torch.float8_e4m3fn" if kv_cache_dtype == "fp8" else "torch.float32")
    assert results["failed_checks"] == 0 and len(results["checks"]) == 3 and all(r["ok"] for r in results["checks"])
    (row,) = results["decode"]
    assert (row["batch"], row["context"]) == (3, 70) and row["one_kernel_us"] > 0 and row["two_kernels_us"] > 0
    assert [r["batch"] for r in results["rope_and_cache"]] == [3]
    assert "| decode B=3 ctx=70 |" in run.stdout
    ragged = results["ragged"]  # each variant checked against float64 before it is timed
    assert {(r["order"], r["variant"]) for r in ragged} == {(o, v) for o in ("random", "longest first")
                                                           for v, _ in RAGGED_VARIANTS}
    assert {"default", "per_sm 16 min 256"} <= {v for v, _ in RAGGED_VARIANTS}
    assert all("error" not in r and r["us"] > 0 for r in ragged)
