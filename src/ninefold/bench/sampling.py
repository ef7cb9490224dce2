"""Device time of ``ninefold.ops.sample`` per decode step, against the step it belongs to.

    OUT=DIR python -m ninefold.bench.sampling [--vocab 128256] [--batches 1,16,64,256]   # one CUDA device, < 1 min

Logits ``[B, V]`` in bfloat16 (what the engine's models return), scaled like a language model's (a few nats of
spread); per batch size and filter setting (temperature only, top-p 0.95, top-k 50 with top-p 0.95, min-p 0.05,
and each with every row seeded), the median device time of ``ops.sample`` (``triton.testing.do_bench``, CUDA
graphs not used: the engine runs the sampler eagerly after the graph) and of ``ops.argmax`` (greedy) next to it.
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


def time_us(fn, device: str) -> float:
    """Median time of ``fn()`` in microseconds: ``do_bench`` on CUDA (device time), wall time of 5 calls elsewhere."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median") * 1e3
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def engine_sampler(logits: torch.Tensor, top_k: int, top_p: float, seeded: bool, keep: torch.Tensor):
    """(median us, every draw inside ``keep``) of ``ninefold.llm.sampler.Sampler.sample`` on ``logits``, each row a
    sequence asking for ``top_k`` and ``top_p`` at ``TEMPERATURE`` (seeded: its own seed)."""
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
    return time_us(lambda: sampler.sample(logits, seqs).tokens, device), inside


def run(vocab: int, batches: list[int], device: str) -> dict:
    from ninefold import ops

    gen = torch.Generator(device=device).manual_seed(0)
    rows, failures = [], []
    for b in batches:
        logits = (torch.randn(b, vocab, generator=gen, device=device) * 3).to(torch.bfloat16)
        greedy_us = time_us(lambda logits=logits: ops.argmax(logits, dim=-1), device)
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
                us = time_us(call, device)
                row = {"batch": b, "vocab": vocab, "setting": name, "seeded": seeded, "sample_us": us,
                       "argmax_us": greedy_us, "tokens_inside_filter": inside,
                       "kept_tokens_mean": float(keep.sum(dim=-1).double().mean())}
                if top_k:  # also through the engine's sampler, which draws among the top-k candidates
                    row["engine_us"], row["engine_inside_filter"] = engine_sampler(logits, top_k, top_p, seeded, keep)
                    if not row["engine_inside_filter"]:
                        failures.append(f"B={b} {name} seeded={seeded} (engine)")
                rows.append(row)
                engine = f"; engine's sampler {row['engine_us']:8.1f} us" if "engine_us" in row else ""
                print(f"B={b:>4} {name:>12} {'seeded' if seeded else '':>6}: sample {us:8.1f} us (argmax {greedy_us:6.1f} us"
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
