"""Sweep of the Triton GEMV's launch configurations against cuBLAS at decode sizes (one CUDA device).

``OUT=DIR python -m ninefold.bench.ops_gemv`` checks the kernel against a float64 product, then
times ``ninefold.ops.triton.gemv`` for every candidate configuration and ``torch.nn.functional.linear``
on the Llama-3-8B layer shapes at 1, 4 and 16 rows (device time, see ``ninefold.ops.timing``),
printing GB/s over the weight bytes and the share of the copy bandwidth measured in the same
process. Results go to ``$OUT/ops_gemv.json``.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from ninefold.bench.results import write_json

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CANDIDATES = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
              for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4))
              if not (bn == 64 and bk == 512)]


def main() -> int:
    if not torch.cuda.is_available():
        print("ninefold.bench.ops_gemv needs a CUDA device; nothing measured.", file=sys.stderr)
        return 2
    from ninefold.bench.ops import ceilings
    from ninefold.ops import timing
    from ninefold.ops.triton import gemv

    dev = "cuda"
    copy_gbps = ceilings(torch.device(dev))["copy_GBps"]
    print(f"copy bandwidth {copy_gbps:.0f} GB/s")
    rows, failed = [], False
    saved = dict(gemv.CONFIG)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.double() @ w.double().T
            gbytes = (n * k + m * k + m * n) * 2 / 1e9
            vendor = timing.measure(lambda x=x, w=w: F.linear(x, w), dev)
            timed = []
            for cfg in CANDIDATES if name != "lm_head" else [saved]:
                gemv.CONFIG.clear()
                gemv.CONFIG.update(cfg)
                try:
                    err = (gemv.linear(x, w).double() - ref).abs().max().item()
                    if err > 0.1:
                        failed = True
                        timed.append({"config": cfg, "error": f"max abs error {err:.3g}"})
                        continue
                    us = timing.measure(lambda x=x, w=w: gemv.linear(x, w), dev)
                except Exception as error:  # noqa: BLE001  (a config that does not fit is reported)
                    timed.append({"config": cfg, "error": str(error)[:120]})
                    continue
                timed.append({"config": cfg, "us": us, "GBps": gbytes / us * 1e6})
            gemv.CONFIG.clear()
            gemv.CONFIG.update(saved)
            timed.sort(key=lambda t: t.get("us", float("inf")))
            best = timed[0]
            row = {"shape": name, "m": m, "n": n, "k": k, "vendor_us": vendor, "vendor_GBps": gbytes / vendor * 1e6,
                   "best": best, "default_us": next((t["us"] for t in timed if t["config"] == saved and "us" in t), None),
                   "all": timed}
            rows.append(row)
            print(f"{name:8s} M={m:<3d} cuBLAS {vendor:7.1f} us ({gbytes / vendor * 1e6 / copy_gbps:4.0%})  "
                  f"triton best {best.get('us', 0):7.1f} us ({best.get('GBps', 0) / copy_gbps:4.0%}) {best['config']}  "
                  f"default {row['default_us'] or 0:7.1f} us")
    write_json("ops_gemv.json", {"copy_GBps": copy_gbps, "rows": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
