"""Embedding throughput of ninefold against its peers, in one process.

    python -m ninefold.bench.embed [--model FILE_OR_DIR] [--prompts 64] [--min-len 32] [--max-len 256]
                                   [--systems ninefold,transformers,llama.cpp] [--repeats 3] [--out DIR]

The workload: ``--prompts`` random token sequences (seeded) with lengths uniform in [min, max], embedded
with last-token pooling, normalized. Systems: ``ninefold`` (``LLM.embed``: prompts packed without padding
into cache-free steps of ``max_num_batched_tokens``), ``transformers`` (the same file through
``AutoModelForCausalLM``'s decoder, float32, batches of 16 prompts sorted by length and right-padded, the
last real position pooled) and ``llama.cpp`` (llama-cpp-python's context in embedding mode, last-token
pooling, many sequences per ``llama_decode`` as its server batches them). Before timing, every system's
vectors are compared with ninefold's (cosine similarity per prompt; ninefold's quantized CPU kernels
round activations to int8, so 1.0 is not expected; below 0.98 the run stops). Each figure is the best of ``--repeats`` runs:
prompt tokens embedded per second. Writes JSON under ``--out`` (or $OUT) when given.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from ninefold.bench.cpu import check_systems, llama_cpp_clear, llama_cpp_context
from ninefold.bench.results import write_json

SYSTEMS = ("ninefold", "transformers", "llama.cpp")
MIN_COSINE = 0.98  # below this a peer and ninefold compute different things: the run stops


@dataclass
class Row:
    system: str
    load_s: float
    tokens_per_s: float
    min_cosine_vs_ninefold: float | None
    note: str = ""


def workload(vocab: int, prompts: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Random prompts (ids 3..vocab-1: past the usual special tokens) of lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(prompts)]


def _best_rate(run, tokens: int, repeats: int):
    """(best tokens/s over ``repeats`` timed runs after one warm-up, the warm-up's result)."""
    result = run()
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = max(best, tokens / (time.perf_counter() - start))
    return best, result


def bench_ninefold(llm, load: float, prompts, repeats: int):
    tokens = sum(map(len, prompts))
    rate, outs = _best_rate(lambda: llm.embed(prompts), tokens, repeats)
    vectors = np.array([o.outputs.embedding for o in outs])
    budget = llm.engine.config.max_num_batched_tokens
    return Row("ninefold", load, rate, 1.0, f"{llm.engine.dtype}, steps of <= {budget} tokens"), vectors


def bench_transformers(model: str, prompts, repeats: int, batch: int = 16):
    from transformers import AutoModelForCausalLM

    path = Path(model)
    start = time.perf_counter()
    if path.suffix == ".gguf":
        lm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    decoder = lm.model.eval()
    load = time.perf_counter() - start
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))

    @torch.inference_mode()
    def run():
        out = [None] * len(prompts)
        for b in range(0, len(order), batch):
            rows = order[b:b + batch]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.int64)
            mask = torch.zeros((len(rows), width), dtype=torch.int64)
            for r, i in enumerate(rows):
                ids[r, :len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, :len(prompts[i])] = 1
            hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
            for r, i in enumerate(rows):
                out[i] = torch.nn.functional.normalize(hidden[r, len(prompts[i]) - 1].float(), dim=0).numpy()
        return np.array(out)

    rate, vectors = _best_rate(run, sum(map(len, prompts)), repeats)
    return Row("transformers", load, rate, None, f"float32, batches of {batch} right-padded"), vectors


