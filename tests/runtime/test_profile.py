"""Hardware profile of the CPU through the real command line, its cache, and the roofline helper."""

import json
import os
import subprocess
import sys

import pytest

from ninefold.cli.main import main
from ninefold.cli.profile import format_table
from ninefold.runtime import Device
from ninefold.runtime.profile import HardwareProfile, _slug, cache_dir


def meminfo_total():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise KeyError("MemTotal")


def run_profile(cache):
    env = os.environ | {"NINEFOLD_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "ninefold", "profile", "device", "--device", "cpu", "--json"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_cpu_profile_json_is_sane_and_cached(tmp_path, monkeypatch, capsys):
    # One test, so that parallel workers do not each measure the CPU.
    data = run_profile(tmp_path)
    assert {"compute", "bandwidth", "capacity", "interconnect"} <= set(data)
    assert set(data["compute"]) == {"bfloat16", "float16", "float32"}
    assert all(0 < rate < 1e14 for rate in data["compute"].values())  # FLOP/s; no 2-core CPU reaches 100 TFLOP/s
    assert 1e8 < data["bandwidth"]["copy"] < 1e12  # bytes/s, below 1 TB/s on this CPU
    assert data["capacity"]["total"] == meminfo_total()
    assert 0 < data["capacity"]["free"] <= data["capacity"]["total"]
    assert data["interconnect"]["loopback_tcp"] > 0
    assert "host_to_device" not in data["interconnect"]  # nothing to copy to from the host
    assert data["device"] == "cpu" and data["measured"]["date"]

    # Cached by device name: the second run reads the file instead of measuring.
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1 and files[0].name.startswith(_slug(data["name"]))
    # A fresh process: the cache key includes the thread count, which tests in this worker may change.
    again = run_profile(tmp_path)
    assert again["compute"] == data["compute"] and again["measured"] == data["measured"]
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))

    profile = HardwareProfile.from_dict(data)
    assert profile.to_dict() == data
    flop, nbytes = 2 * 512**3, 3 * 512 * 512 * 4
    expected = max(flop / data["compute"]["float32"], nbytes / data["bandwidth"]["copy"])
    assert profile.roofline_seconds(flop, nbytes, "float32") == pytest.approx(expected)
    with pytest.raises(ValueError, match="dtype"):
        profile.roofline_seconds(1, 1, "int8")
    table = format_table([profile])
    assert "cpu" in table.splitlines()[1] and "TFLOP/s" in table.splitlines()[0]

    # Every device as a table (only the CPU where there is no accelerator).
    assert main(["profile", "device", "--device", "all"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split()[0] == "cpu" and len(rows) == 1 + len(Device.all())


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path / "profiles"


def test_bad_device_is_an_error_not_a_traceback(capsys):
    assert main(["profile", "device", "--device", "tpu:7"]) == 2
    assert "--device: 'tpu:7'" in capsys.readouterr().err
