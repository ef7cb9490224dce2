"""Device time of ``ninefold.ops.sample`` per decode step, against the step it belongs to.

    OUT=DIR python -m ninefold.bench.sampling [--vocab 128256] [--batches 1,16,64,256]   # one CUDA device, < 1 min

Logits ``[B, V]`` in bfloat16 (what the engine's models return), scaled like a language model's (a few nats of
spread); per batch size and filter setting (temperature only, top-p 0.95, top-k 50 with top-p 0.95, min-p 0.05,
and each with every row seeded), the median device time of ``ops.sample`` with its launches queued ahead of the
device (as the engine's host runs ahead of its decode graph; CUDA graphs not used: the engine samples eagerly after
the graph), its host time, and ``ops.argmax``'s device time (greedy) next to it; for the top-k setting, the same
through the engine's sampler (``torch.topk`` candidates).
Every setting first draws a batch and checks each token lies inside its row's filtered set (computed with a
float64 reference). Prints a table; ``$OUT/sampling.json`` holds every figure;
``--device cpu`` checks the code (wall times).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ninefold.bench.results import write_json

SETTINGS = {  # name: (top_k, top_p, min_p)
    "temperature": (0, 1.0, 0.0),
    "top_p": (0, 0.95, 0.0),
    "top_k+top_p": (50, 0.95, 0.0),
    "min_p": (0, 1.0, 0.05),
}
TEMPERATURE = 0.8


def allowed_tokens(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """``[B, V]`` bool: the tokens each row may draw under the filters (float64 reference, ties kept)."""
    x = logits.double() / TEMPERATURE
    probs = torch.softmax(x, dim=-1)
    keep = probs > 0
    if top_k > 0:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        keep &= probs >= kth
    if top_p < 1:
        renorm = torch.where(keep, probs, 0.0)
        renorm = renorm / renorm.sum(dim=-1, keepdim=True)
        ordered = renorm.sort(dim=-1, descending=True).values
        before = ordered.cumsum(dim=-1) - ordered
        smallest = torch.where(before < top_p, ordered, float("inf")).amin(dim=-1, keepdim=True)
        keep &= renorm >= smallest
    if min_p > 0:
        keep &= probs >= min_p * probs.amax(dim=-1, keepdim=True)
    return keep


def _sleep_cycles_per_us() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / (start.elapsed_time(end) * 1e3)


def time_us(fn, device: str, after=None, reps: int = 30) -> tuple[float, float]:
    """Medians of ``fn()``'s device time and host time in microseconds (``after(result)`` runs outside the timing).

    Device time is what a decode step pays while the host runs ahead of the device, as the engine's does: the
    device first sleeps for three times ``fn``'s host time, so every launch of ``fn`` is queued before the first
    runs, and two events bracket them. (An event pair around an unqueued call would time the host instead: the
    engine's sampler spends more time launching than its kernels run.) Elsewhere both are wall times."""
    after = after or (lambda result: None)
    if device != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            after(fn())
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6, statistics.median(times) * 1e6
    after(fn())
    torch.cuda.synchronize()
    host = []
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        host.append(time.perf_counter() - start)
        after(result)
        torch.cuda.synchronize()
    host_us = statistics.median(host) * 1e6
    sleep = int(_sleep_cycles_per_us() * 3 * max(host_us, 20.0))
    device_times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        torch.cuda._sleep(sleep)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        after(result)
        device_times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(device_times), host_us


def engine_sampler(logits: torch.Tensor, top_k: int, top_p: float, seeded: bool, keep: torch.Tensor):
    """(median device us, median host us, every draw inside ``keep``) of ``ninefold.llm.sampler.Sampler.sample``
    on ``logits``, each row a sequence asking for ``top_k`` and ``top_p`` at ``TEMPERATURE`` (seeded: its own seed)."""
    from ninefold.llm.sampler import Sampler
    from ninefold.llm.sampling import SamplingParams
    from ninefold.llm.sequence import Sequence

    device = logits.device.type
    sampler = Sampler(logits.device, logits.shape[1], ())
    seqs = [Sequence(f"r{i}", 0, [1], 1, SamplingParams(temperature=TEMPERATURE, top_k=top_k, top_p=top_p,
                                                         seed=i if seeded else None)) for i in range(logits.shape[0])]
    for i, seq in enumerate(seqs):
        if seeded:
            seq.seed, seq.generator = i, torch.Generator(device=device)
    tokens = sampler.sample(logits, seqs).tokens
    inside = bool(keep.gather(1, tokens.view(-1, 1)).all())
    # (reading the tokens hands their page-locked buffer back, as the engine does each step)
    return (*time_us(lambda: sampler.sample(logits, seqs), device, after=lambda pending: pending.read()), inside)


def run(vocab: int, batches: list[int], device: str) -> dict:
    from ninefold import ops

    gen = torch.Generator(device=device).manual_seed(0)
    rows, failures = [], []
    for b in batches:
        logits = (torch.randn(b, vocab, generator=gen, device=device) * 3).to(torch.bfloat16)
        greedy_us = time_us(lambda logits=logits: ops.argmax(logits, dim=-1), device)[0]
        for name, (top_k, top_p, min_p) in SETTINGS.items():
            for seeded in (False, True):
                args = dict(top_k=torch.full((b,), top_k, dtype=torch.int32, device=device) if top_k else None,
                            top_p=torch.full((b,), top_p, device=device) if top_p < 1 else None,
                            min_p=torch.full((b,), min_p, device=device) if min_p > 0 else None)
                generators = ([torch.Generator(device=device).manual_seed(i) for i in range(b)] if seeded else None)
                temperature = torch.full((b,), TEMPERATURE, device=device)

                def call(logits=logits, generators=generators, temperature=temperature, args=args):
                    return ops.sample(logits, temperature, generators=generators, **args)

                tokens = call()
                keep = allowed_tokens(logits, top_k, top_p, min_p)
                inside = bool(keep.gather(1, tokens.view(-1, 1)).all())
                if not inside:
                    failures.append(f"B={b} {name} seeded={seeded}")
                us, host_us = time_us(call, device)
                row = {"batch": b, "vocab": vocab, "setting": name, "seeded": seeded, "sample_us": us,
                       "sample_host_us": host_us,
                       "argmax_us": greedy_us, "tokens_inside_filter": inside,
                       "kept_tokens_mean": float(keep.sum(dim=-1).double().mean())}
                if top_k:  # also through the engine's sampler, which draws among the top-k candidates
                    row["engine_us"], row["engine_host_us"], row["engine_inside_filter"] = engine_sampler(
                        logits, top_k, top_p, seeded, keep)
                    if not row["engine_inside_filter"]:
                        failures.append(f"B={b} {name} seeded={seeded} (engine)")
                rows.append(row)
                engine = (f"; engine's sampler {row['engine_us']:7.1f} us, host {row['engine_host_us']:6.1f}"
                          if "engine_us" in row else "")
                print(f"B={b:>4} {name:>12} {'seeded' if seeded else '':>6}: sample {us:7.1f} us, host {host_us:6.1f} "
                      f"(argmax {greedy_us:6.1f} us"
                      f"{engine}); {row['kept_tokens_mean']:9.0f} tokens kept per row on average; draws inside: {inside}",
                      flush=True)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    return {"device": name, "temperature": TEMPERATURE, "rows": rows, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.sampling", description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", default="1,16,64,256", help="comma-separated batch sizes")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: checks the code (wall times)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("ninefold.bench.sampling needs a CUDA device (or --device cpu); nothing measured.", file=sys.stderr)
        return 2
    results = run(args.vocab, [int(b) for b in args.batches.split(",")], args.device)
    write_json("sampling.json", results)
    if results["failures"]:
        print(f"draws outside their filtered set: {results['failures']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
