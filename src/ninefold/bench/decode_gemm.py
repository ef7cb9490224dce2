"""The linear layers of a batched decode step (Llama-3.1-8B shapes) at the batch sizes of the offline run.

    OUT=DIR python -m ninefold.bench.decode_gemm        # one CUDA device, bfloat16, about a minute

For each layer shape (qkv, o, gate_up, down, lm_head) and each batch ``M`` in ``--batches``, times
``linear`` through each implementation ``ninefold.ops`` has for it on the device (cuBLAS as
``vendor``, the DSL matmul as ``dsl``, the split-K GEMM as ``triton_gemm``, cuBLASLt with a measured algorithm as
``cublaslt``, each tuned on its first call), every one first checked against a
float32 product. Each timing is a CUDA graph of the call over several copies of the weight (so the
weight streams from memory, as in a model step), replayed; the figure is microseconds per call
next to its bound: max(weight bytes / copy bandwidth, FLOPs / cuBLAS bf16 rate), both measured in
the same process. Prints a table and writes ``$OUT/decode_gemm.json``. A diagnostic for the
engine's offline throughput, not a benchmark with targets.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ninefold.bench.results import write_json

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
BATCHES = (16, 64, 128, 160, 192, 224, 256)


def ceilings(device) -> tuple[float, float]:
    """Measured copy bandwidth (B/s) and cuBLAS bf16 rate (FLOP/s) of ``device``, printed."""
    from ninefold.runtime.profile import profile_device

    profile = profile_device(device)
    bw, rate = profile.bandwidth["copy"], profile.compute["bfloat16"]
    print(f"ceilings: copy {bw / 1e9:.0f} GB/s, cuBLAS bf16 {rate / 1e12:.0f} TFLOP/s", flush=True)
    return bw, rate


def rotating_weights(n: int, k: int, device) -> list[torch.Tensor]:
    """Copies of an ``[n, k]`` bf16 weight (about 512 MiB in all, 2-8 of them): timed over in turn, the
    weight streams from memory as in a model step instead of staying in L2."""
    copies = max(2, min(8, (512 << 20) // (n * k * 2)))
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def decode_cases(batches, names, device):
    """For each layer of ``names`` (``SHAPES``) and row count of ``batches``: ``(layer, m, n, k, x, weights,
    want)``, ``x`` random bf16 rows, ``weights`` the layer's ``rotating_weights`` (freed after its last row
    count), ``want`` the float32 product of ``x`` with the first copy."""
    for layer in names:
        n, k = SHAPES[layer]
        weights = rotating_weights(n, k, device)
        for m in batches:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            yield layer, m, n, k, x, weights, x.float() @ weights[0].float().T
        del weights
        torch.cuda.empty_cache()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over ``want``'s largest magnitude (the benches' check before timing)."""
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def bound_us(m: int, n: int, k: int, bw: float, rate: float) -> float:
    """max(weight bytes / copy bandwidth, FLOPs / cuBLAS rate) of ``[m, k] @ [n, k].T``, in us."""
    return max(n * k * 2 / bw, 2 * m * n * k / rate) * 1e6


def run(batches, names, only=None) -> dict:
    import ninefold.ops  # noqa: F401  (registers the implementations)
    from ninefold.bench.decode_attention import graph_time
    from ninefold.ops.cublaslt import tuning as cublaslt_tuning
    from ninefold.ops.registry import implementations
    from ninefold.ops.triton import gemm_tuning

    device = torch.device("cuda")
    bw, rate = ceilings(device)
    impls = {i.name: i for i in implementations("linear") if "cuda" in i.devices and torch.bfloat16 in i.dtypes
             and (only is None or i.name in only)}
    rows = []
    for layer, m, n, k, x, weights, want in decode_cases(batches, names, device):
        bound = bound_us(m, n, k, bw, rate)
        row = {"layer": layer, "m": m, "n": n, "k": k, "bound_us": round(bound, 2)}
        for impl, entry in impls.items():
            fn = entry.fn
            reason = entry.reason((x, weights[0], None))
            if reason:
                row[impl] = f"not supported: {reason}"
                continue
            try:
                with gemm_tuning.autotune(), cublaslt_tuning.autotune():  # tuned implementations measure first
                    got = fn(x, weights[0], None).float()
                if impl == "cublaslt":
                    times = cublaslt_tuning.measured_times(m, n, k, x.dtype, device) or {}
                    row["cublaslt_tuning_us"] = times
                    row["cublaslt_config"] = next(iter(times), "tuned in an earlier process")
                if impl == "triton_gemm":
                    cfg = gemm_tuning.choice(m, n, k, x.dtype, device, False)
                    row["triton_gemm_config"] = gemm_tuning.VENDOR if cfg is None else gemm_tuning.describe(cfg)
                    row["triton_gemm_tuning_us"] = gemm_tuning.measured_times(m, n, k, x.dtype, device)
                err = relative_error(got, want)
                if not err < 2e-2:
                    row[impl] = f"wrong (relative error {err:.3g})"
                    continue
                row[impl] = round(graph_time([lambda w=w, f=fn, x=x: f(x, w, None) for w in weights], device, 50), 2)
            except Exception as e:  # an implementation that cannot run this shape: say why, keep going
                row[impl] = f"{type(e).__name__}: {str(e)[:80]}"
        rows.append(row)
        cells = "  ".join(f"{i} {row[i]:8.2f} us ({bound / row[i]:4.0%})" if isinstance(row[i], float)
                          else f"{i} {row[i]}" for i in impls)
        for impl in impls:
            if f"{impl}_config" in row:
                top = list((row[f"{impl}_tuning_us"] or {}).items())[:3]
                cells += f"  [{impl}: {row[f'{impl}_config']}; tuner: {', '.join(f'{c} {t:.1f}' for c, t in top)}]"
        print(f"{layer:8s} M={m:<4d} bound {bound:8.2f} us  {cells}", flush=True)
    return {"device": torch.cuda.get_device_name(device), "copy_GBps": bw / 1e9, "matmul_TFLOPs": rate / 1e12,
            "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.decode_gemm", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--layers", default=",".join(SHAPES))
    parser.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                        help="torch.backends.cuda.preferred_blas_library for the vendor rows")
    parser.add_argument("--impls", default=None, help="comma-separated implementations to time (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ninefold.bench.decode_gemm needs a CUDA device; nothing measured.", file=sys.stderr)
        return 2
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    print(f"BLAS library: {torch.backends.cuda.preferred_blas_library()}; "
          f"CUBLASLT_WORKSPACE_SIZE={os.environ.get('CUBLASLT_WORKSPACE_SIZE', '(unset)')}")
    start = time.perf_counter()
    results = run([int(b) for b in args.batches.split(",")], args.layers.split(","),
                  args.impls.split(",") if args.impls else None)
    results["seconds"] = round(time.perf_counter() - start, 1)
    results["blas"] = str(torch.backends.cuda.preferred_blas_library())
    write_json(f"decode_gemm_{args.blas}.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
