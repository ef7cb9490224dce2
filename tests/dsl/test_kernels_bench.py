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
