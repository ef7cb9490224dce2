"""Decode speed with LoRA adapters on a GPU: CUDA-graph steps against eager ones, with and without adapters.

    OUT=DIR python -m ninefold.bench.lora_cuda [--model llama-3.1-8b] [--rank 16] [--adapters 4]
                                               [--batches 1,32,128] [--decode-tokens 128]

Dummy (random) weights of ``--model``'s shape in bfloat16 and ``--adapters`` random rank-``--rank`` PEFT
adapters on all seven projections of every layer (``bench.lora.write_peft_adapter``). Two engines, one
replaying CUDA graphs for decode steps (the default) and one with ``enforce_eager=True`` (what steps with
adapter rows ran before adapters had graphs of their own); per batch size, greedy decode tokens/s of prompts of
64 random tokens with no adapter and with the batch spread over all adapters (row ``i`` under adapter
``i % adapters``). Decode time is a run of ``--decode-tokens`` new tokens minus a run of one (the prefill).
Before timing, under adapter 1 both engines must pick the same first greedy token (the prefill) and give the
tokens that both list among the ``TOP`` likeliest after it (the first decode step, replayed from a graph or run
eagerly) log-probabilities within ``MAX_GAP`` of the dtype, and the adapter must move that decode step's (against
the same context without it) by ``EFFECT_OVER_GAP`` times that or more. Prints a table and writes ``$OUT/lora_cuda.json``. ``--device cpu`` with a small ``--model`` checks the code only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ninefold.bench.results import write_json

PROMPT_TOKENS = 64
# nats, per dtype: the graph and eager engines' log-probabilities of the same tokens may differ by a few rounding
# steps of the logits (bfloat16: 1/32 between 4 and 8, where random weights put them; 0.094 and 0.125 measured
# on H100s; float16 and float32 scaled by their precision, not measured on a GPU)
MAX_GAP = {"bfloat16": 0.25, "float16": 0.032, "float32": 0.002}
# The adapter must move the first decode step's log-probabilities by this many MAX_GAPs, so a graph step that
# dropped it would differ from the eager one by more than MAX_GAP.
EFFECT_OVER_GAP = 2
TOP = 8  # log-probabilities compared per step: the likeliest tokens of each engine, those both list
BLOCK_SIZE = 16


def decode_tok_per_s(llm, prompts, loras, tokens: int) -> float:
    """Greedy decode tokens/s of ``prompts`` under ``loras`` (the prefill's time taken out)."""
    from ninefold import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=loras, use_tqdm=False)
        return time.perf_counter() - start

    run(2)  # warm: first calls of this batch size
    decode_s = min(run(tokens) for _ in range(2)) - min(run(1) for _ in range(2))
    if decode_s <= 0:
        raise SystemExit(f"--decode-tokens: {tokens} tokens took no longer than the prefill alone at batch "
                         f"{len(prompts)}; the machine's noise hides them: ask for more")
    return len(prompts) * (tokens - 1) / decode_s


def greedy(llm, prompt, lora, tokens: int = 16) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy tokens of ``prompt`` under ``lora`` and, per step, the ``TOP`` likeliest tokens' log-probabilities."""
    from ninefold import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=TOP)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, lora_request=lora, use_tqdm=False)
    completion = out[0].outputs[0]
    return completion.token_ids, completion.logprobs


def logprob_gap(a: dict[int, float], b: dict[int, float]) -> tuple[float, int]:
    """Largest difference between two steps' log-probabilities of the tokens both list, and how many they share."""
    shared = a.keys() & b.keys()
    return max((abs(a[t] - b[t]) for t in shared), default=float("inf")), len(shared)


