import subprocess
import sys

import torch

from ninefold.cli.main import main
from ninefold.ops import dispatch, tuning, workloads


def test_ops_list_names_every_operator_and_its_implementations(capsys):
    assert main(["ops", "list"]) == 0
    out = capsys.readouterr().out
    for op in workloads.OPS:
        assert op in out
    assert "rms_norm" in out and "vendor [cpu, cuda: float16, bfloat16, float32]" in out


def test_ops_tune_stores_a_winner_for_every_call(tmp_path, capsys):
    path = tmp_path / "tuned.json"
    assert main(["ops", "tune", "--shapes", "tiny", "--ops", "rms_norm", "softmax", "--device", "cpu",
                 "--dtype", "float32", "--out", str(path)]) == 0
    table = tuning.read_table(path)
    model = dispatch.device_model(torch.device("cpu"))
    # tiny: tokens 1 and 9 -> row buckets 1 and 16.
    assert set(table) == {("rms_norm", model, "float32", (1, 64)), ("rms_norm", model, "float32", (16, 64)),
                          ("softmax", model, "float32", (1, 300)), ("softmax", model, "float32", (16, 300))}
    assert all(e["impl"] in e["times_us"] for e in table.values())
    assert "stored 4 choices" in capsys.readouterr().out


def test_ops_tune_rejects_unknown_operators_and_shapes(capsys):
    assert main(["ops", "tune", "--ops", "rmsnorm", "--device", "cpu"]) == 2
    assert "--ops: unknown operator(s) rmsnorm" in capsys.readouterr().err
    assert main(["ops", "tune", "--shapes", "huge", "--device", "cpu"]) == 2
    assert "--shapes: unknown shape set 'huge'" in capsys.readouterr().err


def test_ops_subcommand_runs_from_the_console_entry_point():
    run = subprocess.run([sys.executable, "-m", "ninefold", "ops", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "list" in run.stdout and "tune" in run.stdout and "build" in run.stdout
