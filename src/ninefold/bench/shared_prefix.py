"""What the prefix cache saves when prompts share their start: ``n > 1`` samples of one prompt, and a batch of
requests after one system prompt, all admitted in the same step. One command:

    python -m ninefold.bench.shared_prefix [--model smollm2] [--device cpu] [--prompt-len 512] [--n 8]

Each workload runs on two engines in this process, with the prefix cache on and off (the same model and
seed; a warm-up first), and the table shows seconds, prompt tokens served from the cache, and the speed-up.
Results go to ``$OUT/shared_prefix.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from ninefold import LLM, SamplingParams

FILLER = "The history of computing runs from tally sticks to programmable machines and networks. "


def _workloads(tokenizer, prompt_len: int, n: int) -> dict[str, tuple[list[list[int]], SamplingParams]]:
    text = tokenizer.encode(FILLER * (prompt_len // 8 + 8))
    shared = text[:prompt_len]
    questions = [tokenizer.encode(f" Question {i}: what came next?") for i in range(n)]
    return {
        f"n={n} samples of one {prompt_len}-token prompt":
            ([shared], SamplingParams(temperature=0.8, seed=1, max_tokens=16, n=n)),
        f"{n} requests after one {prompt_len}-token system prompt":
            ([shared + q for q in questions], SamplingParams(temperature=0.8, seed=1, max_tokens=16)),
    }


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    llm.engine.blocks.reset_prefix_cache()
    queried, hits = llm.engine.blocks.queried_tokens, llm.engine.blocks.hit_tokens
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    assert llm.engine.blocks.queried_tokens - queried == sum(len(p) for p in prompts) * params.n
    return seconds, llm.engine.blocks.hit_tokens - hits


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args(argv)
    engines = {cached: LLM(args.model, device=args.device, enable_prefix_caching=cached) for cached in (True, False)}
    workloads = _workloads(engines[True].tokenizer, args.prompt_len, args.n)
    rows = []
    for name, (prompts, params) in workloads.items():
        for llm in engines.values():  # warm-up: kernels, caches
            llm.generate(prompt_token_ids=[prompts[0][:64]], sampling_params=SamplingParams(max_tokens=2))
        (on, hits), (off, _) = (_run(engines[c], prompts, params) for c in (True, False))
        total = sum(len(p) for p in prompts) * params.n
        rows.append({"workload": name, "cache_on_s": on, "cache_off_s": off, "hit_tokens": hits,
                     "prompt_tokens": total, "speedup": off / on})
        print(f"{name:48s} cache on {on:6.2f} s ({hits}/{total} prompt tokens from the cache)   "
              f"off {off:6.2f} s   {off / on:4.2f}x", flush=True)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "shared_prefix.json"), "w") as f:
            json.dump({"model": args.model, "device": args.device, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
