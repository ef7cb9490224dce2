"""Start ``ninefold serve`` on this machine, check it streams correctly, then benchmark it. One command.

    python -m ninefold.bench.serve_local [--model M] [--device cuda] [--rates 2,8,32] [--num-prompts 48]

Steps: start the server as a child process and wait for ``/health``; check correctness (a greedy
request with ``ignore_eos`` returns exactly ``max_tokens`` tokens by its usage, and streamed text
equals the non-streamed text); run ``bench serve`` once at rate ``inf`` (peak throughput) and once
as a sweep over ``--rates`` under ``--slo``; stop the server. Tables go to the terminal; JSON
reports, plots and the server log go under ``$OUT`` (or a temporary directory).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ninefold.bench import serve

STARTUP_TIMEOUT_S = 150


def main(argv: list[str] | None = None) -> int:
    """Run the whole sequence; returns the exit code (non-zero when a step fails)."""
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.serve_local", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="what ninefold serve loads (default: its default model)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: the server's choice)")
    parser.add_argument("--rates", default="2,8,32", help="request rates of the sweep (default 2,8,32)")
    parser.add_argument("--num-prompts", default="48", help="requests per run (default 48)")
    parser.add_argument("--input-len", default="128:256", help="prompt tokens (default 128:256)")
    parser.add_argument("--output-len", default="32:64", help="output tokens (default 32:64)")
    parser.add_argument("--slo", default="ttft=500ms,tpot=50ms", help="SLO of the sweep (default ttft=500ms,tpot=50ms)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for ninefold serve (repeatable), e.g. --server-arg=--max-num-seqs=64")
    args = parser.parse_args(argv)
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="ninefold-serve-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    command = [sys.executable, "-m", "ninefold", "serve", "--port", str(port), "--log-level", "warning",
               "--served-model-name", "bench", *args.server_arg]
    command += ["--model", args.model] if args.model else []
    command += ["--device", args.device] if args.device else []
    log_path = out / "server.log"
    print(f"starting: {' '.join(command)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        if not _wait_healthy(server, base, log_path):
            return 1
        if not _check_streaming(base):
            return 1
        common = ["--base-url", base, "--model", "bench", "--num-prompts", args.num_prompts, "--input-len",
                  args.input_len, "--output-len", args.output_len, "--ignore-eos", "--timeout", "120"]
        plots = importlib.util.find_spec("matplotlib") is not None
        code = serve.main([*common, "--request-rate", "inf", "--slo", args.slo, "--output", str(out / "serve_inf.json"),
                           *(["--plot", str(out / "serve_inf.png")] if plots else [])])
        code = code or serve.main([*common, "--sweep-rates", args.rates, "--slo", args.slo,
                                   "--output", str(out / "serve_sweep.json"),
                                   *(["--plot", str(out / "serve_sweep.png")] if plots else [])])
        print(f"results in {out}")
        return code
    finally:
        _stop(server)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, base: str, log_path: Path) -> bool:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            print(f"server exited with {server.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}")
            return False
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    print(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text(errors='replace')[-3000:]}")
    return False


def _check_streaming(base: str) -> bool:
    """Greedy, ignore_eos, 24 tokens: usage counts them, and the stream spells the same text."""
    body = {"model": "bench", "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0.0,
            "ignore_eos": True}
    plain = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    if plain.status_code != 200:
        print(f"correctness check: HTTP {plain.status_code}: {plain.text[:500]}")
        return False
    data = plain.json()
    streamed = asyncio.run(_stream_text(base, body))
    checks = {
        "usage.completion_tokens == max_tokens": data["usage"]["completion_tokens"] == 24,
        "streamed text == non-streamed text": streamed == data["choices"][0]["text"],
    }
    for name, ok in checks.items():
        print(f"correctness: {name}: {'ok' if ok else 'FAILED'}")
    if not all(checks.values()):
        print(f"  non-streamed: {data['choices'][0]['text']!r}\n  streamed:     {streamed!r}")
    return all(checks.values())


async def _stream_text(base: str, body: dict) -> str:
    from ninefold.bench.serve_client import StreamClient
    from ninefold.bench.serve_datasets import BenchRequest

    client = StreamClient(base, body["model"], ignore_eos=True)
    async with httpx.AsyncClient(timeout=120) as http:
        result, text = await client.send(http, BenchRequest(body["prompt"], 0, body["max_tokens"]), time.perf_counter())
    return text if result.success else f"<failed: {result.error}>"


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    sys.exit(main())
