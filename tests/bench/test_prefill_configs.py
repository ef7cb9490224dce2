"""``python -m ninefold.bench.prefill_configs`` on the CPU, through Triton's interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_runs_on_the_cpu_and_checks_every_configuration(tmp_path):
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "ninefold.bench.prefill_configs", "--device", "cpu", "--configs", "5"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / "prefill_configs.json").read_text())["rows"]
    assert {r["case"] for r in rows} == {"3 packed", "2 paged"} and len(rows) == 10  # five tile shapes
    assert all("error" not in r and r["us"] > 0 and r["max_abs_error"] <= 1e-4 for r in rows)


def test_refuses_the_cpu_without_the_interpreter():
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "ninefold.bench.prefill_configs", "--device", "cpu"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "TRITON_INTERPRET=1" in run.stderr