def bench_llama_cpp(model: str, prompts, repeats: int, threads: int):
    import llama_cpp

    budget = max(512, max(map(len, prompts)))  # llama.cpp's default batch, or the longest prompt

    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads, vocab_only=False,
                          n_ctx=budget, verbose=False)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = budget
    params.n_seq_max, params.embeddings = 64, True
    params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_LAST
    params.n_threads, params.n_threads_batch = threads, threads
    if hasattr(params, "kv_unified"):
        params.kv_unified = True  # sequences share the cells: a step holds as many tokens as n_ctx
    ctx = llama_cpp_context(llm, params)
    load = time.perf_counter() - start
    n_embd = llama_cpp.llama_model_n_embd(llm.model)
    batch = llama_cpp.llama_batch_init(budget, 0, params.n_seq_max)

    def decode(group: list[list[int]]) -> list[np.ndarray]:
        llama_cpp_clear(ctx)
        n = 0
        for s, ids in enumerate(group):
            for p, t in enumerate(ids):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = t, p, 1
                batch.seq_id[n][0], batch.logits[n] = s, True  # (it marks every token in embedding mode)
                n += 1
        batch.n_tokens = n
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = []
        for s in range(len(group)):
            ptr = ctypes.cast(llama_cpp.llama_get_embeddings_seq(ctx, s), ctypes.POINTER(ctypes.c_float))
            row = np.ctypeslib.as_array(ptr, (n_embd,)).astype(np.float64)
            rows.append(row / np.linalg.norm(row))
        return rows

    def run():
        out, group, tokens = [], [], 0
        for ids in prompts:
            if group and (tokens + len(ids) > budget or len(group) == params.n_seq_max):
                out += decode(group)
                group, tokens = [], 0
            group.append(ids)
            tokens += len(ids)
        return np.array(out + decode(group))

    try:
        rate, vectors = _best_rate(run, sum(map(len, prompts)), repeats)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    version = getattr(llama_cpp, "__version__", "?")
    return Row(f"llama.cpp {version}", load, rate, None, f"steps of <= {budget} tokens, {threads} threads"), vectors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.embed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default=None, help="ninefold's device (default: the engine's choice); the peers run "
                        "on the CPU")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args(argv)
    systems = check_systems(parser, args.systems, SYSTEMS)
    if not 1 <= args.min_len <= args.max_len:
        parser.error(f"--min-len/--max-len: got {args.min_len}/{args.max_len}; expected 1 <= min <= max")
    from ninefold.llm import hub
    from ninefold.llm.api import LLM

    model = str(args.model or hub.resolve_model(None))
    print(f"ninefold: loading {model}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    llm = LLM(model, device=args.device)
    load = time.perf_counter() - start
    prompts = workload(llm.engine.model_config.vocab_size, args.prompts, args.min_len, args.max_len)
    print("ninefold: running", file=sys.stderr, flush=True)
    row, reference = bench_ninefold(llm, load, prompts, args.repeats)
    rows = [row]
    for system in systems[1:]:
        print(f"{system}: running", file=sys.stderr, flush=True)
        if system == "transformers":
            peer, vectors = bench_transformers(model, prompts, args.repeats)
        else:
            peer, vectors = bench_llama_cpp(model, prompts, args.repeats, args.threads)
        peer.min_cosine_vs_ninefold = float(np.min(np.sum(vectors * reference, axis=1)))
        if peer.min_cosine_vs_ninefold < MIN_COSINE:
            print(f"error: {peer.system}'s embeddings disagree with ninefold's (cosine "
                  f"{peer.min_cosine_vs_ninefold:.4f} < {MIN_COSINE}); not timing a wrong answer", file=sys.stderr)
            return 1
        rows.append(peer)
    best_peer = max((r.tokens_per_s for r in rows[1:]), default=None)
    tokens = sum(map(len, prompts))
    print(f"\n{len(prompts)} prompts, {tokens} tokens ({args.min_len}..{args.max_len} each), last-token pooling, "
          f"{args.threads} threads, {platform.processor() or platform.machine()}")
    print(f"{'system':<20} {'load s':>7} {'tokens/s':>10} {'vs best peer':>13} {'min cos vs ninefold':>20}  note")
    for r in rows:
        ratio = f"{r.tokens_per_s / best_peer:.2f}x" if best_peer and r.system == "ninefold" else ""
        cosine = "" if r.system == "ninefold" else f"{r.min_cosine_vs_ninefold:.5f}"
        print(f"{r.system:<20} {r.load_s:>7.1f} {r.tokens_per_s:>10.1f} {ratio:>13} {cosine:>20}  {r.note}")
    if args.out:
        write_json("embed_bench.json", {
            "model": str(model), "prompts": len(prompts), "tokens": tokens, "min_len": args.min_len,
            "max_len": args.max_len, "threads": args.threads, "torch": torch.__version__,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": [asdict(r) for r in rows],
        }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
