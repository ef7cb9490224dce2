"""Time ``ops.linear_blocks`` on each kind of native block weight (CPU).

    python -m ninefold.bench.cpu_blocks [--n 8192] [--k 2048] [--rows 1,8,64] [--repeats 5]

Kinds: 4-bit affine codes (GGUF Q4_0/Q4_1/Q4_K), 5-bit affine codes (Q5_0/Q5_1/Q5_K), 4-bit codes of the sixteen
IQ4 levels (IQ4_NL/IQ4_XS) and 8-bit codes (Q8_0, requantized types), random codes and float16 scales of the same ``[N, K]`` shape. Each kind is
first checked against its dequantized weight times the int8-rounded activations (float64), then timed: best of
``--repeats`` loops, in ms per call and in GOP/s (2 N K rows / time). Full results go to ``$OUT/cpu_blocks.json``
when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import time

import torch

from ninefold import ops
from ninefold.bench.results import write_json
from ninefold.llm.gguf_dequant import IQ4_VALUES
from ninefold.ops import cpu_native
from ninefold.ops.quantized import quantize_activations


def block_weights(n: int, k: int, seed: int = 0) -> dict[str, ops.BlockWeight]:
    """One random ``[n, k]`` weight of each kind, by name."""
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand((n, k // 32), generator=g) * 0.02 + 0.001).half().float()
    nibbles = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    fives = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
    return {
        "4-bit affine": ops.BlockWeight(nibbles, scales, -8 * scales, 4),
        "5-bit affine": ops.BlockWeight(fives, scales, -16 * scales, 5),
        "4-bit levels": ops.BlockWeight(nibbles, scales, None, 4, levels=IQ4_VALUES),
        "8-bit": ops.BlockWeight(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), scales, None, 8),
    }


def check(weight: ops.BlockWeight, x: torch.Tensor) -> float:
    """Largest error of ``linear_blocks`` against the float64 product of what it multiplies, relative to the
    largest output."""
    want = quantize_activations(x).double() @ weight.dequantize64().T
    return ((ops.linear_blocks(x, weight).double() - want).abs().max() / want.abs().max()).item()


def time_call(weight: ops.BlockWeight, x: torch.Tensor, repeats: int) -> float:
    """Best seconds per call over ``repeats`` loops of several calls."""
    calls = max(1, 64 // x.shape[0])
    ops.linear_blocks(x, weight)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            ops.linear_blocks(x, weight)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def run(n: int, k: int, rows: list[int], repeats: int) -> list[dict]:
    results = []
    for kind, weight in block_weights(n, k).items():
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            error = check(weight, x)
            if error > 1e-4:
                raise AssertionError(f"{kind} at {m} rows: relative error {error:.2e} against float64")
            seconds = time_call(weight, x, repeats)
            results.append({"kind": kind, "rows": m, "n": n, "k": k, "ms": seconds * 1e3,
                            "gops": 2 * m * n * k / seconds / 1e9, "rel_error": error})
            print(f"{kind:14s} rows {m:4d}: {seconds * 1e3:8.3f} ms  {results[-1]['gops']:7.1f} GOP/s", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.cpu_blocks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--rows", default="1,8,64", help="comma-separated activation row counts")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not cpu_native.available():
        raise SystemExit(f"native CPU kernels unavailable: {cpu_native.reason()}")
    print(f"linear_blocks [{args.n}, {args.k}], {cpu_native.isa()} build, {torch.get_num_threads()} threads")
    results = run(args.n, args.k, [int(r) for r in args.rows.split(",")], args.repeats)
    write_json("cpu_blocks.json", {"isa": cpu_native.isa(), "threads": torch.get_num_threads(), "results": results},
               announce=True)


if __name__ == "__main__":
    main()
