"""``python -m ninefold.bench.sampling`` on the CPU: its reference filter and a whole (small) run."""

import json

import torch

from ninefold.bench import sampling


def test_allowed_tokens_follows_each_filter():
    # probabilities at temperature 0.8 of these logits: about 0.50, 0.27, 0.15, 0.07 (and 0 for -inf)
    logits = torch.tensor([[2.0, 1.4, 0.8, 0.1, -float("inf")]]) * sampling.TEMPERATURE
    keep = lambda k, p, m: sampling.allowed_tokens(logits, k, p, m)[0].tolist()  # noqa: E731
    assert keep(0, 1.0, 0.0) == [True, True, True, True, False]
    assert keep(2, 1.0, 0.0) == [True, True, False, False, False]
    assert keep(0, 0.45, 0.0) == [True, False, False, False, False]  # the first token alone reaches 0.45
    assert keep(0, 0.7, 0.0) == [True, True, False, False, False]
    assert keep(0, 0.8, 0.0) == [True, True, True, False, False]
    assert keep(0, 1.0, 0.4) == [True, True, False, False, False]  # 0.27 / 0.50 >= 0.4; 0.15 / 0.50 < 0.4


def test_cpu_run_checks_every_draw_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert sampling.main(["--device", "cpu", "--vocab", "300", "--batches", "1,4"]) == 0
    result = json.loads((tmp_path / "sampling.json").read_text())
    assert result["failures"] == []
    assert len(result["rows"]) == 2 * len(sampling.SETTINGS) * 2
    assert all(row["tokens_inside_filter"] and row["sample_us"] > 0 for row in result["rows"])
    engine = [row for row in result["rows"] if "engine_us" in row]  # the top-k settings, through the engine's sampler
    assert len(engine) == 4 and all(row["engine_inside_filter"] and row["engine_us"] > 0 for row in engine)
    kept = {row["setting"]: row["kept_tokens_mean"] for row in result["rows"] if row["batch"] == 4}
    assert kept["temperature"] == 300 and kept["top_k+top_p"] <= 50
