"""``python -m ninefold.bench.prefill_configs`` on the CPU, through Triton's interpreter."""

import json

import pytest

from .helpers import run_bench


def test_runs_on_the_cpu_and_checks_every_configuration(tmp_path):
    pytest.importorskip("triton")
    run = run_bench("prefill_configs", "--device", "cpu", "--configs", "5", out=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / "prefill_configs.json").read_text())["rows"]
    assert {r["case"] for r in rows} == {"3 packed", "2 paged"} and len(rows) == 10  # five tile shapes
    assert all("error" not in r and r["us"] > 0 and r["max_abs_error"] <= 1e-4 for r in rows)


def test_refuses_the_cpu_without_the_interpreter():
    run = run_bench("prefill_configs", "--device", "cpu", interpret=False, timeout=120)
    assert run.returncode == 2 and "TRITON_INTERPRET=1" in run.stderr
