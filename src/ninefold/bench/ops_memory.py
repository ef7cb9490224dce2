"""Memory-bound Triton operators: correctness, then a launch-configuration sweep at a model's shapes.

    OUT=DIR python -m ninefold.bench.ops_memory              # GPU: Llama-3-8B shapes, bfloat16, < 3 min
    TRITON_INTERPRET=1 python -m ninefold.bench.ops_memory --device cpu --shapes tiny   # smoke test

For rms_norm, add_rms_norm, softmax, silu_and_mul, gelu_and_mul and rope it first checks every
launch-configuration candidate of the Triton kernel against the float64 reference (odd token
count) and against the vendor implementation (bfloat16, full size); then, for each token count,
times every candidate three ways:

* ``kernel``: the kernel alone (CUDA events around the call, L2 flushed before each repetition by
  a 256 MiB write that also hides the host's launch time), from which GB/s and the fraction of the
  copy ceiling come; the ceiling is measured here as a torch copy of a 1 GiB tensor;
* ``call``: one call on an idle GPU, timed with events as ``ninefold.bench.ops`` does it, so it
  includes the host's launch time (what small token counts are bound by);
* ``host``: wall time per call of 200 back-to-back calls (the host's launch rate).

The winner per operator is the candidate with the lowest kernel time at the largest token count
(ties within 1% go to the next largest); it is printed as the ``CONFIGS`` entry for its module.
The direct launcher (``ninefold.ops.triton.launch``) is compared with Triton's ordinary launch
path on the ``call``/``host`` figures. ``$OUT/ops_memory.json`` receives everything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from ninefold.bench.results import write_json
from ninefold.ops import references, registry, workloads

OPS = ("rms_norm", "add_rms_norm", "softmax", "silu_and_mul", "gelu_and_mul", "rope")

# Candidate launch configurations per operator (the module's OVERRIDE format).
CANDIDATES = {
    "rms_norm": [{"rows": 1, "num_warps": 4}, {"rows": 1, "num_warps": 8}, {"rows": 2, "num_warps": 8},
                 {"rows": 2, "num_warps": 16}, {"rows": 4, "num_warps": 16}, {"rows": 4, "num_warps": 32},
                 {"rows": 8, "num_warps": 16}, {"rows": 8, "num_warps": 32}, {"rows": 1, "num_warps": 8, "store": ".cs"},
                 {"rows": 4, "num_warps": 16, "store": ".cs"}, {"rows": 1, "num_warps": 8, "load": ""},
                 {"rows": 4, "num_warps": 16, "load": ""}],
    "softmax": [{"rows": 1, "num_warps": 4}, {"rows": 1, "num_warps": 8}, {"rows": 1, "num_warps": 16},
                {"rows": 2, "num_warps": 16}, {"rows": 4, "num_warps": 32}],
    "silu_and_mul": [{"block": 1024, "num_warps": 4}, {"block": 1024, "num_warps": 8}, {"block": 2048, "num_warps": 4},
                     {"block": 2048, "num_warps": 8}, {"block": 1024, "num_warps": 8, "flat": True},
                     {"block": 2048, "num_warps": 8, "flat": True}, {"block": 4096, "num_warps": 16, "flat": True},
                     {"block": 2048, "num_warps": 8, "store": ".cs"}, {"block": 1024, "num_warps": 4, "load": ""},
                     {"block": 2048, "num_warps": 8, "load": ""}],
    "rope": [{"tokens": 1, "num_warps": 8}, {"tokens": 2, "num_warps": 8}, {"tokens": 4, "num_warps": 4},
             {"tokens": 4, "num_warps": 8}, {"tokens": 8, "num_warps": 8}, {"tokens": 8, "num_warps": 16}],
}
CANDIDATES["add_rms_norm"] = CANDIDATES["rms_norm"]
CANDIDATES["gelu_and_mul"] = CANDIDATES["silu_and_mul"] + [{"block": 2048, "num_warps": 4, "libdevice_erf": True}]
# Smaller candidates where the interpreter runs the tiny shapes.
CPU_CANDIDATES = {"rms_norm": [{"rows": 1, "num_warps": 4}, {"rows": 4, "num_warps": 2}],
                  "softmax": [{"rows": 1, "num_warps": 4}, {"rows": 2, "num_warps": 4}],
                  "silu_and_mul": [{"block": 16, "num_warps": 4}, {"block": 64, "num_warps": 4, "flat": True}],
                  "rope": [{"tokens": 1, "num_warps": 4}, {"tokens": 4, "num_warps": 4}]}
CPU_CANDIDATES["add_rms_norm"] = CPU_CANDIDATES["rms_norm"]
CPU_CANDIDATES["gelu_and_mul"] = CPU_CANDIDATES["silu_and_mul"] + [{"block": 32, "num_warps": 4, "libdevice_erf": True}]


def module(op: str):
    """The ``ninefold.ops.triton`` module holding ``op``'s kernel (its ``OVERRIDE`` and ``CONFIGS``)."""
    from ninefold.ops.triton import activation, norm, rope, softmax

    return {"rms_norm": norm, "add_rms_norm": norm, "softmax": softmax, "silu_and_mul": activation,
            "gelu_and_mul": activation, "rope": rope}[op]


