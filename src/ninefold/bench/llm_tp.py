"""Tensor parallelism against one rank: ``python -m ninefold.bench.llm_tp``.

For each ``--sizes`` entry, an engine with that ``tensor_parallel_size`` (dummy weights of a named
shape, or a model directory) generates for a batch of prompts: the time to the first token of one
prompt of ``--prompt-len`` tokens, and the decode rate at each ``--batch`` size (tokens after the
first, per second), with the ratio to one rank. On a GPU each rank takes its own GPU; on a CPU the
ranks share the cores (each gets its share of threads), so the figure there is the overhead of the
split (all-reduces over Gloo, the step broadcast), not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from ninefold.bench.results import write_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b",
                        help="a shape name or a config.json file (dummy weights), or a model directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values, comma-separated")
    parser.add_argument("--batch", default="1,16", help="decode batch sizes, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="one rank without CUDA graphs too (tensor-parallel steps always run eagerly)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for llm_tp.json")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    for size in sizes:
        print(f"tensor_parallel_size={size}: loading ...", flush=True)
        rows.append(measure(args, size, batches))
        print(f"  ttft {rows[-1]['ttft_ms']:.1f} ms; decode tok/s "
              + ", ".join(f"batch {b}: {r:.1f}" for b, r in rows[-1]["decode_tok_s"].items()), flush=True)
    report(rows, batches)
    write_json("llm_tp.json", {"model": args.model, "device": args.device, "dtype": args.dtype, "host": platform.node(),
                               "cpu_threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
                               "new_tokens": args.new_tokens, "enforce_eager": args.enforce_eager, "rows": rows},
               args.out, announce=True)
    return 0


def measure(args, size: int, batches: list[int]) -> dict:
    """Time to first token and decode rates of one engine with ``tensor_parallel_size=size``."""
    from ninefold import LLM, SamplingParams

    threads = torch.get_num_threads()
    load_format = "auto" if os.path.isdir(args.model) else "dummy"
    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=load_format, tensor_parallel_size=size,
              max_model_len=args.prompt_len + args.new_tokens + 16, enable_prefix_caching=False,
              enforce_eager=args.enforce_eager)
    try:
        vocab = llm.engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(0)

        def prompts(n: int) -> list[list[int]]:
            return [torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(n)]

        def run(n: int, new: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
            batch = prompts(n)
            start = time.perf_counter()
            llm.generate(prompt_token_ids=batch, sampling_params=params)
            return time.perf_counter() - start

        run(1, 2)  # warm-up: first calls compile and allocate
        ttft = min(run(1, 1) for _ in range(3))
        decode = {}
        for b in batches:
            prefill = run(b, 1)
            total = run(b, args.new_tokens)
            decode[b] = b * (args.new_tokens - 1) / max(total - prefill, 1e-9)
    finally:
        llm.close()
        torch.set_num_threads(threads)  # a CPU engine of several ranks gave this process its share only
    return {"tensor_parallel_size": size, "ttft_ms": ttft * 1e3, "decode_tok_s": decode}


def report(rows: list[dict], batches: list[int]) -> None:
    """A table of each size's figures and their ratio to the first size's."""
    base = rows[0]
    print(f"\n{'tp':>3} {'ttft ms':>9} {'x':>6} " + " ".join(f"{f'b={b} tok/s':>12} {'x':>6}" for b in batches))
    for r in rows:
        cells = [f"{r['tensor_parallel_size']:>3}", f"{r['ttft_ms']:>9.1f}", f"{base['ttft_ms'] / r['ttft_ms']:>6.2f}"]
        for b in batches:
            rate = r["decode_tok_s"][b]
            cells += [f"{rate:>12.1f}", f"{rate / base['decode_tok_s'][b]:>6.2f}"]
        print(" ".join(cells))


if __name__ == "__main__":
    raise SystemExit(main())
