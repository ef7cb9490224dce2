"""ninefold's stored Triton key: computed once per installation, then read by new processes."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

PROBE = (
    "from ninefold.dsl.backends import triton_startup; how = triton_startup.install(); "
    "import triton.runtime.cache as c; print(how, c.triton_key())"
)


def _run(cache, **env):
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NINEFOLD_CACHE_DIR": str(cache), **env},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_key_is_computed_once_then_read_and_equals_tritons_own(tmp_path):
    how, first = _run(tmp_path)
    assert how == "computed"
    how, second = _run(tmp_path)
    assert how == "stored" and second == first
    how, own = _run(tmp_path, NINEFOLD_DSL_TRITON_KEY="off")  # Triton's own computation
    assert how == "kept" and own == first
    stored = json.loads((tmp_path / "dsl" / "triton" / "key.json").read_text())
    assert list(stored.values()) == [first]


def test_fingerprint_changes_with_a_file(tmp_path):
    from ninefold.dsl.backends.triton_startup import fingerprint

    (tmp_path / "a.py").write_text("x = 1\n")
    before = fingerprint(str(tmp_path))
    assert fingerprint(str(tmp_path)) == before
    (tmp_path / "notes.txt").write_text("not a source file")
    assert fingerprint(str(tmp_path)) == before
    (tmp_path / "a.py").write_text("x = 22\n")
    assert fingerprint(str(tmp_path)) != before
