"""``python -m ninefold.bench.cpu_blocks`` at a tiny shape: every kind is checked, timed and written out."""

from __future__ import annotations

import json

import pytest

from ninefold.bench import cpu_blocks
from ninefold.ops import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"native CPU kernels: {cpu_native.reason()}")


def test_cpu_blocks_checks_and_times_every_kind(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    cpu_blocks.main(["--n", "48", "--k", "96", "--rows", "1,9", "--repeats", "1"])
    results = json.loads((tmp_path / "cpu_blocks.json").read_text())["results"]
    assert [(r["kind"], r["rows"]) for r in results] == [
        (kind, m) for kind in ("4-bit affine", "5-bit affine", "4-bit levels", "8-bit") for m in (1, 9)]
    assert all(r["ms"] > 0 and r["rel_error"] < 1e-4 for r in results)
    assert "4-bit levels   rows    9" in capsys.readouterr().out


def test_a_wrong_product_stops_the_bench(monkeypatch):
    real = cpu_blocks.ops.linear_blocks

    def off_by_a_little(x, weight, bias=None):
        return real(x, weight, bias) * 1.001

    monkeypatch.setattr(cpu_blocks.ops, "linear_blocks", off_by_a_little)
    with pytest.raises(AssertionError, match="4-bit affine at 1 rows: relative error 1.00e-03"):
        cpu_blocks.run(16, 64, [1], repeats=1)
