"""``python -m ninefold.bench.beam_search`` on a tiny float32 checkpoint: the best beams agree with transformers'."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ninefold.bench import beam_search

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llm"))
from tiny_models import build_model_dir  # noqa: E402


def test_beam_search_bench_times_both_and_compares_the_best_beams(tmp_path):
    model = build_model_dir(tmp_path / "llama", "llama")
    results = beam_search.main(["--model", str(model), "--widths", "1,3", "--max-tokens", "6", "--repeats", "1",
                                "--out", str(tmp_path)])
    written = json.loads((tmp_path / "beam_search.json").read_text())
    assert written["rows"] == results["rows"] and [r["width"] for r in written["rows"]] == [1, 3]
    assert (tmp_path / "beam_search.png").stat().st_size > 0
    for row in written["rows"]:
        assert row["fp32_best_beam_equals_transformers"] is True
        assert min(row["ninefold_s"], row["ninefold fp32_s"], row["transformers_s"]) > 0
