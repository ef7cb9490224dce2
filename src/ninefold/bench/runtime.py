"""Runtime benchmark: ``python -m ninefold.bench.runtime [--device cuda:0]``.

1. Correctness on the device first: KV swap round trip (with reuse of swapped-out blocks), CUDA
   graph replay against eager calls, a task graph across two streams, a workspace loop that
   allocates nothing.
2. The device's hardware profile, compared with the reference figures of the H200 in DESIGN.md.
3. CUDA graphs: eager calls against replays of a small 16-layer step at batch 1, 8 and 32.
4. KV swap on the copy stream overlapping a matmul loop on the compute stream, with the timeline of
   both streams (event times from a common start).

Prints short tables; writes everything to ``$OUT/runtime.json`` when ``OUT`` is set. On the CPU the
same steps run with small sizes (swaps are plain copies there and cannot overlap).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch

from ninefold.runtime import CudaGraphRunner, Device, KVCachePool, TaskGraph, Workspace
from ninefold.runtime.profile import profile_device

# DESIGN.md, measured on the H200 on 2026-12-02.
H200_REFERENCE = {"copy": 4248e9, "bfloat16_4096": 723e12, "bfloat16_8192": 682e12}


def main(argv: list[str] | None = None) -> int:
    """Run the checks and benchmarks; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.runtime", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="torch device (default: cuda:0 when present, else cpu)")
    args = parser.parse_args(argv)
    dev = Device(args.device) if args.device else Device.current()
    big = dev.is_accelerator
    results: dict = {"device": str(dev.torch), "name": dev.name, "torch": torch.__version__,
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    t0 = time.perf_counter()

    print(f"== correctness on {dev.torch} ({dev.name})", flush=True)
    results["checks"] = run_checks(dev)
    for name, status in results["checks"].items():
        print(f"  {name:<34} {status}")

    print("== hardware profile", flush=True)
    profile = profile_device(dev, refresh=True)
    results["profile"] = profile.to_dict()
    results["profile_vs_design"] = print_profile(profile)

    hidden = 1024 if big else 128
    print(f"== CUDA graphs: eager calls vs replays (16 layers of bf16 [B,{hidden}] @ [{hidden},{hidden}] + SiLU)", flush=True)
    results["cuda_graph"] = bench_cuda_graph(dev, hidden=hidden, batches=(1, 8, 32))
    print_rows(["batch", "eager us", "replay us", "speed-up"],
               [[r["batch"], f"{r['eager_us']:.1f}", f"{r['replay_us']:.1f}", f"{r['speedup']:.2f}x"]
                for r in results["cuda_graph"]])

    print("== KV swap on the copy stream overlapping matmuls on the compute stream", flush=True)
    swap = bench_swap_overlap(dev, num_swap=256 if big else 8, num_layers=32 if big else 2)
    results["kv_swap"] = swap
    print_swap(swap)

    results["seconds"] = round(time.perf_counter() - t0, 1)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "runtime.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(out, "runtime.md"), "w") as f:
            f.write(markdown(results))
        print(f"wrote {os.path.join(out, 'runtime.json')} and runtime.md (tables for docs/perf/runtime.md)")
    print(f"done in {results['seconds']} s")
    return 0


# -- 1. correctness -----------------------------------------------------------------------------------

def run_checks(dev: Device) -> dict[str, str]:
    """Each check raises AssertionError on a wrong result; returns name -> 'ok'."""
    checks = {}

    pool = KVCachePool(4, 2, 64, 16, torch.bfloat16, dev, 16, policy="swap", num_host_blocks=8)
    ids = pool.allocate(8)
    data = torch.randn(4, 2, 8, 16, 2, 64, device=dev.torch).to(torch.bfloat16)
    for layer in range(4):
        pool.k_cache(layer)[ids] = data[layer, 0]
        pool.v_cache(layer)[ids] = data[layer, 1]
    host = pool.swap_out(ids)
    scratch = pool.allocate(16)  # takes the swapped-out blocks too: must wait for their copies
    for layer in range(4):
        pool.k_cache(layer)[scratch] = 0
        pool.v_cache(layer)[scratch] = 0
    pool.free(scratch)
    back = pool.swap_in(host)
    got = torch.stack([torch.stack([pool.k_cache(i)[back], pool.v_cache(i)[back]]) for i in range(4)])
    assert torch.equal(got, data), "KV swap round trip changed the data"
    checks["kv swap round trip (reused blocks)"] = "ok"

    x = torch.randn(8, 256, device=dev.torch)
    weights = [torch.randn(256, 256, device=dev.torch) / 16 for _ in range(4)]

    def step(inp):
        for w in weights:
            inp = torch.nn.functional.silu(inp @ w)
        return inp

    runner = CudaGraphRunner(step, [1, 4, 8], (x,))
    for batch in (1, 3, 8):
        xb = torch.randn(batch, 256, device=dev.torch)
        torch.testing.assert_close(runner(xb), step(xb), rtol=1e-4, atol=1e-4)  # padded batches may pick other kernels
    checks["CUDA graph replay == eager" if runner.enabled else "graph runner (eager on this device)"] = "ok"

    g = TaskGraph(dev)
    src = torch.arange(4096, dtype=torch.float32)  # every partial sum stays exact in float32
    src = dev.pin(src)
    loaded = g.add(lambda: src.to(dev.torch, non_blocking=True), stream="copy")
    doubled = g.add(torch.mul, loaded, 2)
    total = g.add(torch.sum, doubled, name="total")
    assert total.deps == (doubled,)
    assert g.run()["total"].item() == float(src.double().sum() * 2), "task graph across streams"
    checks["task graph across two streams"] = "ok"

    ws = Workspace(dev)
    a = torch.randn(512, 512, device=dev.torch)
    for _ in range(3):
        torch.matmul(a, a, out=ws.get("out", (512, 512), torch.float32))
    assert ws.allocations == 1, "workspace reallocated in a steady loop"
    if dev.type == "cuda":
        dev.synchronize()
        before = torch.cuda.memory_stats(dev.torch)["allocation.all.allocated"]
        for _ in range(10):
            torch.matmul(a, a, out=ws.get("out", (512, 512), torch.float32))
        dev.synchronize()
        assert torch.cuda.memory_stats(dev.torch)["allocation.all.allocated"] == before, "allocations in steady loop"
    checks["workspace steady loop allocates nothing"] = "ok"
    return checks


# -- 2. profile -------------------------------------------------------------------------------------

def print_profile(profile) -> dict:
    """Print the profile; returns the ratios to DESIGN.md's H200 figures (when this is an H200)."""
    c, link = profile.compute, profile.interconnect
    rows = [[k, f"{v / 1e12:.4g} TFLOP/s", f"n={profile.measured['matmul_n'][k]}"] for k, v in c.items()]
    rows.append(["copy (read+written)", f"{profile.bandwidth['copy'] / 1e9:.5g} GB/s",
                 f"{profile.measured['copy_bytes'] / 2**30:.2f} GiB"])
    rows.append(["capacity", f"{profile.capacity['total'] / 2**30:.1f} GiB", f"free {profile.capacity['free'] / 2**30:.1f} GiB"])
    for key in ("host_to_device", "device_to_host", "loopback_tcp"):
        if key in link:
            rows.append([key, f"{link[key] / 1e9:.4g} GB/s", "pinned" if "device" in key else ""])
    for peer, rate in link.get("device_to_device", {}).items():
        rows.append([f"to {peer}", f"{rate / 1e9:.4g} GB/s", ""])
    print_rows(["what", "measured", "how"], rows)
    if "H200" not in profile.name:
        return {}
    ratios = {"copy": profile.bandwidth["copy"] / H200_REFERENCE["copy"],
              "bfloat16_mm": c["bfloat16"] / H200_REFERENCE[f"bfloat16_{profile.measured['matmul_n']['bfloat16']}"]}
    print(f"  vs DESIGN.md (2026-12-02): copy {ratios['copy']:.2f}x of 4248 GB/s, "
          f"bf16 mm {ratios['bfloat16_mm']:.2f}x of the reference at the same n")
    return ratios


# -- 3. CUDA graphs -------------------------------------------------------------------------------

def bench_cuda_graph(dev: Device, *, hidden: int, batches: tuple[int, ...]) -> list[dict]:
    """Per-call time of a 16-layer step: eager against graph replay (input copy included)."""
    dtype = torch.bfloat16
    weights = [torch.randn(hidden, hidden, device=dev.torch).to(dtype) / math.sqrt(hidden) for _ in range(16)]

    def step(x):
        for w in weights:
            x = torch.nn.functional.silu(x @ w)
        return x

    runner = CudaGraphRunner(step, list(batches), (torch.randn(max(batches), hidden, device=dev.torch).to(dtype),))
    runner.capture()
    rows = []
    for batch in batches:
        x = torch.randn(batch, hidden, device=dev.torch).to(dtype)
        torch.testing.assert_close(runner(x), step(x), rtol=2e-2, atol=2e-2)
        reps = 200 if dev.is_accelerator else 10
        eager = per_call(dev, lambda x=x: step(x), reps)
        replay = per_call(dev, lambda x=x: runner(x), reps)
        rows.append({"batch": batch, "eager_us": eager * 1e6, "replay_us": replay * 1e6, "speedup": eager / replay,
                     "graphs": runner.enabled})
    return rows


def per_call(dev: Device, fn, reps: int = 200) -> float:
    """Median over 5 rounds of the seconds per call (``reps`` calls, then one synchronize)."""
    fn()
    dev.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dev.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


# -- 4. KV swap overlapping compute ---------------------------------------------------------------

def bench_swap_overlap(dev: Device, *, num_swap: int, num_layers: int) -> dict:
    """Swap ``num_swap`` blocks out and back, alone, then while a matmul loop runs on the compute stream."""
    pool = KVCachePool(num_layers, 8, 128, 16, torch.bfloat16, dev, 2 * num_swap, policy="swap",
                       num_host_blocks=num_swap)
    ids = pool.allocate(num_swap)
    for layer in range(num_layers):
        pool.k_cache(layer).normal_()
        pool.v_cache(layer).normal_()
    reference = torch.stack([torch.stack([pool.k_cache(i)[ids], pool.v_cache(i)[ids]]) for i in range(num_layers)])
    swap_bytes = num_swap * pool.bytes_per_block

    n = 8192 if dev.is_accelerator else 256
    a = torch.randn(n, n, device=dev.torch).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev.torch).to(torch.bfloat16)
    c = torch.empty_like(a)
    state = {"ids": ids, "host": None, "k": 1}

    def compute():
        for _ in range(state["k"]):
            torch.mm(a, b, out=c)

    def swap_out():
        state["host"] = pool.swap_out(state["ids"])

    def swap_in(wait=True):
        state["ids"] = pool.swap_in(state["host"], wait=wait)

    def wall(fn):
        dev.synchronize()
        t0 = time.perf_counter()
        fn()
        pool.wait_for_swaps()
        dev.synchronize()
        return time.perf_counter() - t0

    # Warm up both directions, then time each part alone.
    swap_out()
    swap_in()
    outs, ins = [], []
    for _ in range(3):
        outs.append(wall(swap_out))
        ins.append(wall(swap_in))
    out_alone, in_alone = statistics.median(outs), statistics.median(ins)
    compute()  # warm-up
    one_mm = wall(compute)
    state["k"] = min(50, max(1, round(max(out_alone, in_alone) / max(one_mm, 1e-9))))
    compute_alone = statistics.median(wall(compute) for _ in range(3))

    timeline = {}

    def overlapped(direction: str):
        def both():
            start = dev.event(enable_timing=True)
            marks = [dev.event(enable_timing=True) for _ in range(4)]
            start.record(dev.current_stream())
            if pool.copy_stream is not None:
                marks[0].record(pool.copy_stream)
            if direction == "out":
                swap_out()
            else:
                swap_in(wait=False)
            if pool.copy_stream is not None:
                marks[1].record(pool.copy_stream)
            marks[2].record(dev.current_stream())
            compute()
            marks[3].record(dev.current_stream())
            timeline["events"] = (start, marks)
        return both

    rows = {}
    for direction, alone in (("out", out_alone), ("in", in_alone)):
        if direction == "in":
            swap_out()
        seconds = wall(overlapped(direction))
        if direction == "out":
            swap_in()
        entry = {"swap_alone_ms": alone * 1e3, "compute_alone_ms": compute_alone * 1e3,
                 "together_ms": seconds * 1e3, "serial_ms": (alone + compute_alone) * 1e3,
                 "hidden_fraction": min(1.0, max(0.0, (alone + compute_alone - seconds) / min(alone, compute_alone)))
                 if pool.copy_stream is not None else None}  # on the CPU swaps are synchronous copies
        if dev.is_accelerator:
            start, marks = timeline["events"]
            copy_span = (start.elapsed_time(marks[0]), start.elapsed_time(marks[1]))
            compute_span = (start.elapsed_time(marks[2]), start.elapsed_time(marks[3]))
            entry["copy_stream_ms"] = copy_span
            entry["compute_stream_ms"] = compute_span
            entry["overlap_ms"] = max(0.0, min(copy_span[1], compute_span[1]) - max(copy_span[0], compute_span[0]))
        rows[direction] = entry

    got = torch.stack([torch.stack([pool.k_cache(i)[state["ids"]], pool.v_cache(i)[state["ids"]]])
                       for i in range(num_layers)])
    assert torch.equal(got, reference), "KV data changed across the overlapped swaps"
    return {"blocks": num_swap, "bytes": swap_bytes, "block_bytes": pool.bytes_per_block, "matmuls": state["k"],
            "matmul_n": n, "swap_out_GBps": swap_bytes / out_alone / 1e9, "swap_in_GBps": swap_bytes / in_alone / 1e9,
            "data_intact": True, **{f"swap_{k}": v for k, v in rows.items()}}


