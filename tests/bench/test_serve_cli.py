"""``ninefold bench serve`` end to end against a streaming server, and its errors on bad values."""

import json
import subprocess
import sys

import pytest

from ninefold.bench.serve_metrics import LATENCY_KEYS, STAT_KEYS
from ninefold.cli.main import main

from .openai_standin import MODEL

REPORT_KEYS = {"ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "request_throughput", "output_token_throughput",
               "total_token_throughput", "goodput", "slo_attainment", "completed", "failed"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_report(report: dict, num_prompts: int) -> None:
    """The report schema of the issue: every key present, latency stats numeric, counts adding up."""
    assert REPORT_KEYS <= report.keys()
    for key in LATENCY_KEYS:
        assert set(report[key]) == set(STAT_KEYS)
        assert all(isinstance(report[key][s], float) and report[key][s] >= 0 for s in STAT_KEYS)
        assert report[key]["median"] <= report[key]["p90"] <= report[key]["p99"]
    for key in ("request_throughput", "output_token_throughput", "total_token_throughput", "goodput"):
        assert isinstance(report[key], float) and report[key] >= 0
    assert report["completed"] + report["failed"] == num_prompts == len(report["requests"])
    assert 0 <= report["slo_attainment"] <= 1
    assert report["goodput"] <= report["request_throughput"] + 1e-12


def test_command_writes_report_table_and_plot(standin, tmp_path):
    server = standin()
    out, plot = tmp_path / "result.json", tmp_path / "result.png"
    command = [sys.executable, "-m", "ninefold", "bench", "serve", "--base-url", server.url + "/v1",
               "--num-prompts", "12", "--input-len", "8:24", "--output-len", "4:8", "--request-rate", "60",
               "--burstiness", "0.5", "--max-concurrency", "4", "--slo", "ttft=2s,itl=1s,e2e=5s",
               "--seed", "3", "--output", str(out), "--plot", str(plot)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    check_report(report, 12)
    assert report["completed"] == 12 and report["config"]["model"] == MODEL  # found through /v1/models
    assert report["config"]["token_counter"] == "server /tokenize"
    assert report["config"]["input_len"] == [8, 24] and report["config"]["dataset"] == "random"
    assert all(8 <= r["prompt_tokens"] <= 24 and 4 <= r["output_tokens"] <= 8 for r in report["requests"])
    assert report["slo"] == {"ttft_ms": 2000.0, "itl_ms": 1000.0, "tpot_ms": None, "e2e_ms": 5000.0}
    assert plot.read_bytes()[:8] == PNG_MAGIC and plot.stat().st_size > 10_000
    for label in ("TTFT", "ITL", "TPOT", "E2E", "Goodput (req/s)", "SLO attainment"):
        assert label in done.stdout
    assert "requests: 100%" in done.stderr  # the progress bar
    assert len(server.state.bodies) == 12 + 1  # one warm-up request, left out of the report
    assert "warm-up request: ok" in done.stderr


def test_sweep_reports_the_highest_rate_meeting_the_target(standin, tmp_path, capsys):
    server = standin()
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    code = main(["bench", "serve", "--base-url", server.url, "--model", MODEL, "--endpoint", "chat",
                 "--num-prompts", "6", "--input-len", "10", "--output-len", "3", "--sweep-rates", "200,50",
                 "--slo", "e2e=30s", "--output", str(out), "--plot", str(plot), "--no-progress"])
    assert code == 0
    sweep = json.loads(out.read_text())
    assert [run["config"]["request_rate"] for run in sweep["runs"]] == [50.0, 200.0]
    for run in sweep["runs"]:
        check_report(run, 6)
    # A 30 s end-to-end bound is met by every request at either rate, so the highest rate wins.
    assert sweep["attainment_target"] == 0.9 and sweep["goodput_rate"] == 200.0
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert "highest rate with SLO attainment >= 90%: 200 req/s" in capsys.readouterr().out


def test_jsonl_dataset_through_the_command(standin, tmp_path):
    server = standin(serve_tokenize=False)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello there", "output_len": 3}\n{"prompt": "general kenobi"}\n')
    out = tmp_path / "r.json"
    code = main(["bench", "serve", "--base-url", server.url, "--dataset", "jsonl", str(data), "--num-prompts", "2",
                 "--output-len", "5", "--output", str(out), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["output_tokens"] for r in report["requests"]] == [3, 5]
    assert report["config"]["token_counter"] == "words"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--input-len", "5:2"], "argument --input-len: --input-len must satisfy 1 <= A <= B, got '5:2'"),
        (["--output-len", "x"], "argument --output-len: --output-len must be 'A:B' or 'A'"),
        (["--request-rate", "-1"], "argument --request-rate: --request-rate must be a positive float, got '-1'"),
        (["--request-rate", "fast"], "argument --request-rate: --request-rate must be a positive float, got 'fast'"),
        (["--burstiness", "0"], "argument --burstiness: --burstiness must be a positive float, got '0'"),
        (["--num-prompts", "0"], "argument --num-prompts: --num-prompts must be a positive int, got '0'"),
        (["--max-concurrency", "1.5"], "argument --max-concurrency: --max-concurrency must be a positive int"),
        (["--slo", "ttft=fast"], "argument --slo: --slo ttft must be a duration"),
        (["--slo", "latency=5ms"], "argument --slo: --slo items must be KEY=DURATION with KEY one of"),
        (["--sweep-rates", "1,0"], "argument --sweep-rates: --sweep-rates must be a positive float, got '0'"),
        (["--sweep-rates", "1,1"], "argument --sweep-rates: --sweep-rates repeats a rate"),
        (["--endpoint", "rerank"], "argument --endpoint: invalid choice: 'rerank'"),
    ],
)
def test_bad_values_are_rejected_by_the_parser(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--output", str(tmp_path / "r.json"), *extra])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dataset", "jsonl"], "--dataset random takes no file and jsonl takes exactly one"),
        (["--dataset", "random", "x.jsonl"], "--dataset random takes no file and jsonl takes exactly one"),
        (["--dataset", "sharegpt"], "--dataset must be 'random' or 'jsonl FILE', got 'sharegpt'"),
        (["--sweep-rates", "1,2"], "--sweep-rates needs --slo"),
        (["--sweep-rates", "1,2", "--slo", "ttft=1s", "--request-rate", "3"], "either --request-rate or --sweep-rates"),
        (["--base-url", "ftp://host"], "--base-url must be an http(s) URL"),
        (["--plot", "/no/such/dir/p.png"], "--plot '/no/such/dir/p.png': directory '/no/such/dir' does not exist"),
    ],
)
def test_inconsistent_options_are_rejected(tmp_path, capsys, extra, message):
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                 "--output", str(tmp_path / "r.json"), *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_missing_jsonl_file_is_reported(standin, tmp_path, capsys):
    server = standin()
    code = main(["bench", "serve", "--base-url", server.url, "--dataset", "jsonl", str(tmp_path / "none.jsonl"),
                 "--output", str(tmp_path / "r.json")])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_unreachable_server_without_model_says_so(tmp_path, capsys):
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--output", str(tmp_path / "r.json")])
    assert code == 1
    assert "cannot list models at http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_bench_without_a_benchmark_prints_help(capsys):
    assert main(["bench"]) == 2
    assert "serve" in capsys.readouterr().out


def test_module_entry_point_has_the_same_options(capsys):
    from ninefold.bench import serve

    with pytest.raises(SystemExit) as exit_:
        serve.main(["--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for option in ("--base-url", "--sweep-rates", "--slo", "--burstiness", "--max-concurrency", "--endpoint"):
        assert option in help_text
