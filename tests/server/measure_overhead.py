"""Server overhead on one stream: AsyncEngine in-process vs the same engine behind ``ninefold serve``.

Run: ``python -m tests.server.measure_overhead [--model DIR] [--tokens N] [--device cpu]`` from the repo
root (without --model it builds the tiny test model in a temporary directory). Prints one line.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time

import httpx


async def _direct(model: str, tokens: int, device: str) -> float:
    from ninefold.llm.async_engine import AsyncEngine
    from ninefold.llm.sampling import SamplingParams

    engine = AsyncEngine(model, device=device, max_model_len=tokens + 16, num_kv_blocks=(tokens + 32) // 16 + 2)
    try:
        start = time.perf_counter()
        async for _ in engine.generate([5], SamplingParams(max_tokens=tokens, ignore_eos=True, seed=0), "direct"):
            pass
        return time.perf_counter() - start
    finally:
        engine.shutdown()


def _served(model: str, tokens: int, device: str, port: int = 18599) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "ninefold", "serve", "--model", model, "--port", str(port), "--device", device,
           "--max-model-len", str(tokens + 16), "--num-kv-blocks", str((tokens + 32) // 16 + 2),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"prompt": [5], "max_tokens": tokens, "ignore_eos": True, "seed": 0, "stream": True}
        start = time.perf_counter()
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as response:
            chunks = sum(1 for line in response.iter_lines() if line.startswith("data: {"))
        return time.perf_counter() - start, chunks
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from tests.server.tiny_model import build_tiny_model

        model = str(build_tiny_model(tempfile.mkdtemp(prefix="ninefold-tiny-")).path)
    direct = asyncio.run(_direct(model, args.tokens, args.device))
    served, chunks = _served(model, args.tokens, args.device)
    n = args.tokens
    print(f"{n} tokens, one stream on {args.device}: AsyncEngine in-process {direct:.2f} s ({n / direct:.0f} tok/s); "
          f"through ninefold serve (HTTP + SSE) {served:.2f} s ({n / served:.0f} tok/s, {chunks} chunks)")


if __name__ == "__main__":
    main()
