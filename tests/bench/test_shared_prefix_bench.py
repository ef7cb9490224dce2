"""``python -m ninefold.bench.shared_prefix`` on a tiny checkpoint: both workloads reuse the shared blocks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ninefold.bench import shared_prefix

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llm"))
from tiny_models import build_model_dir  # noqa: E402


def test_shared_prefix_bench_reports_hits_and_times(tmp_path, monkeypatch, capsys):
    model = build_model_dir(tmp_path / "llama", "llama")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert shared_prefix.main(["--model", str(model), "--prompt-len", "40", "--n", "3"]) == 0
    rows = json.loads((tmp_path / "out" / "shared_prefix.json").read_text())["rows"]
    # 40 shared tokens hold two full blocks of 16: the two later sequences of each workload reuse them (the
    # requests' questions start alike, so they may share a third)
    assert rows[0]["hit_tokens"] == 2 * 32 and rows[1]["hit_tokens"] in (2 * 32, 2 * 48)
    assert all(r["cache_on_s"] > 0 and r["cache_off_s"] > 0 for r in rows)
    assert "from the cache" in capsys.readouterr().out
