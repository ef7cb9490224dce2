"""Decode speed with LoRA adapters: ninefold against transformers + peft and llama.cpp, in one process.

    python -m ninefold.bench.lora [--model FILE.gguf|HF_DIR] [--rank 16] [--adapters 4] [--decode-tokens 64]
                                  [--systems ninefold,transformers,llama.cpp] [--repeats 3] [--out DIR]

Adapters: ``--adapters`` random rank-``--rank`` adapters on all seven projections of every layer, written in
PEFT's format (what ninefold and peft read) and, for llama.cpp, as GGUF LoRA files (``general.type`` adapter,
``blk.N.attn_q.weight.lora_a`` / ``lora_b``, q and k rows reordered as llama.cpp's converter reorders them).
Rows: greedy batch-1 decode tokens/s after the prompt (64 tokens) with no adapter and with adapter 1; for
ninefold and transformers also one step of ``--adapters`` sequences each under its own adapter (peft's
``adapter_names``; llama.cpp applies adapters per context, so it has no such row). Before timing, each peer's
next-token logits with adapter 1 are compared with ninefold's (cosine; below 0.98, or no closer to ninefold's
adapted logits than to its base ones, the run stops). Each figure is the best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
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

from ninefold.bench.cpu import best_of, check_systems
from ninefold.bench.results import pyplot
from ninefold.llm.lora.adapter import MODULES, part_sizes

SYSTEMS = ("ninefold", "transformers", "llama.cpp")
MIN_COSINE = 0.98
PROJECTIONS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


@dataclass
class Row:
    system: str
    base_tok_s: float | None
    lora_tok_s: float | None
    mixed_tok_s: float | None = None  # --adapters sequences, each under its own adapter
    cosine_vs_ninefold: float | None = None
    note: str = ""


def projection_sizes(config) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of each projection (``PROJECTIONS``' names) for a ninefold ``ModelConfig``."""
    parts = part_sizes(config)
    return {name: parts[MODULES[name.split(".")[1]][0]][MODULES[name.split(".")[1]][1]] for name in PROJECTIONS}


def write_peft_adapter(path: Path, config, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A random PEFT adapter (alpha = rank, so scale 1) for every projection; returns its tensors."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config.num_layers):
        for name, (d_in, d_out) in projection_sizes(config).items():
            key = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn((rank, d_in), generator=g) / d_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn((d_out, rank), generator=g) * 0.02
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": [n.split(".")[1] for n in PROJECTIONS],
        "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0}))
    return tensors


def _llama_cpp_rows(b: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its converter interleaves the two rotary halves of each head)."""
    return b.reshape(heads, 2, b.shape[0] // heads // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)


def write_gguf_lora(path: Path, tensors: dict[str, torch.Tensor], config, model_file: str, rank: int) -> Path:
    """The same adapter as a GGUF LoRA file that llama.cpp loads (``Llama(lora_path=...)``) with ``model_file``."""
    import gguf

    from ninefold.llm.gguf import SUPPORTED_ARCHITECTURES

    field = gguf.GGUFReader(model_file).fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    permuted = SUPPORTED_ARCHITECTURES[arch][1]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    for i in range(config.num_layers):
        for name, short in PROJECTIONS.items():
            key = f"base_model.model.model.layers.{i}.{name}"
            a = tensors[f"{key}.lora_A.weight"].numpy().astype(np.float32)
            b = tensors[f"{key}.lora_B.weight"].numpy().astype(np.float32)
            if short == "attn_q" and permuted:
                b = _llama_cpp_rows(b, config.num_heads)
            elif short == "attn_k" and permuted:
                b = _llama_cpp_rows(b, config.num_kv_heads)
            writer.add_tensor(f"blk.{i}.{short}.weight.lora_a", np.ascontiguousarray(a))
            writer.add_tensor(f"blk.{i}.{short}.weight.lora_b", np.ascontiguousarray(b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ----------------------------------------------------------------------------- ninefold

def bench_ninefold(llm, loras, prompt, mixed_prompts, tokens: int, repeats: int):
    """(Row, next-token logits after ``prompt`` with adapter 1, the same without) for an ``LLM`` with LoRA on."""
    from ninefold.llm.sampling import SamplingParams

    engine = llm.engine

    def decode_rate(prompts, adapters) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        for ids, lora in zip(prompts, adapters):
            engine.add_request(engine.build_request(ids, params, lora_request=lora))
        engine.step()  # the prefill: every sequence gets its first token
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return len(prompts) * steps / (time.perf_counter() - start)

    def next_logits(lora) -> np.ndarray:
        engine.add_request(engine.build_request(prompt, SamplingParams(max_tokens=1), "probe", lora_request=lora))
        logits = engine.runner.forward_logits(engine.scheduler.schedule())[0].float().numpy()
        engine.abort_request("probe")
        return logits

    adapted, plain = next_logits(loras[0]), next_logits(None)
    decode_rate([prompt], [loras[0]])  # warm-up
    base = [decode_rate([prompt], [None]) for _ in range(repeats)]
    one = [decode_rate([prompt], [loras[0]]) for _ in range(repeats)]
    mixed = [decode_rate(mixed_prompts, loras) for _ in range(repeats)]
    note = f"{engine.model.dtype}, max_loras={len(loras)}".replace("torch.", "")
    return Row("ninefold", best_of(base), best_of(one), best_of(mixed), note=note), adapted, plain


# ----------------------------------------------------------------------------- transformers + peft

def bench_transformers(model_path: str, adapter_dirs, prompt, mixed_prompts, tokens: int, repeats: int):
    """(Row, next-token logits with adapter 1) of transformers' ``generate`` on a peft model, float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter_dirs[0]), adapter_name="a0")
    for i, d in enumerate(adapter_dirs[1:], 1):
        model.load_adapter(str(d), adapter_name=f"a{i}")
    model.eval()
    names = [f"a{i}" for i in range(len(adapter_dirs))]

    def seconds(prompts, new: int, adapters) -> float:
        ids = torch.tensor(prompts)
        kwargs = {"adapter_names": adapters} if adapters else {}
        with torch.inference_mode():
            start = time.perf_counter()
            if adapters is None:
                with model.disable_adapter():
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                   min_new_tokens=new, do_sample=False, pad_token_id=0)
            else:
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
            return time.perf_counter() - start

    def rate(prompts, adapters) -> float | None:
        # decode rate = extra tokens / (time of n tokens - time of 1), from the fastest runs of each
        one = min(seconds(prompts, 1, adapters) for _ in range(repeats))
        full = min(seconds(prompts, tokens, adapters) for _ in range(repeats))
        return len(prompts) * (tokens - 1) / (full - one) if full > one else None

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt]), adapter_names=["a0"]).logits[0, -1].float().numpy()
    seconds([prompt], 2, ["a0"])  # warm-up
    row = Row("transformers+peft", rate([prompt], None), rate([prompt], ["a0"]), rate(mixed_prompts, names),
              note="float32, peft adapter_names for the mixed batch")
    return row, logits


