"""``ninefold.bench.results.write_json``: where benchmark results land and what they hold."""

import json
import pathlib
from decimal import Decimal

from ninefold.bench.results import write_json

RESULTS = {"rows": [{"batch": 1, "us": 12.5}, {"batch": 64, "us": 80.25}], "device": "cpu", "ok": True}


def test_writes_to_the_directory_given(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "from_env"))
    path = write_json("bench.json", RESULTS, tmp_path)
    assert path == tmp_path / "bench.json"
    assert json.loads(path.read_text()) == RESULTS
    assert not (tmp_path / "from_env").exists()


def test_writes_under_OUT_without_a_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    path = write_json("bench.json", RESULTS)
    assert path == tmp_path / "bench.json"
    with open(path) as f:
        assert json.load(f) == RESULTS


def test_writes_nothing_without_a_directory_or_OUT(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert write_json("bench.json", RESULTS) is None
    assert write_json("bench.json", RESULTS, "") is None
    assert list(tmp_path.iterdir()) == []


def test_creates_missing_directories(tmp_path):
    out = tmp_path / "a" / "b"
    path = write_json("bench.json", RESULTS, str(out))
    assert isinstance(path, pathlib.Path) and path.parent == out
    with open(out / "bench.json") as f:
        assert json.load(f) == RESULTS


def test_indent_default_and_announce(tmp_path, capsys):
    path = write_json("bench.json", {"x": [Decimal("1.5")]}, tmp_path, indent=2, default=str, announce=True)
    assert path.read_text() == '{\n  "x": [\n    "1.5"\n  ]\n}'
    assert capsys.readouterr().out == f"wrote {path}\n"
    write_json("one.json", {"x": 1}, tmp_path)
    assert (tmp_path / "one.json").read_text() == '{\n "x": 1\n}'
    assert capsys.readouterr().out == ""