def print_swap(swap: dict) -> None:
    """A row per direction: alone, together, hidden fraction, and the two streams' spans."""
    print(f"  {swap['blocks']} blocks x {swap['block_bytes'] / 2**20:.1f} MiB = {swap['bytes'] / 2**20:.0f} MiB; "
          f"out {swap['swap_out_GBps']:.1f} GB/s, in {swap['swap_in_GBps']:.1f} GB/s alone; "
          f"compute = {swap['matmuls']} x mm bf16 n={swap['matmul_n']}; data intact: {swap['data_intact']}")
    rows = []
    for direction in ("out", "in"):
        e = swap[f"swap_{direction}"]
        spans = (f"copy {e['copy_stream_ms'][0]:.2f}-{e['copy_stream_ms'][1]:.2f}, "
                 f"compute {e['compute_stream_ms'][0]:.2f}-{e['compute_stream_ms'][1]:.2f}, "
                 f"overlap {e['overlap_ms']:.2f}") if "overlap_ms" in e else "-"
        rows.append([f"swap {direction}", f"{e['swap_alone_ms']:.2f}", f"{e['compute_alone_ms']:.2f}",
                     f"{e['serial_ms']:.2f}", f"{e['together_ms']:.2f}", _percent(e["hidden_fraction"]), spans])
    print_rows(["", "swap ms", "compute ms", "sum ms", "together ms", "hidden", "stream spans ms"], rows)


