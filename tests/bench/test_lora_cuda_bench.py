"""``python -m ninefold.bench.lora_cuda`` on a tiny checkpoint on the CPU, where both engines run eagerly (the
comparison of graphs with eager steps means something on a GPU only): the checks run, the adapter moves the
logits, every row is timed, bad arguments are named"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ninefold.bench import lora_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llm"))
from tiny_models import build_model_dir  # noqa: E402


def test_lora_cuda_bench_checks_then_times(tmp_path, monkeypatch, capsys):
    model = build_model_dir(tmp_path / "llama", "llama")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    code = lora_cuda.main(["--model", str(model), "--device", "cpu", "--dtype", "float32", "--rank", "4",
                           "--adapters", "2", "--batches", "1,3", "--decode-tokens", "24"])
    assert code == 0
    report = json.loads((tmp_path / "out" / "lora_cuda.json").read_text())
    assert report["checks_passed"] and report["graph_tokens"] == report["eager_tokens"]
    assert report["graphs_eager_logprob_gap"] <= lora_cuda.MAX_GAP["float32"]
    assert report["adapter_logprob_effect"] >= lora_cuda.EFFECT_OVER_GAP * lora_cuda.MAX_GAP["float32"]
    assert [(r["batch"], r["mode"]) for r in report["rows"]] == [(1, "graphs"), (1, "eager"), (3, "graphs"),
                                                                 (3, "eager")]
    assert all(r["base_tok_s"] > 0 and r["lora_tok_s"] > 0 for r in report["rows"])
    assert "adapters/base" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, message", [("--batches", "1,x", "comma-separated integers"),
                                                  ("--decode-tokens", "1", "at least 2"),
                                                  ("--rank", "0", "positive integer")])
def test_bad_arguments_are_named(flag, value, message, capsys):
    with pytest.raises(SystemExit):
        lora_cuda.main([flag, value, "--device", "cpu"])
    assert message in capsys.readouterr().err
