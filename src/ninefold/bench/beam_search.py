"""Beam search (``LLM.beam_search``) against transformers' ``generate(num_beams=...)`` in the same process.

    python -m ninefold.bench.beam_search [--model PATH] [--device cpu] [--widths 1,2,4] [--max-tokens 64] [--out DIR]

One chat prompt, ``ignore_eos`` (every beam runs ``--max-tokens`` rounds), best of ``--repeats`` after a warm-up.
ninefold runs twice: with the model's weights as loaded (a GGUF's matrices stay quantized on CPUs) and with
``quantization="none"`` (float32, the same numbers transformers computes, so the best beams should agree; the
table says whether they do). Greedy ``generate`` of the same length is the baseline a beam search round is
compared with. Writes ``beam_search.json`` under --out (or $OUT). On a GPU machine without the GGUF file,
``scripts/random_checkpoint.py`` gives a directory of its config, tokenizer and random weights to pass as --model.
"""

from __future__ import annotations

import argparse
import time

from ninefold.bench.results import write_json

PROMPT = "Write a short story about a robot who learns to paint."


def best_time(run, repeats: int) -> tuple[float, object]:
    """Best wall time of ``repeats`` calls of ``run`` after one warm-up call, and the last result."""
    result = run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a HF directory or .gguf file (default: the default model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--widths", default="1,2,4", help="beam widths, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    from ninefold import LLM, BeamSearchParams, SamplingParams
    from ninefold.llm import hub

    path = hub.resolve_model(args.model)
    widths = [int(w) for w in args.widths.split(",")]
    rows: list[dict] = []
    share = {"gpu_memory_utilization": 0.4} if args.device != "cpu" else {}  # two engines, and transformers
    engines = {"ninefold": LLM(str(path), device=args.device, **share),
               "ninefold fp32": LLM(str(path), device=args.device, dtype="float32", quantization="none", **share)}
    ids = engines["ninefold"].tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                            add_generation_prompt=True, tokenize=True)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict = {"model": str(path), "device": args.device, "prompt_tokens": len(ids),
                     "max_tokens": args.max_tokens, "rows": rows}
    for name, llm in engines.items():
        seconds, _ = best_time(lambda llm=llm: llm.generate(prompt_token_ids=[ids], sampling_params=greedy),
                               args.repeats)
        results[f"{name} greedy_s"] = seconds
        print(f"{name}: greedy {args.max_tokens} tokens {seconds:.2f} s", flush=True)
    peer = None
    if not args.no_peer:
        from transformers import AutoModelForCausalLM

        kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        peer = AutoModelForCausalLM.from_pretrained(str(path.parent if kwargs else path), dtype=torch.float32,
                                                    **kwargs).to(args.device).eval()
    for width in widths:
        params = BeamSearchParams(beam_width=width, max_tokens=args.max_tokens, ignore_eos=True)
        row: dict = {"width": width}
        best: dict[str, list[int]] = {}
        for name, llm in engines.items():
            seconds, out = best_time(lambda llm=llm, params=params: llm.beam_search([ids], params), args.repeats)
            row[f"{name}_s"] = seconds
            best[name] = out[0].sequences[0].tokens[len(ids):]
        if peer is not None:
            x = torch.tensor([ids], device=args.device)

            def hf(width=width, x=x):
                with torch.no_grad():
                    return peer.generate(x, attention_mask=torch.ones_like(x), num_beams=width, do_sample=False,
                                         max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                         pad_token_id=0)
            row["transformers_s"], out = best_time(hf, args.repeats)
            best["transformers"] = out[0, len(ids):].tolist()
            row["fp32_best_beam_equals_transformers"] = best["ninefold fp32"] == best["transformers"]
            row["speedup_vs_transformers"] = row["transformers_s"] / row["ninefold_s"]
        row["rounds_cost_vs_greedy"] = row["ninefold_s"] / results["ninefold greedy_s"]
        rows.append(row)
        print(f"width {width}: ninefold {row['ninefold_s']:.2f} s ({row['rounds_cost_vs_greedy']:.1f}x its greedy), "
              f"fp32 {row['ninefold fp32_s']:.2f} s"
              + (f", transformers {row['transformers_s']:.2f} s ({row['speedup_vs_transformers']:.2f}x), fp32 best "
                 f"beam {'=' if row['fp32_best_beam_equals_transformers'] else '!='} transformers'"
                 if peer is not None else ""), flush=True)
    path = write_json("beam_search.json", results, args.out, announce=True)
    if path is not None:
        plot(results, path.with_suffix(".png"))
    return results


def plot(results: dict, path) -> None:
    """Seconds per beam search against the beam width: ninefold (as loaded and in float32) and transformers,
    with ninefold's greedy generation of the same length as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    widths = [r["width"] for r in rows]
    series = [("ninefold", "ninefold_s"), ("ninefold float32", "ninefold fp32_s"), ("transformers float32",
                                                                                  "transformers_s")]
    series = [(label, key) for label, key in series if all(key in r for r in rows)]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    step = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        ax.bar([k + (i - (len(series) - 1) / 2) * step for k in range(len(rows))], [r[key] for r in rows], step,
               label=label)
    ax.axhline(results["ninefold greedy_s"], color="grey", ls="--", lw=1, label="ninefold greedy")
    ax.set_xticks(range(len(rows)), [str(w) for w in widths])
    ax.set_xlabel("beam width")
    ax.set_ylabel(f"seconds for {results['max_tokens']} tokens")
    ax.set_title(f"beam search, {results['device']}, {results['model'].rsplit('/', 1)[-1]}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
