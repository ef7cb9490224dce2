import json

from ninefold.bench.ops import main


def test_bench_writes_results_table_tuning_and_roofline(tmp_path, capsys):
    assert main(["--device", "cpu", "--shapes", "tiny", "--dtype", "float32", "--ops", "rms_norm", "attention_decode",
                 "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["op"] for r in results["rows"]] == ["attention_decode", "rms_norm", "rms_norm"]
    norm = results["rows"][1]
    assert {"vendor", "dsl"} <= set(norm["impls"]) and norm["choice"] == "vendor"
    assert all("wrong" not in e and e["us"] > 0 for e in norm["impls"].values())
    assert set(results["overhead"]) >= {"rms_norm", "attention_decode", "sample"}
    table = json.loads(next(tmp_path.glob("tuning-*.json")).read_text())
    assert table["format"] == 1 and len(table["entries"]) == 3
    assert (tmp_path / "roofline.png").stat().st_size > 10000
    assert "| rms_norm | T=1 D=64 | vendor |" in (tmp_path / "results.md").read_text()
    assert "choice=vendor" in capsys.readouterr().out