def run(args) -> dict:
    from ninefold import LLM, LoRARequest
    from ninefold.bench.lora import write_peft_adapter

    work = Path(tempfile.mkdtemp(prefix="nf-lora-cuda-"))
    engines = {}
    max_len = PROMPT_TOKENS + args.decode_tokens + 16
    blocks = max(args.batches) * -(-max_len // BLOCK_SIZE) + 16  # two engines share the GPU: no memory fraction
    for mode, eager in (("graphs", False), ("eager", True)):
        start = time.perf_counter()
        engines[mode] = LLM(args.model, load_format="dummy", dtype=args.dtype, device=args.device, seed=0,
                            enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, max_model_len=max_len,
                            max_num_seqs=max(args.batches), block_size=BLOCK_SIZE, num_kv_blocks=blocks,
                            enforce_eager=eager)
        print(f"{mode} engine ready in {time.perf_counter() - start:.1f} s", flush=True)
    config = engines["graphs"].engine.model_config
    loras = []
    for i in range(args.adapters):
        path = work / f"adapter{i + 1}"
        write_peft_adapter(path, config, args.rank, seed=i + 1)
        loras.append(LoRARequest(f"adapter{i + 1}", i + 1, str(path)))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, size=(max(args.batches), PROMPT_TOKENS)).tolist()
    check = {mode: greedy(llm, prompts[0], loras[0]) for mode, llm in engines.items()}
    base = greedy(engines["graphs"], prompts[0], None)
    (graph_ids, graph_lp), (eager_ids, eager_lp) = check["graphs"], check["eager"]
    # Random weights give near-uniform distributions whose argmax is a coin toss between kernels of different
    # launch shapes (graphs pad the batch and the block table), so the tokens may part at the first decode step:
    # compare the log-probabilities both engines give the same tokens at the prefill and at that step, where
    # the adapter's effect must be far larger than the two engines' difference.
    gaps = [logprob_gap(g, e) for g, e in zip(graph_lp[:2], eager_lp[:2])]
    gap, shared = max(g for g, _ in gaps), min(n for _, n in gaps)
    # the adapter's effect on that decode step: the same context without it (inf: it changed all the likeliest)
    unadapted = greedy(engines["graphs"], prompts[0] + graph_ids[:1], None, tokens=1)[1][0]
    effect, _ = logprob_gap(graph_lp[1], unadapted)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "model": args.model, "dtype": args.dtype, "rank": args.rank, "adapters": args.adapters,
              "decode_tokens": args.decode_tokens, "graph_tokens": graph_ids, "eager_tokens": eager_ids,
              "base_tokens": base[0], "graphs_eager_logprob_gap": gap, "adapter_logprob_effect": effect,
              "rows": []}
    result["shared_top_tokens"] = shared
    tolerance = MAX_GAP[args.dtype]
    result["checks_passed"] = (graph_ids[0] == eager_ids[0] and shared >= TOP // 2 and gap <= tolerance
                               and effect >= EFFECT_OVER_GAP * tolerance)
    print(f"check: under an adapter, graphs against eager: first tokens {graph_ids[:2]} / {eager_ids[:2]}; at the "
          f"prefill and the first decode step the {shared}+ tokens both list among their {TOP} likeliest have "
          f"log-probabilities {gap:.2g} apart; the adapter "
          + (f"moves the decode step's by up to {effect:.3g}" if effect != float("inf") else
             f"changes every one of the decode step's {TOP} likeliest tokens"), flush=True)
    if not result["checks_passed"]:
        raise SystemExit(f"check failed: graphs {graph_ids} {graph_lp[:2]}, eager {eager_ids} {eager_lp[:2]}, "
                         f"without the adapter {unadapted}")
    print(f"{'batch':>5} {'mode':>6} {'no adapter':>12} {'adapters':>12} {'adapters/base':>14}")
    for batch in args.batches:
        mixed = [loras[i % len(loras)] for i in range(batch)]
        for mode, llm in engines.items():
            plain = decode_tok_per_s(llm, prompts[:batch], None, args.decode_tokens)
            adapted = decode_tok_per_s(llm, prompts[:batch], mixed, args.decode_tokens)
            result["rows"].append({"batch": batch, "mode": mode, "base_tok_s": round(plain, 1),
                                   "lora_tok_s": round(adapted, 1)})
            print(f"{batch:>5} {mode:>6} {plain:>12.1f} {adapted:>12.1f} {adapted / plain:>14.2f}", flush=True)
    for llm in engines.values():
        llm.close()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.lora_cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a shape name or HF directory (dummy weights)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(MAX_GAP))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--batches", default="1,32,128", help="comma-separated batch sizes")
    parser.add_argument("--decode-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches: expected comma-separated integers, got {args.batches!r}")
    for name in ("rank", "adapters", "decode_tokens"):
        if getattr(args, name) < (2 if name == "decode_tokens" else 1):
            parser.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}; expected a positive integer"
                         + (" of at least 2" if name == "decode_tokens" else ""))
    if any(b < 1 for b in args.batches):
        parser.error(f"--batches: expected positive integers, got {args.batches}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("ninefold.bench.lora_cuda needs a CUDA device (or --device cpu); nothing measured.", file=sys.stderr)
        return 2
    result = run(args)
    write_json("lora_cuda.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
