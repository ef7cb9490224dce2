"""``ninefold.comm.launch`` and ``ninefold launch`` with real processes: the rendezvous environment of
each rank, tagged output, a failing or killed rank stopping the job, signals to the launcher reaching
the ranks, no process left behind, arguments refused with what is accepted, and ranks that really
meet over Gloo.

The programs the ranks run are in launch_programs/ (rank.py documents its modes).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ninefold.cli.main import main as cli_main
from ninefold.comm.launch import launch

pytestmark = pytest.mark.timeout(120)  # launch() in this process has no timeout of its own

PROGRAMS = Path(__file__).parent / "launch_programs"
RANK = str(PROGRAMS / "rank.py")
PY_RANK = [sys.executable, RANK]
TIMEOUT = 60


def tagged(text: str) -> dict[int, list[str]]:
    """``[rank N] line`` lines by rank; any other line fails the test."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"\[rank (\d+)\] (.*)", line)
        assert match, line
        lines.setdefault(int(match[1]), []).append(match[2])
    return lines


def exists(pid: int) -> bool:
    """Whether the pid names a process at all (a zombie counts)."""
    return os.path.exists(f"/proc/{pid}")


def running(pid: int) -> bool:
    """Whether the pid names a process that is not a zombie (orphans here may be adopted by an init
    that never reaps them)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def records(directory: Path, count: int) -> list[dict]:
    found = sorted(directory.glob("*.json"))
    assert len(found) == count, found
    return [json.loads(path.read_text()) for path in found]


def wait_for_records(directory: Path, count: int, proc: subprocess.Popen) -> list[dict]:
    deadline = time.monotonic() + TIMEOUT
    while len(list(directory.glob("*.json"))) < count:
        assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
        time.sleep(0.05)
    return records(directory, count)


def assert_all_gone(recorded: list[dict]) -> None:
    """The ranks were reaped by the launcher; whatever they started does not run."""
    for record in recorded:
        assert not exists(record["pid"]), record
        if "child" in record:
            assert not running(record["child"]), record


def default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the launcher leaves an inherited SIG_IGN alone


# ----------------------------------------------------------------------------- environment and output


def test_each_rank_gets_the_rendezvous_environment(capfd):
    assert launch([*PY_RANK, "env", "a", "--b"], 3, env={"EXTRA": "extra"}) == 0
    out, err = capfd.readouterr()
    reports = {rank: json.loads(lines[0]) for rank, lines in tagged(out).items()}
    assert sorted(reports) == [0, 1, 2] and err == ""
    port = reports[0]["MASTER_PORT"]
    assert 1 <= int(port) <= 65535
    assert len({r["pid"] for r in reports.values()}) == 3
    for rank, report in reports.items():
        assert report == {"pid": report["pid"], "args": ["a", "--b"], "RANK": str(rank), "WORLD_SIZE": "3",
                          "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": port, "NINEFOLD_COMM_LAUNCHED": "1",
                          "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "EXTRA": "extra"}


def test_master_address_and_port_are_passed_as_given(capfd):
    assert launch([*PY_RANK, "env"], 2, master_addr="localhost", master_port=29517) == 0
    reports = [json.loads(lines[0]) for lines in tagged(capfd.readouterr().out).values()]
    assert [(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in reports] == [("localhost", "29517")] * 2


def test_each_line_is_forwarded_whole_with_its_rank_and_stream(capfd):
    assert launch([*PY_RANK, "talk"], 2) == 0
    out, err = capfd.readouterr()
    assert out.endswith("\n") and err.endswith("\n")
    long = "x" * 3000
    for rank, lines in tagged(out).items():
        assert lines == [f"rank {rank} line {i} {long}" for i in range(50)] + [f"rank {rank} last line"]
    assert sorted(err.splitlines()) == ["[rank 0] rank 0 to stderr", "[rank 1] rank 1 to stderr"]


def test_without_tags_ranks_write_to_the_launchers_streams(capfd):
    assert launch([*PY_RANK, "talk"], 2, tag_output=False) == 0
    out, err = capfd.readouterr()
    assert "[rank" not in out + err
    assert out.count("rank 0 line 49 ") == 1 and "rank 1 last line" in out
    assert sorted(err.splitlines()) == ["rank 0 to stderr", "rank 1 to stderr"]


# ----------------------------------------------------------------------------- failures and signals


def test_a_failing_rank_stops_the_others_and_their_children(tmp_path, capfd):
    start = time.monotonic()
    code = launch([*PY_RANK, "wait", str(tmp_path), "--child", "--fail", "1:3"], 3)
    elapsed = time.monotonic() - start
    assert code == 3 and elapsed < 20, (code, elapsed)  # the other ranks would sleep for 60 s
    assert_all_gone(records(tmp_path, 3))
    out, err = capfd.readouterr()
    assert err.splitlines() == ["ninefold launch: rank 1 exited with code 3; stopping the other ranks"]
    assert sorted(tagged(out).items()) == [(0, ["rank 0 got SIGTERM"]), (2, ["rank 2 got SIGTERM"])]


def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal(tmp_path, capfd):
    assert launch([*PY_RANK, "wait", str(tmp_path), "--fail", "0:kill"], 2) == 128 + signal.SIGKILL
    assert_all_gone(records(tmp_path, 2))
    err = capfd.readouterr().err
    assert err.splitlines() == ["ninefold launch: rank 0 was killed by SIGKILL (code 137); stopping the other ranks"]


def test_ranks_that_ignore_sigterm_are_killed_after_the_grace_period(tmp_path, capfd):
    start = time.monotonic()
    code = launch([*PY_RANK, "wait", str(tmp_path), "--child", "--stubborn", "--fail", "2:5"], 3, grace_s=0.5)
    assert code == 5 and time.monotonic() - start < 20
    assert_all_gone(records(tmp_path, 3))
    assert "got SIGTERM" not in capfd.readouterr().out


def test_what_a_rank_leaves_behind_is_stopped_when_all_succeed(tmp_path, capfd):
    start = time.monotonic()
    assert launch([*PY_RANK, "wait", str(tmp_path), "--child", "--leave"], 2) == 0
    assert time.monotonic() - start < 20  # the children sleep for 60 s and hold the output pipes open
    assert_all_gone(records(tmp_path, 2))
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("signum, entry", [(signal.SIGINT, ["ninefold.cli.main", "launch"]),
                                           (signal.SIGTERM, ["ninefold.comm.launch"])])
def test_a_signal_to_the_launcher_reaches_every_rank(tmp_path, signum, entry):
    proc = subprocess.Popen([sys.executable, "-m", *entry, "--nproc", "2", RANK, "wait", str(tmp_path), "--child"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        recorded = wait_for_records(tmp_path, 2, proc)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    lines = tagged(out)
    assert sorted(lines) == [0, 1] and all(f"rank {r} got {name}" in lines[r] for r in lines), out
    assert_all_gone(recorded)


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kwargs, error, needles",
    [
        ({"nproc": 0}, ValueError, ["nproc", "0", ">= 1"]),
        ({"nproc": "2"}, TypeError, ["nproc", "'2'", ">= 1"]),
        ({"nproc": True}, TypeError, ["nproc", "True", "int"]),
        ({"command": []}, ValueError, ["command", "empty", "non-empty list"]),
        ({"command": "python x.py"}, TypeError, ["command", "'python x.py'", "list of strings"]),
        ({"command": [sys.executable, 3]}, TypeError, ["command", "3", "list of strings"]),
        ({"command": ["no-such-program-9f"]}, ValueError, ["command", "'no-such-program-9f'", "on PATH"]),
        ({"command": ["./no/such/file"]}, ValueError, ["command", "'./no/such/file'", "executable file"]),
        ({"master_port": 0}, ValueError, ["master_port", "0", "[1, 65535]"]),
        ({"master_port": 65536}, ValueError, ["master_port", "65536", "[1, 65535]"]),
        ({"master_port": "29500"}, TypeError, ["master_port", "'29500'", "[1, 65535]"]),
        ({"master_addr": ""}, TypeError, ["master_addr", "''", "address"]),
        ({"grace_s": -1}, ValueError, ["grace_s", "-1", ">= 0"]),
        ({"grace_s": math.nan}, ValueError, ["grace_s", "nan", "finite"]),
        ({"tag_output": "yes"}, TypeError, ["tag_output", "'yes'", "True or False"]),
        ({"env": {"RANK": "0"}}, ValueError, ["env", "RANK", "other names"]),
        ({"env": {"A": 1}}, TypeError, ["env", "'A': 1", "str to str"]),
        ({"env": ["A=1"]}, TypeError, ["env", "['A=1']", "dict"]),
    ],
)
def test_bad_arguments_name_the_argument_and_what_is_accepted(kwargs, error, needles, capfd):
    call = {"command": [*PY_RANK, "env"], "nproc": 2, **kwargs}
    with pytest.raises(error) as raised:
        launch(call.pop("command"), call.pop("nproc"), **call)
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))
    assert capfd.readouterr().out == ""  # no rank started


# ----------------------------------------------------------------------------- command line


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("entry", [["ninefold.cli.main", "launch"], ["ninefold.comm.launch"]])
def test_the_command_line_passes_everything_after_program_unchanged(entry):
    result = run(*entry, "--nproc", "2", "--master-port", "29611", RANK, "env", "--nproc", "5", "-x", "--", "y")
    assert result.returncode == 0, result.stderr
    reports = {rank: json.loads(lines[0]) for rank, lines in tagged(result.stdout).items()}
    assert sorted(reports) == [0, 1]
    assert all(r["args"] == ["--nproc", "5", "-x", "--", "y"] and r["MASTER_PORT"] == "29611" for r in reports.values())


def test_the_command_line_takes_a_double_dash_and_returns_the_ranks_code(tmp_path, capfd):
    code = cli_main(["launch", "-n", "2", "--grace", "1", "--no-tag-output", "--",
                     sys.executable, RANK, "wait", str(tmp_path), "--fail", "1:4"])
    out, err = capfd.readouterr()
    assert code == 4, err
    assert "[rank" not in out and "rank 0 got SIGTERM" in out
    assert err.splitlines() == ["ninefold launch: rank 1 exited with code 4; stopping the other ranks"]
    assert_all_gone(records(tmp_path, 2))


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--nproc", "0", RANK], ["--nproc", "'0'", ">= 1"]),
        (["--nproc", "two", RANK], ["--nproc", "'two'", ">= 1"]),
        (["--nproc", "2", "--master-port", "70000", RANK], ["--master-port", "'70000'", "[1, 65535]"]),
        (["--nproc", "2", "--grace", "-1", RANK], ["--grace", "'-1'", ">= 0"]),
        (["--nproc", "2", "--bogus", RANK], ["unrecognized", "--bogus"]),
        ([RANK, "--nproc", "2"], ["--nproc", "required"]),
        (["--nproc", "2"], ["PROGRAM", "required"]),
        (["--nproc", "2", "--"], ["PROGRAM", "required"]),
        (["--nproc", "2", "no-such-program-9f"], ["PROGRAM", "'no-such-program-9f'", "on PATH"]),
        (["--nproc", "2", "no_such_file.py"], ["PROGRAM", "'no_such_file.py'", "Python file"]),
    ],
)
def test_bad_options_exit_2_with_one_error_line(argv, needles, capsys):
    try:
        code = cli_main(["launch", *argv])
    except SystemExit as exit_:  # argparse refuses
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_the_launch_help_lists_every_option():
    result = run("ninefold.cli.main", "launch", "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: ninefold launch")
    for option in ("--nproc", "--master-addr", "--master-port", "--no-tag-output", "--grace", "PROGRAM"):
        assert option in result.stdout, option


# ----------------------------------------------------------------------------- a real rendezvous


def test_launched_ranks_meet_over_gloo(capfd):
    assert launch([sys.executable, str(PROGRAMS / "gloo_sum.py")], 2) == 0
    lines = tagged(capfd.readouterr().out)
    assert lines == {0: ["sum 3 rank 0 of 2"], 1: ["sum 3 rank 1 of 2"]}