def impl(op: str, name: str):
    found = [i.fn for i in registry.implementations(op) if i.name == name]
    return found[0] if found else None


class Timer:
    """Kernel / call / host timings on one device (CUDA events on GPUs, perf_counter elsewhere)."""

    def __init__(self, device: torch.device, flush_bytes: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def once(self, fn) -> float:
        """Microseconds of one call of ``fn`` (CUDA events recorded around it on GPUs)."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def kernel(self, fn, reps: int) -> float:
        """Median microseconds of ``fn`` with L2 flushed before each repetition (the flush, queued
        first, also covers the host's launch time)."""
        fn()
        self.sync()
        times = []
        for _ in range(reps):
            self.flush.zero_()
            times.append(self.once(fn))
        return statistics.median(times)

    def call(self, fn, reps: int) -> float:
        """Median microseconds of one call on an idle device, host launch included."""
        fn()
        times = []
        for _ in range(reps):
            self.sync()
            times.append(self.once(fn))
        return statistics.median(times)

    def host(self, fn, n: int) -> float:
        """Microseconds per call of ``n`` back-to-back calls (then one synchronisation)."""
        fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / n * 1e6


def copy_time(timer: Timer, traffic: int, reps: int) -> float:
    """Microseconds of a torch copy moving ``traffic`` bytes (half read, half written)."""
    src = torch.empty(traffic // 4, dtype=torch.bfloat16, device=timer.device)
    dst = torch.empty_like(src)
    return timer.kernel(lambda: dst.copy_(src), reps)


def copy_ceiling(timer: Timer, nbytes: int) -> float:
    """Copy bandwidth in GB/s (bytes read + written) of a torch copy of ``nbytes``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=timer.device)
    dst = torch.empty_like(src)
    us = timer.kernel(lambda: dst.copy_(src), reps=10)
    return 2 * nbytes / us / 1e3


def _error(got, want) -> float:
    got, want = got.detach().to("cpu", torch.float64), want.detach().to("cpu", torch.float64)
    return ((got - want).abs() / (want.abs() + 1)).max().item() if got.numel() else 0.0


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _device_error(got, want) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs() / (want.abs() + 1)).max().item() if got.numel() else 0.0


def check(op: str, fn, case, want, tol: float) -> str | None:
    """``None`` when ``fn``'s outputs match ``want``: float64 references (CPU tensors, compared in
    float64) or the vendor outputs (compared on the device, twice the tolerance)."""
    got = _outputs(fn(*case.args, **case.kwargs))
    for g, w in zip(got, want, strict=True):
        if w.dtype == torch.float64:
            if (err := _error(g, w)) > tol:
                return f"vs float64 reference: max relative error {err:.3g} > {tol}"
        elif (err := _device_error(g, w)) > 2 * tol:
            return f"vs vendor: max relative error {err:.3g} > {2 * tol}"
    return None


def _case(op: str, shapes, device, dtype, tokens: int):
    """``op``'s call at ``tokens`` tokens (workloads' cases rebuilt at any token count)."""
    one = workloads.Shapes(**{**shapes.__dict__, "tokens": (tokens,)})
    case = next(workloads.cases(op, one, device, dtype))
    case.kwargs = dict(KWARGS.get(op, {}))
    return case


# Keyword arguments the benchmark cases leave to the operators' defaults.
KWARGS = {"gelu_and_mul": {"approximate": "none"}, "softmax": {"dim": -1}, "rope": {"is_neox": True}}


def _with(op: str, cfg: dict | None, fn):
    mod = module(op)

    def run(*args, **kwargs):
        mod.OVERRIDE.clear()
        if cfg:
            mod.OVERRIDE.update(cfg)
        return fn(*args, **kwargs)

    return run


def _bound(fn, case):
    return lambda: fn(*case.args, **case.kwargs)


def _label(cfg: dict | None) -> str:
    return "default" if not cfg else ",".join(f"{k}={v}" for k, v in cfg.items())


def bench(args) -> dict:
    from ninefold.ops.triton import launch

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = workloads.shapes(args.shapes)
    cuda = device.type == "cuda"
    if cuda and os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("ops_memory: unset TRITON_INTERPRET for the GPU run")
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("ops_memory: on the CPU the Triton kernels run only with TRITON_INTERPRET=1")
    start = time.perf_counter()
    deadline = start + args.budget
    timer = Timer(device, (256 << 20) if cuda else (1 << 20))
    tokens = tuple(args.tokens) if args.tokens else shapes.tokens
    candidates = CANDIDATES if cuda else CPU_CANDIDATES
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "dtype": args.dtype,
              "shapes": args.shapes, "torch": torch.__version__, "triton": _triton_version(), "tokens": tokens,
              "correctness": {}, "timings": [], "launch": [], "winners": {}, "skipped_for_time": []}
    result["copy_GBps"] = copy_ceiling(timer, (1 << 30) if cuda else (1 << 24))
    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}  copy ceiling "
          f"{result['copy_GBps']:.0f} GB/s")

    failed = False
    for op in args.ops:
        triton_fn, vendor = impl(op, "triton"), impl(op, "vendor")
        # An odd token count against the float64 reference (both launch paths), then a large one
        # against the vendor implementation.
        small, large = _case(op, shapes, device, dtype, 37 if cuda else 5), _case(op, shapes, device, dtype,
                                                                                min(2048, max(tokens)))
        wants = [(small, _outputs(getattr(references, op)(*small.args, **small.kwargs)), (True, False))]
        if vendor is not None:
            wants.append((large, _outputs(vendor(*large.args, **large.kwargs)), (True,)))
        for cfg in [None, *candidates[op]]:
            errors = []
            for case, want, paths in wants:
                for fast in paths:
                    launch.ENABLED = fast and launch.AVAILABLE
                    try:
                        err = check(op, _with(op, cfg, triton_fn), case, want, tol)
                    except Exception as e:  # noqa: BLE001  (a config that fails to compile is reported)
                        err = f"{type(e).__name__}: {str(e)[:200]}"
                    if err:
                        errors.append(f"{case.label} fast_launch={fast}: {err}")
            launch.ENABLED = launch.AVAILABLE
            result["correctness"][f"{op} {_label(cfg)}"] = errors or "ok"
            if errors:
                failed = True
                print(f"FAIL {op} {_label(cfg)}: {errors[0]}")
        module(op).OVERRIDE.clear()
        del small, large, wants
    print("correctness:", "FAILED (see above)" if failed else "all candidates match the references")

    ceiling = result["copy_GBps"]
    for t in sorted(tokens, reverse=True):
        for op in args.ops:
            if time.perf_counter() > deadline:
                result["skipped_for_time"].append(f"{op} T={t}")
                continue
            case = _case(op, shapes, device, dtype, t)
            reps = 20 if cuda else 3
            row = {"op": op, "tokens": t, "label": case.label, "bytes": case.bytes, "configs": []}
            triton_fn = impl(op, "triton")
            for cfg in [None, *candidates[op]]:
                if not isinstance(result["correctness"].get(f"{op} {_label(cfg)}"), str):
                    continue
                fn = _with(op, cfg, triton_fn)
                try:
                    us = timer.kernel(_bound(fn, case), reps)
                except Exception as e:  # noqa: BLE001
                    row["configs"].append({"config": _label(cfg), "error": str(e)[:200]})
                    continue
                row["configs"].append({"config": _label(cfg), "cfg": cfg, "kernel_us": round(us, 2),
                                       "GBps": round(case.bytes / us / 1e3, 1),
                                       "fraction": round(case.bytes / us / 1e3 / ceiling, 3)})
            module(op).OVERRIDE.clear()
            vendor = impl(op, "vendor")
            if vendor is not None:
                us = timer.kernel(_bound(vendor, case), reps)
                row["vendor"] = {"kernel_us": round(us, 2), "fraction": round(case.bytes / us / 1e3 / ceiling, 3)}
            if t >= 2048 or not cuda:
                row["peers"] = peer_timings(op, case, timer, reps, ceiling)
                # The same traffic as one torch copy: the practical ceiling at this size.
                copy_us = copy_time(timer, case.bytes, reps)
                row["copy_same_bytes"] = {"kernel_us": round(copy_us, 2),
                                          "fraction": round(case.bytes / copy_us / 1e3 / ceiling, 3)}
            default = next((c for c in row["configs"] if c["config"] == "default" and "kernel_us" in c), None)
            # Launch paths: one call on an idle device and the back-to-back rate, direct vs Triton's own.
            if default is not None and t in (min(tokens), max(tokens)):
                for fast in (True, False):
                    launch.ENABLED = fast and launch.AVAILABLE
                    fn = _bound(triton_fn, case)
                    entry = {"op": op, "tokens": t, "fast_launch": fast, "call_us": round(timer.call(fn, reps), 2),
                             "host_us": round(timer.host(fn, 200 if cuda else 5), 2)}
                    result["launch"].append(entry)
                    default[f"call_us_{'fast' if fast else 'triton'}"] = entry["call_us"]
                launch.ENABLED = launch.AVAILABLE
                if vendor is not None:
                    fn = _bound(vendor, case)
                    result["launch"].append({"op": op, "tokens": t, "vendor": True,
                                             "call_us": round(timer.call(fn, reps), 2),
                                             "host_us": round(timer.host(fn, 200 if cuda else 5), 2)})
                if op == "rms_norm" and t == min(tokens):
                    result["host_parts"] = host_parts(case, timer, 200 if cuda else 5)
            result["timings"].append(row)
            _print_row(row)
    result["winners"] = winners(result["timings"])
    result["best_per_tokens"] = best_per_tokens(result["timings"])
    result["failed"] = failed
    result["seconds"] = round(time.perf_counter() - start, 1)
    _print_summary(result)
    return result


def host_parts(case, timer: Timer, n: int) -> dict:
    """Host microseconds per call of the pieces of a Triton rms_norm call (back-to-back calls)."""
    from ninefold.ops.triton import launch, norm

    x, weight, eps = case.args
    out = torch.empty_like(x)
    d = x.shape[-1]
    cfg = norm.config(d, x.shape[0], False)
    args = (x, x, weight, out, out, x.shape[0], d, d, d, d, d, eps)
    consts = (False, triton_next_pow2(d))
    parts = {
        "empty_like": lambda: torch.empty_like(x, memory_format=torch.contiguous_format),
        "launcher_key": lambda: launch.Launcher.key(args, consts, cfg["num_warps"], 2),
        "config_lookup": lambda: norm.config(d, x.shape[0], False),
        "whole_call": lambda: norm.rms_norm(x, weight, eps),
    }
    return {name: round(timer.host(fn, n), 2) for name, fn in parts.items()}


def triton_next_pow2(n: int) -> int:
    import triton

    return triton.next_power_of_2(n)


def peer_timings(op: str, case, timer: Timer, reps: int, ceiling: float) -> dict:
    """Kernel times of FlagGems / Liger (where importable and they have ``op``), same method."""
    from ninefold.bench.ops import peers

    found = {}
    bound = (*case.args, *case.kwargs.values())
    for name, fn in peers(op).items():
        try:
            us = timer.kernel(lambda fn=fn: fn(*bound), reps)
        except Exception as e:  # noqa: BLE001  (a peer that fails is reported, not fatal)
            found[name] = {"error": str(e)[:200]}
            continue
        found[name] = {"kernel_us": round(us, 2), "fraction": round(case.bytes / us / 1e3 / ceiling, 3)}
    return found


def _triton_version() -> str:
    import triton

    return triton.__version__


def winners(rows: list[dict]) -> dict:
    """Per operator: the candidate with the lowest kernel time at the largest token count (within 1%:
    the faster one at the next token count decides)."""
    found = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: -r["tokens"])
        timed = [{c["config"]: c for c in r["configs"] if "kernel_us" in c and c["cfg"]} for r in mine]
        if not timed or not timed[0]:
            continue
        best = min(timed[0].values(), key=lambda c: c["kernel_us"])
        close = [c for c in timed[0].values() if c["kernel_us"] <= best["kernel_us"] * 1.01]
        if len(close) > 1 and len(timed) > 1:
            best = min(close, key=lambda c: timed[1].get(c["config"], {}).get("kernel_us", float("inf")))
        found[op] = {"config": best["cfg"], "tokens": mine[0]["tokens"], "fraction": best["fraction"]}
    return found


def _print_row(row: dict):
    ok = [c for c in row["configs"] if "kernel_us" in c]
    if not ok:
        print(f"{row['op']:13s} {row['label']:18s} no candidate ran")
        return
    best = min(ok, key=lambda c: c["kernel_us"])
    default = next((c for c in ok if c["config"] == "default"), best)
    vendor = row.get("vendor", {})
    peers = "".join(f" {name} {p['fraction'] * 100:.1f}%" for name, p in row.get("peers", {}).items() if "fraction" in p)
    if "copy_same_bytes" in row:
        peers += f" | copy@size {row['copy_same_bytes']['fraction'] * 100:.1f}%"
    calls = f" call {default.get('call_us_fast', 0):.1f}/{default.get('call_us_triton', 0):.1f}us" if (
        "call_us_fast" in default) else ""
    print(f"{row['op']:13s} {row['label']:18s} best {best['config']:22s} {best['kernel_us']:9.1f}us "
          f"{best['GBps']:7.0f} GB/s {best['fraction'] * 100:5.1f}% | default {default['fraction'] * 100:5.1f}% | "
          f"vendor {vendor.get('fraction', 0) * 100:5.1f}%{peers}{calls}")
    if row["tokens"] >= 2048 and len(ok) > 1:
        print("    " + "  ".join(f"{c['config']}: {c['fraction'] * 100:.1f}%" for c in ok))


def best_per_tokens(rows: list[dict]) -> dict:
    """{op: {tokens: best candidate config}} (for the token-count buckets of the CONFIGS tables)."""
    found: dict = {}
    for r in rows:
        timed = [c for c in r["configs"] if "kernel_us" in c and c["cfg"]]
        if timed:
            best = min(timed, key=lambda c: c["kernel_us"])
            found.setdefault(r["op"], {})[r["tokens"]] = {"config": best["cfg"], "kernel_us": best["kernel_us"]}
    return found


def _print_summary(result: dict):
    print("\ncall = one call on an idle GPU incl. host launch (direct launcher / Triton's launch path)")
    for op, per in result["best_per_tokens"].items():
        print(f"best {op:13s} " + "  ".join(f"T={t}: {_label(b['config'])}" for t, b in sorted(per.items())))
    for op, w in result["winners"].items():
        print(f"winner {op:13s} T={w['tokens']}: {w['config']} ({w['fraction'] * 100:.1f}% of copy)")
    if result["skipped_for_time"]:
        print("skipped for time:", ", ".join(result["skipped_for_time"]))
    if "host_parts" in result:
        print("host us per call (rms_norm T=min):", result["host_parts"])
    vendor_calls = [e for e in result["launch"] if e.get("vendor")]
    if vendor_calls:
        print("vendor call/host us: " + "  ".join(f"{e['op']} T={e['tokens']} {e['call_us']}/{e['host_us']}"
                                                 for e in vendor_calls))
    print(f"done in {result['seconds']} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="llama-8b", help="workloads shape set (llama-8b, smollm2, tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    parser.add_argument("--tokens", nargs="+", type=int, help="token counts (default: the shape set's)")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for the timing sweep")
    args = parser.parse_args(argv)
    result = bench(args)
    write_json("ops_memory.json", result, default=str, announce=True)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
