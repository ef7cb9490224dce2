"""Speculative decoding (n-gram prompt lookup) against plain decoding, one request at a time.

    python -m ninefold.bench.speculative [--model PATH] [--device cpu] [--max-tokens 128] [--k 4] [--out DIR]

Loads the model twice (default: the cached SmolLM2-135M-Instruct GGUF), once with
``speculative_config={"method": "ngram", ...}``, and decodes each task greedily with both: a text to
repeat, a code edit, a story (little to copy). Greedy decoding gives the same tokens with and without
speculation (checked; a difference is reported as a failure); the table shows tokens per second, the
speed-up, drafts proposed and accepted, and tokens per step. Writes JSON under --out.

    python -m ninefold.bench.speculative --step-cost [--model llama-3.1-8b] [--device cuda] [--context 1024]

times what speculation costs per step instead: one sequence of ``--context`` random tokens on a model of
dummy weights (a shape name of ``ninefold.llm.config``), its decode step with 0, 1, 2, 4 and 8 drafts
(the drafts' rows replay the decode CUDA graphs on GPUs), as the engine's runner launches them. A step
with k drafts pays off when the tokens it yields per step exceed its cost over the plain step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ninefold.bench.results import write_json

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.")
CODE = "def f(xs):\n    count = 0\n    for x in xs:\n        count += x\n    return count\n"
TASKS = {
    "repeat": f"Repeat this text exactly, word for word:\n\n{TEXT}",
    "code edit": f"Rename the variable `count` to `total` in this code and print the whole code:\n\n{CODE}",
    "story": "Write a short story about a robot.",
}


def run_task(llm, prompt: str, max_tokens: int, repeats: int) -> dict:
    """Best of ``repeats`` timed greedy generations after one warm-up; tokens and draft counts of the last."""
    from ninefold import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([prompt], params)
    best, tokens, drafted, accepted = float("inf"), [], 0, 0
    for _ in range(repeats):
        before = llm.engine.stats()
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0].outputs[0]
        best = min(best, time.perf_counter() - start)
        after = llm.engine.stats()
        tokens = list(out.token_ids)
        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {"seconds": best, "tokens": tokens, "tok_s": len(tokens) / best, "drafted": drafted,
            "accepted": accepted}


def step_cost(args) -> dict:
    """Milliseconds per decode step of one sequence with 0..8 drafts (median of ``args.repeats`` x 20 steps);
    random weights of a known shape, or the checkpoint when ``args.model`` is a path (a GGUF runs the CPU's
    native kernels)."""
    import statistics

    import torch

    from ninefold import SamplingParams
    from ninefold.llm.engine import LLMEngine
    from ninefold.llm.scheduler import ScheduledSeq

    load_format = "auto" if Path(args.model).exists() else "dummy"
    engine = LLMEngine(args.model, load_format=load_format, dtype=args.dtype, device=args.device,
                       max_model_len=args.context + 64)
    request = engine.build_request(list(range(100, 100 + args.context)),
                                   SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    engine.add_request(request)
    while request.seqs[0].num_computed_tokens < args.context:  # the prompt's prefill
        engine.step()
    engine.sync()
    seq, runner = request.seqs[0], engine.runner
    cuda = engine.device.type == "cuda"
    times = {}
    for k in (0, 1, 2, 4, 8):
        engine.blocks.ensure(seq, seq.num_computed_tokens + 1 + k)
        step = [ScheduledSeq(seq, 1 + k, draft_ids=[7] * k)]
        runner.forward_logits(step)
        rounds = []
        for _ in range(args.repeats):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                runner.forward_logits(step)
            if cuda:
                torch.cuda.synchronize()
            rounds.append((time.perf_counter() - start) / 20 * 1e3)
        times[k] = statistics.median(rounds)
        print(f"{k} drafts: {times[k]:.3f} ms per step ({times[k] / times[0]:.2f}x the plain step)", flush=True)
    engine.close()
    return {"model": args.model, "device": args.device, "context": args.context, "ms_per_step": times}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or known name (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="directory for speculative.json")
    parser.add_argument("--step-cost", action="store_true",
                        help="time steps with 0..8 drafts (random weights of a known shape, or the checkpoint at a path)")
    parser.add_argument("--context", type=int, default=1024, help="--step-cost: the sequence's context")
    args = parser.parse_args(argv)
    if args.step_cost:
        args.model = args.model or "llama-3.1-8b"
        args.dtype = "bfloat16" if args.dtype == "auto" and args.device != "cpu" else args.dtype
        result = step_cost(args)
        if args.out:
            write_json("speculative_step_cost.json", result, args.out)
        return 0

    from ninefold import LLM
    from ninefold.llm import hub

    model = str(hub.resolve_model(args.model))
    config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
              "prompt_lookup_min": args.lookup_min}
    results = {"model": model, "device": args.device, "speculative_config": config, "tasks": {}}
    arms = {}
    for name, spec in (("plain", None), ("ngram", config)):
        print(f"loading {Path(model).name} ({name}) ...", flush=True)
        arms[name] = LLM(model, device=args.device, dtype=args.dtype, speculative_config=spec)
    template = arms["plain"].engine.tokenizer
    print(f"{'task':10s} {'plain tok/s':>11s} {'ngram tok/s':>11s} {'speed-up':>8s} {'drafted':>7s} "
          f"{'accepted':>8s} {'tokens/step':>11s}")
    failures = 0
    for task, message in TASKS.items():
        prompt = template.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        plain = run_task(arms["plain"], prompt, args.max_tokens, args.repeats)
        ngram = run_task(arms["ngram"], prompt, args.max_tokens, args.repeats)
        same = plain["tokens"] == ngram["tokens"]
        failures += not same
        steps = len(ngram["tokens"]) - ngram["accepted"]
        per_step = len(ngram["tokens"]) / max(steps, 1)
        results["tasks"][task] = {"plain": plain, "ngram": ngram, "same_tokens": same, "tokens_per_step": per_step}
        print(f"{task:10s} {plain['tok_s']:11.1f} {ngram['tok_s']:11.1f} {ngram['tok_s'] / plain['tok_s']:7.2f}x "
              f"{ngram['drafted']:7d} {ngram['accepted']:8d} {per_step:11.2f}"
              + ("" if same else "  DIFFERENT TOKENS"), flush=True)
    if args.out:
        write_json("speculative.json", results, args.out)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
