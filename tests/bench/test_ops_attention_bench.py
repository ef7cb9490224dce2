"""``python -m ninefold.bench.ops_attention`` on the CPU: its checks and plumbing through Triton's interpreter."""

import json

from .helpers import run_bench


def test_bench_ops_attention_runs_on_the_cpu(tmp_path):
    # The GPU benchmark's plumbing at tiny shapes: Triton through the interpreter, float64 checks, JSON out.
    run = run_bench("ops_attention", "--device", "cpu", "--shapes", "tiny", "--no-sweep", out=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads((tmp_path / "ops_attention.json").read_text())
    checked = {(r["op"], r["impl"]) for r in results["correctness"] if r.get("ok")}
    assert {("attention_decode", "triton"), ("attention_prefill", "triton"), ("attention_prefill", "vendor")} <= checked
    assert results["failed_checks"] == 0
    assert [e["case"] for e in results["decode"]] == ["B=3 ctx=40"]
    assert all(v["us"] > 0 for e in results["decode"] + results["prefill"] for v in e["impls"].values())
