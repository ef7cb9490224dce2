"""``python -m ninefold.bench.layer_overlap`` on the CPU (the split layer's plumbing, one stream) and its replot."""

import json

from ninefold.bench import layer_overlap

from .helpers import run_bench


def test_the_split_layer_computes_the_serial_output_on_the_cpu(tmp_path):
    run = run_bench("layer_overlap", "--device", "cpu", out=tmp_path, interpret=False, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / "layer_overlap.json").read_text())["results"]
    assert len(rows) == 1 and 0 <= rows[0]["relative_error"]["split_one_stream"] <= 1e-5


def test_replot_draws_a_stored_gpu_run(tmp_path):
    stored = {"device": "test", "results": [{"batch": 64, "context": 100, "relative_error": {},
                                             "us_per_layer": {v: 10.0 + i for i, v in enumerate(layer_overlap.VARIANTS)}}]}
    (tmp_path / "run.json").write_text(json.dumps(stored))
    assert layer_overlap.main(["--replot", str(tmp_path / "run.json"), str(tmp_path / "run.png")]) == 0
    assert (tmp_path / "run.png").stat().st_size > 1000