def markdown(results: dict) -> str:
    """The measured tables in the layout of docs/perf/runtime.md."""
    p = results["profile"]
    c, link, n = p["compute"], p["interconnect"], p["measured"]["matmul_n"]
    lines = [f"`python -m ninefold.bench.runtime`, {results['date']}, {results['name']} ({results['device']}), "
             f"torch {results['torch']}, {results['seconds']} s", "",
             "| what | measured |", "| --- | --- |"]
    lines += [f"| matmul {k} n={n[k]} | {v / 1e12:.4g} TFLOP/s |" for k, v in c.items()]
    lines.append(f"| copy {p['measured']['copy_bytes'] / 2**30:.2f} GiB, read + written | {p['bandwidth']['copy'] / 1e9:.0f} GB/s |")
    lines.append(f"| capacity total / free | {p['capacity']['total'] / 2**30:.1f} / {p['capacity']['free'] / 2**30:.1f} GiB |")
    for key in ("host_to_device", "device_to_host", "loopback_tcp"):
        if key in link:
            lines.append(f"| {key.replace('_', ' ')} | {link[key] / 1e9:.1f} GB/s |")
    for peer, rate in link.get("device_to_device", {}).items():
        lines.append(f"| to {peer} | {rate / 1e9:.1f} GB/s |")
    lines += ["", "| batch | eager us | replay us | speed-up |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['eager_us']:.1f} | {r['replay_us']:.1f} | {r['speedup']:.2f}x |"
              for r in results["cuda_graph"]]
    swap = results["kv_swap"]
    lines += ["", "| direction | swap alone ms | compute alone ms | together ms | hidden | copy stream span | compute stream span |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for direction in ("out", "in"):
        e = swap[f"swap_{direction}"]
        spans = [f"{e[k][0]:.2f}-{e[k][1]:.2f} ms" if k in e else "-" for k in ("copy_stream_ms", "compute_stream_ms")]
        lines.append(f"| {direction} | {e['swap_alone_ms']:.2f} | {e['compute_alone_ms']:.2f} | {e['together_ms']:.2f} "
                     f"| {_percent(e['hidden_fraction'])} | {spans[0]} | {spans[1]} |")
    return "\n".join(lines) + "\n"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def print_rows(header: list[str], rows: list[list]) -> None:
    """A plain aligned table."""
    table = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    sys.exit(main())
