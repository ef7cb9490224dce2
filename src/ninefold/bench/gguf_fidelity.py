"""How closely a quantized GGUF model's greedy decoding follows the exact (dequantized float32) model.

    python -m ninefold.bench.gguf_fidelity [--model FILE.gguf] [--tokens 48] [--llama-cpp-quantize Q4_K_M]

Each system decodes the same prompts greedily (end-of-sequence ignored); the exact model, the same file
loaded with ``quantization="none"`` (every weight dequantized to float32), then scores every generated
token teacher-forced (``prompt_logprobs`` over prompt + generation). Reported per system: how often its
token is the exact model's argmax at that position, and the mean log-probability gap between the exact
model's best token and the chosen one (0 when they agree). Everything runs on the CPU. Systems: ninefold as
``ninefold chat`` runs the file on this CPU (``quantization="auto"``: the native kernels' blocks where they build), and
llama.cpp through llama-cpp-python when it is installed (a benchmark-only peer). The exact model
scoring its own greedy tokens is the self-check: agreement 1.0, gap 0.

``--llama-cpp-quantize TYPE`` first writes a TYPE copy of the model with llama.cpp's quantizer (e.g.
``Q4_K_M``; requantizing an already quantized file, so only the type mix is llama.cpp's, not the
quality of a conversion from float weights) and measures that copy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

PROMPTS = ("Once upon a time", "The capital of France is", "def fibonacci(n):", "List three colors:",
           "Water boils at", "The quick brown fox")


def greedy_ninefold(path: Path | object, prompts: list[list[int]], tokens: int, quantization: str = "auto"
                    ) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids) by ninefold on the CPU with ``quantization``, or by an
    ``LLM`` given instead of a path."""
    from ninefold import LLM, SamplingParams

    llm = path if isinstance(path, LLM) else LLM(str(path), quantization=quantization, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy_llama_cpp(path: Path, prompts: list[list[int]], tokens: int, threads: int) -> list[list[int]]:
    """Greedy continuations by llama.cpp (llama-cpp-python), from the same token ids."""
    from llama_cpp import Llama

    model = Llama(str(path), n_ctx=max(len(p) for p in prompts) + tokens + 8, n_threads=threads, verbose=False)
    result = []
    for prompt in prompts:
        model.reset()
        generated = []
        for token in model.generate(prompt, temp=0, top_k=1):
            generated.append(int(token))
            if len(generated) == tokens:
                break
        result.append(generated)
    return result


def teacher_forced(exact, prompts: list[list[int]], generations: list[list[int]]) -> dict:
    """Argmax agreement and mean log-probability gap of ``generations`` under the ``exact`` ``LLM``."""
    from ninefold import SamplingParams

    agree = total = 0
    gap = 0.0
    for prompt, generated in zip(prompts, generations):
        out = exact.generate([{"prompt_token_ids": prompt + generated}],
                             SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
        for token, entry in zip(generated, out.prompt_logprobs[len(prompt):]):
            best, best_logprob = max(entry.items(), key=lambda tv: tv[1])  # {token: log-probability}
            agree += best == token
            gap += best_logprob - entry[token]
            total += 1
    return {"tokens": total, "argmax_agreement": agree / total, "mean_logprob_gap": gap / total}


def llama_cpp_quantize(source: Path, target: Path, type_name: str, threads: int) -> Path:
    """Write ``source`` requantized to llama.cpp's ftype ``type_name`` (e.g. ``Q4_K_M``) at ``target``."""
    import ctypes

    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name.upper()}", None)
    if ftype is None:
        raise ValueError(f"--llama-cpp-quantize: got {type_name!r}; llama.cpp has no LLAMA_FTYPE_MOSTLY_{type_name.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {type_name}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.gguf_fidelity", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the cached SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--llama-cpp-quantize", default=None, metavar="TYPE",
                        help="measure a copy requantized by llama.cpp to TYPE (e.g. Q4_K_M)")
    parser.add_argument("--out", default=None, help="JSON file for the results (default: $OUT/gguf_fidelity.json)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens: got {args.tokens}; needs at least 1")
    from ninefold import LLM
    from ninefold.llm import hub
    from ninefold.llm.gguf import load_gguf_tokenizer

    path = Path(hub.resolve_model(args.model))
    if args.llama_cpp_quantize:
        target = path.with_name(f"{path.stem}.requantized-{args.llama_cpp_quantize.upper()}.gguf")
        print(f"llama.cpp: quantizing {path.name} to {args.llama_cpp_quantize} -> {target}", flush=True)
        path = llama_cpp_quantize(path, target, args.llama_cpp_quantize, args.threads)
    tokenizer, _ = load_gguf_tokenizer(path)
    prompts = [tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    systems = {"ninefold (quantization='auto')": greedy_ninefold(path, prompts, args.tokens, "auto")}
    try:
        systems["llama.cpp"] = greedy_llama_cpp(path, prompts, args.tokens, args.threads)
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp not measured", file=sys.stderr)
    exact = LLM(str(path), quantization="none", device="cpu")
    systems["exact model (self-check)"] = greedy_ninefold(exact, prompts, args.tokens)
    rows = {name: teacher_forced(exact, prompts, generations) for name, generations in systems.items()}
    print(f"\n{path.name}: {len(prompts)} prompts x {args.tokens} greedy tokens, scored by the exact float32 model")
    print("| system | argmax agreement | mean log-prob gap |\n| --- | --- | --- |")
    for name, row in rows.items():
        print(f"| {name} | {row['argmax_agreement']:.3f} | {row['mean_logprob_gap']:.4f} |")
    out = args.out or (os.path.join(os.environ["OUT"], "gguf_fidelity.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"model": path.name, "tokens": args.tokens, "systems": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
