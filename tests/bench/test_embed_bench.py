"""``python -m ninefold.bench.embed`` on a tiny checkpoint: ninefold and transformers agree, rates are written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ninefold.bench import embed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llm"))
from tiny_models import build_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("embed-bench") / "llama", "llama_tied")


def test_embed_bench_checks_then_times(tiny, tmp_path, capsys):
    code = embed.main(["--model", str(tiny), "--prompts", "5", "--min-len", "3", "--max-len", "40", "--repeats", "1",
                       "--systems", "ninefold,transformers", "--out", str(tmp_path), "--device", "cpu"])
    assert code == 0
    report = json.loads((tmp_path / "embed_bench.json").read_text())
    assert [r["system"] for r in report["rows"]] == ["ninefold", "transformers"]
    assert report["rows"][1]["min_cosine_vs_ninefold"] > 0.9999
    assert all(r["tokens_per_s"] > 0 for r in report["rows"])
    assert report["prompts"] == 5 and 5 * 3 <= report["tokens"] <= 5 * 40
    assert "vs best peer" in capsys.readouterr().out


def test_a_disagreeing_peer_stops_the_run(tiny, tmp_path, monkeypatch):
    real = embed.bench_transformers

    def shuffled(*args, **kwargs):
        row, vectors = real(*args, **kwargs)
        return row, np.roll(vectors, 1, axis=0)  # each prompt gets another prompt's vector

    monkeypatch.setattr(embed, "bench_transformers", shuffled)
    assert embed.main(["--model", str(tiny), "--prompts", "4", "--min-len", "3", "--max-len", "20", "--repeats", "1",
                       "--systems", "ninefold,transformers", "--device", "cpu"]) == 1


def test_bad_systems_are_refused():
    with pytest.raises(SystemExit):
        embed.main(["--systems", "transformers"])