# ----------------------------------------------------------------------------- llama.cpp

def bench_llama_cpp(model_path: str, gguf_lora: Path, prompt, tokens: int, repeats: int, threads: int):
    """(Row, next-token logits with the adapter) of llama-cpp-python, the adapter loaded with ``lora_path``."""
    import llama_cpp

    from ninefold.bench.cpu import llama_cpp_last_logits

    def load(lora):
        kwargs = {"lora_path": str(lora)} if lora else {}
        return llama_cpp.Llama(model_path=model_path, n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                               verbose=False, **kwargs)

    def decode_rate(llm) -> float:
        llm.reset()
        llm.eval(prompt)
        token = int(np.argmax(llama_cpp_last_logits(llm)))
        start = time.perf_counter()
        for _ in range(tokens - 1):
            llm.eval([token])
            token = int(np.argmax(llama_cpp_last_logits(llm)))
        return (tokens - 1) / (time.perf_counter() - start)

    base_llm, lora_llm = load(None), load(gguf_lora)
    lora_llm.reset()
    lora_llm.eval(prompt)
    logits = np.array(llama_cpp_last_logits(lora_llm), dtype=np.float32)
    decode_rate(lora_llm)  # warm-up
    base = [decode_rate(base_llm) for _ in range(repeats)]
    one = [decode_rate(lora_llm) for _ in range(repeats)]
    version = getattr(llama_cpp, "__version__", "?")
    return Row(f"llama.cpp {version}", best_of(base), best_of(one), None,
               note=f"GGUF LoRA via lora_path, {threads} threads"), logits


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file, or an HF directory without the llama.cpp peer "
                        "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4, help="adapters of the mixed batch (its size)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--work-dir", default=None, help="where the adapters are written (default: a temporary one)")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args(argv)
    systems = check_systems(parser, args.systems, SYSTEMS)
    for name in ("rank", "adapters", "decode_tokens", "repeats"):
        if getattr(args, name) < 1 or (name == "decode_tokens" and args.decode_tokens < 2):
            parser.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}; expected a positive integer "
                         "(decode tokens: at least 2)")
    import tempfile

    from ninefold.llm import hub
    from ninefold.llm.api import LLM
    from ninefold.llm.lora import LoRARequest

    model = str(args.model or hub.resolve_model(None))
    if "llama.cpp" in systems and not model.endswith(".gguf"):
        parser.error(f"--model: got {model!r}; the llama.cpp peer needs a .gguf file (every peer reads the same one)")
    print(f"ninefold: loading {model}", file=sys.stderr, flush=True)
    llm = LLM(model, device="cpu", enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              enable_prefix_caching=False, max_num_seqs=max(8, args.adapters))
    config = llm.engine.model_config
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ninefold-lora-bench-"))
    print(f"writing {args.adapters} adapters of rank {args.rank} under {work}", file=sys.stderr, flush=True)
    dirs = [work / f"adapter{i}" for i in range(args.adapters)]
    first = [write_peft_adapter(d, config, args.rank, seed=i) for i, d in enumerate(dirs)][0]
    loras = [LoRARequest(f"adapter{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
    rng = random.Random(0)
    prompt = [rng.randrange(3, config.vocab_size) for _ in range(64)]
    mixed = [[rng.randrange(3, config.vocab_size) for _ in range(64)] for _ in range(args.adapters)]
    print("ninefold: running", file=sys.stderr, flush=True)
    row, adapted, plain = bench_ninefold(llm, loras, prompt, mixed, args.decode_tokens, args.repeats)
    rows = [row]
    for system in systems[1:]:
        print(f"{system}: running", file=sys.stderr, flush=True)
        if system == "transformers":
            peer, logits = bench_transformers(model, dirs, prompt, mixed, args.decode_tokens, args.repeats)
        else:
            gguf_lora = write_gguf_lora(work / "adapter0.gguf", first, config, model, args.rank)
            peer, logits = bench_llama_cpp(model, gguf_lora, prompt, args.decode_tokens, args.repeats, args.threads)
        peer.cosine_vs_ninefold = _cosine(logits, adapted)
        if not (peer.cosine_vs_ninefold >= MIN_COSINE and peer.cosine_vs_ninefold > _cosine(logits, plain)):
            print(f"error: {peer.system}'s logits with the adapter disagree with ninefold's (cosine "
                  f"{peer.cosine_vs_ninefold:.4f}; against ninefold without it {_cosine(logits, plain):.4f}); "
                  "not timing a wrong answer", file=sys.stderr)
            return 1
        rows.append(peer)
    print(f"\nbatch-1 decode after a 64-token prompt, {args.decode_tokens} tokens, rank-{args.rank} adapters on "
          f"every projection, {args.threads} threads, {platform.processor() or platform.machine()}")
    best = {k: best_of(getattr(r, k) for r in rows[1:]) for k in ("base_tok_s", "lora_tok_s", "mixed_tok_s")}
    print(f"{'system':<20} {'base tok/s':>11} {'1 adapter':>10} {'(of base)':>10} {f'{args.adapters} mixed':>10} "
          f"{'cos vs nf':>10}  note")
    for r in rows:
        share = f"{r.lora_tok_s / r.base_tok_s:.0%}" if r.lora_tok_s and r.base_tok_s else ""
        cells = [f"{getattr(r, k):.1f}" if getattr(r, k) else "-" for k in ("base_tok_s", "lora_tok_s", "mixed_tok_s")]
        cos = "" if r.cosine_vs_ninefold is None else f"{r.cosine_vs_ninefold:.4f}"
        print(f"{r.system:<20} {cells[0]:>11} {cells[1]:>10} {share:>10} {cells[2]:>10} {cos:>10}  {r.note}")
    ratios = {k: rows[0].__dict__[k] / v for k, v in best.items() if v and rows[0].__dict__[k]}
    print("ninefold against the best peer: " + ", ".join(f"{k.removesuffix('_tok_s')} {v:.2f}x"
                                                         for k, v in ratios.items()))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "model": model, "rank": args.rank, "adapters": args.adapters, "decode_tokens": args.decode_tokens,
            "threads": args.threads, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": [asdict(r) for r in rows],
            "ratios_vs_best_peer": ratios}
        (out / "lora_bench.json").write_text(json.dumps(result, indent=1))
        plot(result, out / "lora_bench.png")
    return 0


def plot(result: dict, path: Path) -> None:
    """Grouped bars: decode tokens/s without an adapter, with one, and the mixed batch, per system."""
    plt = pyplot()
    if plt is None:
        return
    columns = (("base_tok_s", "no adapter"), ("lora_tok_s", "1 adapter"),
               ("mixed_tok_s", f"{result['adapters']} sequences, {result['adapters']} adapters"))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(columns)
    for k, (key, label) in enumerate(columns):
        values = [row[key] or 0.0 for row in result["rows"]]  # (no such run: an empty bar marked n/a)
        bars = ax.bar([i + k * width for i in range(len(values))], values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "n/a" for v in values], fontsize=7)
    ax.set_xticks([i + width for i in range(len(result["rows"]))], [row["system"] for row in result["rows"]])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"LoRA rank {result['rank']} on every projection, {result['threads']} threads", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
