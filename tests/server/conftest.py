"""Live servers for the server tests: real ``ninefold serve`` processes on 127.0.0.1 with a tiny model."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .tiny_model import TinyModel, build_tiny_model

STARTUP_TIMEOUT_S = 180
PORT_ATTEMPTS = 3  # launches on fresh ports when another process took the one free_port() found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One ``python -m ninefold serve`` child process."""

    def __init__(self, model: TinyModel, log_dir: Path, *args: str, wait: bool = True) -> None:
        if "--device" not in args:  # the same timing-insensitive behaviour on every machine; test_cuda.py covers GPUs
            args = ("--device", "cpu", *args)
        self._model, self._log_dir, self._args, self._launches = model, log_dir, args, 0
        self._launch()
        self.healthy = False
        if wait:
            self.wait_healthy()

    def _launch(self) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = self._log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "ninefold", "serve", "--model", str(self._model.path), "--port", str(self.port),
               "--served-model-name", "tiny", "--log-level", "warning", *self._args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._launches += 1

    def wait_healthy(self) -> None:
        """Block until ``GET /health`` answers 200 (raises with the server's log if it dies or hangs)."""
        if self.healthy:
            return
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "Address already in use" in self.log() and self._launches < PORT_ATTEMPTS:
                    # free_port() hands its port back before the server binds it; another process took it first
                    self._launch()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    self.healthy = True
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` as ``{"name{labels}": value}`` plus ``{"name": value}`` for unlabelled sums."""
        text = httpx.get(self.base + "/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
            bare = re.sub(r"\{.*\}", "", key)
            if bare != key:
                values[bare] = values.get(bare, 0.0) + float(value)
        return values

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, float]:
        """Wait until nothing runs or waits and every KV block is free; returns the last metrics."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m["ninefold:num_requests_running"] == 0 and m["ninefold:num_requests_waiting"] == 0
                    and m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]
                    and m["ninefold:num_sequences_admitted"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> TinyModel:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def _servers(tiny_model, tmp_path_factory):
    """Both shared servers, started together (their start-ups overlap) and stopped at the end."""
    logs = tmp_path_factory.mktemp("logs")
    main = ServerProcess(tiny_model, logs, "--max-model-len", "4096", "--max-num-seqs", "256",
                         "--num-kv-blocks", "1024", wait=False)
    # An API key, room for 2 sequences, and a KV cache of 64 blocks (1024 tokens) below the context.
    strict = ServerProcess(tiny_model, logs, "--api-key", "sekret", "--max-model-len", "4096", "--max-num-seqs",
                           "1", "--max-queue", "1", "--num-kv-blocks", "64", "--max-body-bytes", "65536", wait=False)
    yield main, strict
    codes = [proc.stop() for proc in (main, strict)]
    assert codes == [0, 0], f"SIGTERM on idle servers should exit 0, got {codes}"


@pytest.fixture(scope="session")
def server(_servers):
    """The main server: context 4096, up to 256 sequences at once."""
    _servers[0].wait_healthy()
    return _servers[0]


@pytest.fixture(scope="session")
def strict_server(_servers):
    """A server with an API key, room for 2 sequences, and a KV cache smaller than its context."""
    _servers[1].wait_healthy()
    return _servers[1]


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def async_client(server):
    import openai

    return openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)
