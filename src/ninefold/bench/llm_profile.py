"""Where the engine's GPU time goes: kernel breakdown of decode steps and a step log of the offline run.

``OUT=DIR python -m ninefold.bench.llm_profile`` (one CUDA device; dummy Llama-3.1-8B weights) prints,
for CUDA-graph decode steps at a few batch sizes and contexts, the kernels that take the time (from
``torch.profiler``) with their share of the step, and, for the start of the offline workload of
``ninefold.bench.llm``, one line per kind of step (prefill / mixed / decode, batch size bucket) with
the time spent there. Full results go to ``$OUT/llm_profile.json``. ``--gaps`` instead measures how
long the device sits idle between the kernels of CUDA-graph decode steps (``$OUT/llm_profile_gaps.json``);
``--host`` and ``--whole-offline`` are described in ``--help``. This is a diagnostic for engine work,
not a benchmark with targets.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time

import torch

from ninefold.bench.results import write_json


def _kernel_table(prof, steps: int) -> list[dict]:
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name]
            entry[0] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            entry[1] += 1
    rows = [{"kernel": name[:110], "us_per_step": t / steps, "calls_per_step": n / steps} for name, (t, n) in totals.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def _decode_steps(engine, batch: int, context: int, *, seed: int, prefix: str, timed: int, profiled: int,
                  activities) -> tuple[float, object]:
    """Steady CUDA-graph decode of ``batch`` random prompts of ``context`` tokens: the wall ms per step over
    ``timed`` steps without the profiler, then ``profiled`` steps under ``torch.profiler``; the requests are
    aborted afterwards."""
    from torch.profiler import profile

    from ninefold.bench.llm import start_decoding
    from ninefold.llm.sampling import SamplingParams

    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    ids = start_decoding(engine, prompts, params, settle=3, prefix=prefix)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(timed):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / timed * 1e3
    with profile(activities=activities) as prof:
        for _ in range(profiled):
            engine.step()
        torch.cuda.synchronize()
    for rid in ids:
        engine.abort_request(rid)
    engine.sync()
    return wall_ms, prof


def profile_decode(engine, batch: int, context: int, steps: int = 10) -> dict:
    """Kernel time per CUDA-graph decode step at ``batch`` sequences of about ``context`` tokens."""
    from torch.profiler import ProfilerActivity

    wall_ms, prof = _decode_steps(engine, batch, context, seed=batch, prefix="p", timed=steps, profiled=steps,
                                  activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    kernels = _kernel_table(prof, steps)
    gpu_us = sum(r["us_per_step"] for r in kernels)
    print(f"\ndecode batch {batch} context ~{context}: step {wall_ms:.2f} ms wall, kernels {gpu_us / 1e3:.2f} ms "
          f"({sum(r['calls_per_step'] for r in kernels):.0f} kernels per step)")
    for r in kernels[:14]:
        print(f"  {r['us_per_step']:8.1f} us {r['us_per_step'] / max(gpu_us, 1e-9):5.1%} x{r['calls_per_step']:5.1f}  {r['kernel']}")
    return {"batch": batch, "context": context, "wall_ms": wall_ms, "kernel_ms": gpu_us / 1e3, "kernels": kernels}


def device_timeline(kernels: list[tuple[float, float, str]]) -> dict:
    """Busy and idle time of a device from its kernels' ``(start_us, end_us, name)``: busy is the union
    of the intervals; idle is each stretch where no kernel runs, charged to the pair of kernel kinds
    (``kernel_kind``) around it (the kernel that ended last, the one that starts); ``overlapping_starts`` counts kernels that start before every earlier
    one has ended (PDL launches, other streams)."""
    kernels = sorted(kernels, key=lambda k: k[0])
    idle, overlapping = 0.0, 0
    by_pair: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    edge, last = (kernels[0][1], kernels[0][2]) if kernels else (0.0, "")  # the latest end so far, and whose
    for start, end, name in kernels[1:]:
        pair = by_pair[f"{kernel_kind(last)} -> {kernel_kind(name)}"]
        pair[1] += 1
        if start > edge:
            idle += start - edge
            pair[0] += start - edge
        else:
            overlapping += 1
        if end > edge:
            edge, last = end, name
    span = max(k[1] for k in kernels) - kernels[0][0] if kernels else 0.0
    return {"busy_us": span - idle, "idle_us": idle, "overlapping_starts": overlapping,
            "idle_by_pair": dict(sorted(((k, (v[0], v[1])) for k, v in by_pair.items()), key=lambda kv: -kv[1][0]))}


def profile_gaps(engine, batch: int, context: int, steps: int = 6) -> dict:
    """Where a CUDA-graph decode step at ``batch`` sequences of about ``context`` tokens leaves the
    device idle: the union of kernel intervals (PDL kernels start before their predecessor ends, so
    summed durations overcount), the idle time between kernels grouped by the pair of kernel kinds
    around it, and the wall time per step without the profiler."""
    from torch.profiler import ProfilerActivity

    wall_ms, prof = _decode_steps(engine, batch, context, seed=batch * 7919 + context, prefix="g", timed=steps * 3,
                                  profiled=steps, activities=[ProfilerActivity.CUDA])
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    timeline = device_timeline(kernels)
    per = max(steps, 1)
    row = {"batch": batch, "context": context, "wall_ms": wall_ms, "kernels_per_step": len(kernels) / per,
           "busy_ms": timeline["busy_us"] / per / 1e3, "idle_between_kernels_ms": timeline["idle_us"] / per / 1e3,
           "starts_before_previous_end": timeline["overlapping_starts"] / per,
           "idle_by_pair_us": {k: {"us_per_step": us / per, "count_per_step": n / per}
                               for k, (us, n) in timeline["idle_by_pair"].items()}}
    print(f"\ngaps, decode batch {batch} context ~{context}: step {wall_ms:.2f} ms wall (no profiler), "
          f"kernels busy {row['busy_ms']:.2f} ms, idle between kernels {row['idle_between_kernels_ms']:.2f} ms, "
          f"{row['kernels_per_step']:.0f} kernels per step ({row['starts_before_previous_end']:.0f} start before "
          f"the previous ends)")
    for pair, v in list(row["idle_by_pair_us"].items())[:10]:
        print(f"  {v['us_per_step']:8.1f} us idle over {v['count_per_step']:5.1f} boundaries  {pair}")
    return row


def add_offline_requests(engine, num_requests: int, seed: int, prefix: str) -> None:
    """Queue the offline workload of ``ninefold.bench.llm``: prompt and output lengths uniform in
    100..1024, random token ids, greedy, ``ignore_eos``; request ids ``<prefix><i>``."""
    from ninefold.llm.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    for i in range(num_requests):
        p, o = rng.randint(100, 1024), rng.randint(100, 1024)
        sp = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        engine.add_request(engine.build_request([rng.randrange(vocab) for _ in range(p)], sp, f"{prefix}{i}"))


def offline_step_log(engine, num_requests: int, limit_s: float, seed: int = 0,
                     profile_steps: tuple[int, ...] = (0, 300, 700)) -> dict:
    """Run the offline workload of ``ninefold.bench.llm`` for ``limit_s`` seconds, timing every step
    (each followed by a device sync), and the kernels of the steps numbered in ``profile_steps``."""
    from torch.profiler import ProfilerActivity, profile

    add_offline_requests(engine, num_requests, seed, "off")
    planned: list = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        step = schedule()
        planned[:] = step
        return step  # the engine keeps the list of a step in flight: never hand it one that changes

    engine.scheduler.schedule = recording_schedule
    steps, profiled = [], []
    start = time.perf_counter()
    while engine.has_unfinished_requests() and time.perf_counter() - start < limit_s:
        watched = len(steps) in profile_steps
        prof = profile(activities=[ProfilerActivity.CUDA]) if watched else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.__enter__()
        engine.step()
        torch.cuda.synchronize()
        if prof is not None:
            prof.__exit__(None, None, None)
        dt = time.perf_counter() - t0
        steps.append({"ms": dt * 1e3, "seqs": len(planned), "waiting": len(engine.scheduler.waiting),
                      "new_tokens": sum(s.num_new_tokens for s in planned),
                      "context_tokens": sum(s.start + s.num_new_tokens for s in planned),
                      "longest_context": max((s.start + s.num_new_tokens for s in planned), default=0)})
        if prof is not None:
            kernels = _kernel_table(prof, 1)
            gpu_us = sum(r["us_per_step"] for r in kernels)
            info = steps[-1]
            print(f"\noffline step {len(steps) - 1}: {info['seqs']} seqs, {info['new_tokens']} new tokens, "
                  f"{info['context_tokens']} context tokens (longest {info['longest_context']}): "
                  f"{dt * 1e3:.2f} ms wall (profiler on), kernels {gpu_us / 1e3:.2f} ms")
            for r in kernels[:12]:
                print(f"  {r['us_per_step']:8.1f} us {r['us_per_step'] / max(gpu_us, 1e-9):5.1%} "
                      f"x{r['calls_per_step']:5.1f}  {r['kernel']}")
            profiled.append({"step": len(steps) - 1, **info, "kernel_ms": gpu_us / 1e3, "kernels": kernels})
    engine.scheduler.schedule = schedule
    elapsed = time.perf_counter() - start
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.sync()
    buckets: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for s in steps:
        kind = "decode" if s["new_tokens"] == s["seqs"] else "prefill/mixed"
        size = 1 << max(0, (s["seqs"] - 1).bit_length())
        b = buckets[f"{kind} seqs<={size}"]
        b[0] += s["ms"]
        b[1] += 1
    print(f"\noffline: {len(steps)} steps in {elapsed:.1f} s")
    for key, (ms, n) in sorted(buckets.items(), key=lambda kv: -kv[1][0]):
        print(f"  {key:28s} {n:5d} steps {ms / 1e3:7.2f} s  {ms / n:7.2f} ms/step")
    return {"elapsed_s": elapsed, "steps": steps, "profiled": profiled, "buckets": {k: {"s": v[0] / 1e3, "steps": v[1]} for k, v in buckets.items()}}


KERNEL_KINDS = (("attention", ("decode_split", "decode_merge", "prefill_kernel", "attention")),
                ("gemm", ("nvjet", "gemm", "splitKreduce", "cutlass", "gemv", "sm90_xmma")),
                ("norm", ("rms_norm", "application_fused", "norm")), ("activation", ("swiglu", "gated", "silu")),
                ("rope+cache", ("rope", "cache")), ("sampling", ("argmax", "sample", "softmax")),
                ("copies", ("Memcpy", "Memset", "copy", "gather", "index")))


def kernel_kind(name: str) -> str:
    """The kind of a kernel by its name (``KERNEL_KINDS``; "other" when none matches)."""
    for kind, keys in KERNEL_KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def offline_kernel_totals(engine, num_requests: int, seed: int = 0) -> dict:
    """The whole offline workload run as ``ninefold.bench.llm`` runs it (no sync per step), with
    every kernel recorded: device seconds per kind of kernel against the wall time."""
    from torch.profiler import ProfilerActivity, profile

    add_offline_requests(engine, num_requests, seed, "full")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kinds: dict[str, float] = collections.defaultdict(float)
    names: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            kinds[kernel_kind(event.name)] += us / 1e6
            names[event.name[:100]] += us / 1e6
    busy = sum(kinds.values())
    print(f"\noffline, whole run with every kernel recorded: {wall:.2f} s wall (profiler on), {busy:.2f} s of kernels")
    for kind, sec in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:12s} {sec:7.2f} s {sec / busy:6.1%}")
    top = sorted(names.items(), key=lambda kv: -kv[1])[:15]
    for name, sec in top:
        print(f"    {sec:7.3f} s  {name}")
    return {"wall_s": wall, "kernel_s": busy, "kinds_s": dict(kinds), "top_kernels_s": dict(top)}


def profile_host(engine, batch: int, steps: int = 200, top: int = 25) -> dict:
    """The host's own work in CUDA-graph decode steps at ``batch`` (64-token prompts): per-step wall
    time, the time waiting for tokens, and the functions (``cProfile``) that take the rest."""
    import cProfile
    import io
    import pstats

    from ninefold.bench.llm import start_decoding
    from ninefold.llm.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    ids = start_decoding(engine, [[(7 * i + 3) % 1000 for i in range(64)]] * batch, params, settle=5)
    sampler = engine.runner.sampler
    sampler.sync_seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    waited = sampler.sync_seconds
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    for rid in ids:
        engine.abort_request(rid)
    engine.sync()
    text, cumulative = io.StringIO(), io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    pstats.Stats(profiler, stream=cumulative).sort_stats("cumulative").print_stats(top)
    row = {"batch": batch, "step_ms": wall / steps * 1e3, "host_ms": (wall - waited) / steps * 1e3,
           "profile_tottime": text.getvalue(), "profile_cumulative": cumulative.getvalue()}
    print(f"\nhost, decode batch {batch}: step {row['step_ms']:.2f} ms, host (not waiting) {row['host_ms']:.3f} ms; "
          f"cProfile of {steps} more steps (its own overhead included), by own time:")
    print("\n".join(line for line in text.getvalue().splitlines()
                    if line.strip() and not line.strip().startswith(("Ordered by", "List reduced"))))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.llm_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--offline-seconds", type=float, default=40.0)
    parser.add_argument("--whole-offline", action="store_true",
                        help="only: the whole offline run with every kernel recorded, by kind of kernel")
    parser.add_argument("--gaps", action="store_true",
                        help="only: idle time between kernels of CUDA-graph decode steps at a few batch sizes")
    parser.add_argument("--host", action="store_true",
                        help="only: the host's own time per decode step at batch 1, 64 and 256, under cProfile")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ninefold.bench.llm_profile needs a CUDA device; nothing measured.", file=sys.stderr)
        return 2
    from ninefold.llm.engine import LLMEngine

    engine = LLMEngine(args.model, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=17408,
                       max_num_seqs=256, max_num_batched_tokens=16384)
    engine.stream_outputs = False
    if args.gaps:
        cases = ((1, 512), (64, 600), (128, 1000), (208, 900), (256, 600))
        write_json("llm_profile_gaps.json", {"gaps": [profile_gaps(engine, b, c) for b, c in cases]})
        return 0
    if args.host:
        write_json("llm_profile_host.json", {"host": [profile_host(engine, b) for b in (1, 64, 256)]})
        return 0
    if args.whole_offline:
        write_json("llm_profile_offline.json", {"offline_kernels": offline_kernel_totals(engine, 256)})
        return 0
    results = {"decode": [profile_decode(engine, b, c) for b, c in ((1, 256), (1, 4096), (64, 600), (256, 600))]}
    results["offline"] = offline_step_log(engine, 256, args.offline_seconds)
    write_json("llm_profile.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
