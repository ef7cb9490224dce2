"""CPU benchmark of the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), against its peers.

    python -m ninefold.bench.cpu [--threads N] [--systems ninefold-bf16,ninefold-f32-packed,...,llama.cpp]

ninefold runs five ways: `ninefold-bf16` (bfloat16, `quantization="auto"`: the Q4_1 and Q8_0 matrices
stay in their blocks for ninefold's native CPU kernels, `ninefold.ops.cpu_native`: int8 activations,
AVX-512 VNNI or AVX2, the whole decode step in one native call; a dense bf16 copy serves prefill),
`ninefold-f32-packed` (what `ninefold chat` runs by default on a CPU: the same in a float32 model,
prefill on a dense float32 copy), `ninefold-bf16-torch` (bfloat16 "auto" with the native kernels off:
torch's int4 kernel, the Q8_0 lm_head as two int4 halves, the decode step in torch ops), and
`ninefold-bf16-exact` / `ninefold-f32`, which dequantize every weight at load (`quantization="none"`).

For each system, in this one process: load time (from the cached .gguf), batch-1 decode tok/s,
prefill tok/s of a 512-token prompt, and batch-8 decode tok/s (output tokens of all 8 sequences per
second). Greedy decoding with end-of-sequence ignored, so every run makes the same number of
tokens. Each figure is the best of `--repeats` runs (the machine may be shared). Peers:
transformers `generate` loading the same file with `gguf_file=` (float32 and bfloat16), and
llama.cpp through llama-cpp-python (a benchmark-only peer, not a dependency of ninefold).
Prints a table with ratios to the best peer; writes JSON under $OUT (or --out) when set.

`--kernels` times the operators instead, on SmolLM2's shapes with random weights: `ops.linear_blocks`
(native, int8 activations) against torch's int4 kernel and a dense bf16 `F.linear` for 1, 8, 16 and
512 rows, and `attention_prefill` (`cpu_native` against `vendor`) on a 512-token prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

SYSTEMS = ("ninefold-bf16", "ninefold-f32-packed", "ninefold-bf16-torch", "ninefold-bf16-exact", "ninefold-f32",
           "hf-f32", "hf-bf16", "llama.cpp")
# system -> (dtype, quantization, native kernels on)
NINEFOLD = {"ninefold-bf16": ("bfloat16", "auto", True), "ninefold-f32-packed": ("float32", "auto", True),
            "ninefold-bf16-torch": ("bfloat16", "auto", False),
            "ninefold-bf16-exact": ("bfloat16", "none", True), "ninefold-f32": ("float32", "none", True)}
EOS = 2


@dataclass
class Result:
    """Measured figures of one system (None where not measured)."""

    system: str
    load_s: float | None = None
    decode_b1_tok_s: float | None = None
    prefill_tok_s: float | None = None
    decode_b8_tok_s: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


@dataclass
class Workload:
    """Token ids every system runs: one short prompt, one long prompt, eight distinct short prompts."""

    short: list[int]
    long: list[int]
    batch: list[list[int]]
    decode_tokens: int
    repeats: int


def build_workload(path: Path, prefill_tokens: int, batch: int, decode_tokens: int, repeats: int) -> Workload:
    """Prompts tokenized with the model's own tokenizer: chat-formatted questions and a long text."""
    from ninefold.llm.gguf import load_gguf_tokenizer
    from ninefold.llm.tokenizer import Tokenizer

    tok = Tokenizer(*load_gguf_tokenizer(path))
    topics = ["the ocean", "volcanoes", "honey bees", "the moon", "bread baking", "chess", "rainbows", "trains"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {t}."}], tokenize=True)
               for t in topics[:batch]]
    paragraph = ("The history of computing is a story of people, ideas and machines. Early mechanical "
                 "calculators gave way to electronic computers, then to transistors and integrated circuits. ")
    long = tok.encode(paragraph * (prefill_tokens // 20 + 1))[:prefill_tokens]
    return Workload(prompts[0], long, prompts, decode_tokens, repeats)


def best_of(values):
    """The largest of ``values`` that is not None (None if there is none): a rate's best run."""
    values = [v for v in values if v is not None]
    return max(values) if values else None


def check_systems(parser, value: str, systems: tuple[str, ...]) -> list[str]:
    """``--systems``'s names (comma-separated), which must include ``systems[0]`` and name only ``systems``."""
    names = value.split(",")
    unknown = sorted(set(names) - set(systems))
    if unknown or systems[0] not in names:
        parser.error(f"--systems: got {value!r}; expected {systems[0]} plus any of {', '.join(systems[1:])}")
    return names


# ----------------------------------------------------------------------------- ninefold

def bench_ninefold(path: Path, dtype: str, work: Workload, quantization: str = "auto", native: bool = True) -> Result:
    from ninefold.llm.api import LLM
    from ninefold.llm.sampling import SamplingParams
    from ninefold.ops import cpu_native

    start = time.perf_counter()
    cpu_native.available()  # a first use compiles them (once per machine): not part of the load time
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    with cpu_native.enabled(native):
        llm = LLM(str(path), dtype=dtype, device="cpu", enable_prefix_caching=False, max_model_len=2048,
                  max_num_seqs=max(8, len(work.batch)), quantization=quantization)
    load = time.perf_counter() - start
    engine = llm.engine

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
        """(seconds until every sequence has its first token, seconds of the rest, tokens of the rest)."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for ids in prompts:
            engine.add_request(engine.build_request(ids, params))
        produced: dict[str, int] = {}
        t0 = time.perf_counter()
        t_first = None
        rest = 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            for out in outs:
                n = len(out.outputs[0].token_ids)
                if t_first is not None:
                    rest += n - produced.get(out.request_id, 0)
                produced[out.request_id] = n
            if t_first is None and len(produced) == len(prompts):
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        return t_first - t0, t_end - t_first, rest

    run([work.short], 4)  # warm-up
    decode1, prefill, decode8 = [], [], []
    for _ in range(work.repeats):
        _, seconds, tokens = run([work.short], work.decode_tokens)
        decode1.append(tokens / seconds)
        first, _, _ = run([work.long], 1)
        prefill.append(len(work.long) / first)
        _, seconds, tokens = run(work.batch, work.decode_tokens)
        decode8.append(tokens / seconds)
    model = engine.model
    on = bool(model.packed) and any(p.blocks is not None for p in model.packed.values())
    if not model.packed:
        packed = "dequantized at load"
        label = (" kernels-off" if quantization != "none" else "") + ("" if dtype == "float32" else " exact")
    elif on:
        packed = f"native kernels ({cpu_native.isa()}; GGUF blocks, int8 activations)"
        label = " packed" if dtype == "float32" else ""
    else:
        packed, label = "torch int4 (Q8_0 lm_head as 2 int4 halves)", " torch-int4"
    return Result(f"ninefold {dtype}{label}", load, best_of(decode1), best_of(prefill), best_of(decode8),
                  note=f"quantization={quantization!r}: {packed}", extra={"native_compile_s": round(compile_s, 2)})


# ----------------------------------------------------------------------------- transformers

def bench_transformers(path: Path, dtype: torch.dtype, work: Workload, model=None, load: float | None = None) -> tuple[Result, object]:
    from transformers import AutoModelForCausalLM

    note = ""
    if model is None:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
        load = time.perf_counter() - start
    else:
        start = time.perf_counter()
        model = model.to(dtype)
        note = f"loaded as float32 ({load:.1f} s) and cast ({time.perf_counter() - start:.1f} s)"
        load += time.perf_counter() - start

    def generate(prompts: list[list[int]], new: int) -> float:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=EOS)
            return time.perf_counter() - start

    generate([work.short], 4)
    n = work.decode_tokens
    batch = _same_length(work.batch)
    # Decode rate = extra tokens / (time of n tokens - time of 1 token), from the fastest run of each
    # (a difference of single runs can go negative when the shared machine stalls one of them).
    one1, full1, prefill, one8, full8 = [], [], [], [], []
    for _ in range(work.repeats):
        one1.append(generate([work.short], 1))
        full1.append(generate([work.short], n))
        prefill.append(len(work.long) / generate([work.long], 1))
        one8.append(generate(batch, 1))
        full8.append(generate(batch, n))

    def rate(tokens: int, full: list[float], one: list[float]) -> float | None:
        extra = min(full) - min(one)
        return tokens / extra if extra > 0 else None

    name = "transformers " + str(dtype).removeprefix("torch.")
    return Result(name, load, rate(n - 1, full1, one1), best_of(prefill), rate(len(batch) * (n - 1), full8, one8),
                  note), model


def _same_length(prompts: list[list[int]]) -> list[list[int]]:
    """Cut the prompts to the shortest one's length, so a batch needs no padding."""
    shortest = min(len(p) for p in prompts)
    return [p[:shortest] for p in prompts]


# ----------------------------------------------------------------------------- llama.cpp

def llama_cpp_context(llm, params):
    """A second llama.cpp context of ``params`` over ``llm``'s model (the API's name differs between versions)."""
    import llama_cpp

    init = getattr(llama_cpp, "llama_init_from_model", None) or llama_cpp.llama_new_context_with_model
    return init(llm.model, params)


def llama_cpp_last_logits(llm):
    """The logits of the last token a ``Llama`` evaluated, a numpy view (its ``scores`` hold them only with
    ``logits_all``)."""
    import ctypes

    import llama_cpp
    import numpy as np

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (llm.n_vocab(),))


def llama_cpp_clear(ctx) -> None:
    """Empty a llama.cpp context's KV memory, in whichever API this llama-cpp-python has."""
    import llama_cpp

    if hasattr(llama_cpp, "llama_memory_clear"):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    else:  # llama-cpp-python before the llama_memory API
        (getattr(llama_cpp, "llama_kv_self_clear", None) or llama_cpp.llama_kv_cache_clear)(ctx)


def bench_llama_cpp(path: Path, threads: int, work: Workload) -> Result:
    import ctypes

    import llama_cpp
    import numpy as np

    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                          n_batch=512, verbose=False)
    load = time.perf_counter() - start
    n_vocab = llm.n_vocab()

    def greedy() -> int:
        return int(np.argmax(llama_cpp_last_logits(llm)))

    def decode_b1() -> float:
        llm.reset()
        llm.eval(work.short)
        token = greedy()
        start = time.perf_counter()
        for _ in range(work.decode_tokens - 1):
            llm.eval([token])
            token = greedy()
        return (work.decode_tokens - 1) / (time.perf_counter() - start)

    def prefill() -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(work.long)
        return len(work.long) / (time.perf_counter() - start)

    # Batch 8: a second context with one sequence per prompt, driven through llama_batch.
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_seq_max = 4096, 512, len(work.batch)
    params.n_threads, params.n_threads_batch = threads, threads
    ctx = llama_cpp_context(llm, params)
    batch = llama_cpp.llama_batch_init(512, 0, len(work.batch))

    def submit(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax_at(i: int) -> int:
        row = llama_cpp.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (n_vocab,))))

    def decode_b8() -> float:
        llama_cpp_clear(ctx)
        entries, last = [], []
        for s, ids in enumerate(work.batch):
            entries += [(t, p, s, p == len(ids) - 1) for p, t in enumerate(ids)]
            last.append(len(entries) - 1)
        submit(entries)
        tokens = [argmax_at(i) for i in last]
        positions = [len(ids) for ids in work.batch]
        start = time.perf_counter()
        for _ in range(work.decode_tokens - 1):
            submit([(t, p, s, True) for s, (t, p) in enumerate(zip(tokens, positions))])
            tokens = [argmax_at(i) for i in range(len(tokens))]
            positions = [p + 1 for p in positions]
        return len(work.batch) * (work.decode_tokens - 1) / (time.perf_counter() - start)

    decode_b1(), prefill()  # warm-up
    results = [(decode_b1(), prefill(), decode_b8()) for _ in range(work.repeats)]
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    version = getattr(llama_cpp, "__version__", "?")
    return Result(f"llama.cpp {version}", load, *(best_of(r[i] for r in results) for i in range(3)),
                  note=f"llama-cpp-python {version}, {threads} threads")


# ----------------------------------------------------------------------------- driver

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every system")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the cached SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=None, help="JSON file for the results (default: $OUT/cpu.json when OUT is set)")
    parser.add_argument("--kernels", action="store_true", help="time the CPU operators on SmolLM2's shapes instead")
    args = parser.parse_args(argv)
    if args.kernels:
        torch.set_num_threads(args.threads)
        print(bench_kernels(args.repeats))
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; supported: {', '.join(SYSTEMS)}")
    if not 1 <= args.batch <= 8:
        parser.error(f"--batch: got {args.batch}; supported: 1 to 8")

    from ninefold.llm import hub

    torch.set_num_threads(args.threads)
    path = hub.resolve_model(args.model)
    work = build_workload(path, args.prefill_tokens, args.batch, args.decode_tokens, args.repeats)
    print(f"# {path.name}: threads={args.threads}, decode {args.decode_tokens} tokens, prefill "
          f"{len(work.long)} tokens, batch {len(work.batch)}; best of {args.repeats}", flush=True)
    results: list[Result] = []
    hf_model = hf_load = None
    for system in systems:
        load_before = os.getloadavg()[0]
        try:
            if system.startswith("ninefold"):
                dtype, quantization, native = NINEFOLD[system]
                result = bench_ninefold(path, dtype, work, quantization, native)
            elif system == "hf-f32":
                result, hf_model = bench_transformers(path, torch.float32, work)
                hf_load = result.load_s
            elif system == "hf-bf16":
                result, hf_model = bench_transformers(path, torch.bfloat16, work, hf_model, hf_load)
            else:
                result = bench_llama_cpp(path, args.threads, work)
        except Exception as error:  # a missing peer must not hide the others' figures
            result = Result(system, note=f"not measured: {type(error).__name__}: {error}")
        result.extra["loadavg_1min"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
        results.append(result)
        print(_row(result), flush=True)
    print()
    print(format_table(results, args.prefill_tokens))
    out = args.out or (os.path.join(os.environ["OUT"], "cpu.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({
            "command": "python -m ninefold.bench.cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{_cpu_name()}, {os.cpu_count()} cores",
            "torch": torch.__version__,
            "results": [asdict(r) for r in results],
        }, indent=2))
        print(f"\nwrote {out}")
    return 0


# ----------------------------------------------------------------------------- operators

KERNEL_SHAPES = (("qkv", 960, 576, 4), ("o", 576, 576, 4), ("gate_up", 3072, 576, 4), ("down", 576, 1536, 4),
                 ("lm_head", 49152, 576, 8))


def _time_us(fn, args: tuple, repeats: int, calls: int) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def bench_kernels(repeats: int) -> str:
    """A markdown table of per-call times (us, best of ``repeats``) of the CPU operators on SmolLM2's shapes."""
    import torch.nn.functional as F

    from ninefold import ops
    from ninefold.ops import cpu_native
    from ninefold.ops.attention import _attention_prefill_torch
    from ninefold.ops.cpu_native.attention import _attention_prefill_native
    from ninefold.ops.quantized import _linear_blocks_native, _linear_int4_cpu

    if not cpu_native.fast():
        return f"{cpu_native.slow_reason()}: nothing to time"
    g = torch.Generator().manual_seed(0)
    lines = [f"native tier {cpu_native.isa()}, threads={torch.get_num_threads()}, best of {repeats}; "
             "GB/s = the native weight's bytes per call time",
             "| matrix | N x K | rows | native us (GB/s) | torch int4 us | dense bf16 us |", "| --- | --- | --- | --- | --- | --- |"]
    for name, n, k, bits in KERNEL_SHAPES:
        scales = (torch.rand((n, k // 32), generator=g) * 0.02 + 0.001).half().float()
        if bits == 4:
            codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
            offsets = (-8 * scales).half().float()
            blocks = ops.BlockWeight(codes, scales, offsets, 4)
            int4, doubled = ops.Int4Weight(codes, scales, offsets, 32), False
        else:
            codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            blocks = ops.BlockWeight(codes, scales, None, 8)
            u = codes.to(torch.int16) + 128  # torch's form: two int4 halves over [x, x]
            int4 = ops.Int4Weight(torch.cat((u >> 4, u & 15), 1), torch.cat((16 * scales, scales), 1),
                                  torch.cat((torch.zeros_like(scales), -128 * scales), 1), 32)
            doubled = True
        dense = blocks.dequantize(torch.bfloat16)
        for m in (1, 8, 16, 512):
            if name == "lm_head" and m == 512:
                continue
            x = torch.randn((m, k), generator=g).to(torch.bfloat16)
            xi = torch.cat((x, x), 1) if doubled else x
            calls = max(1, int(2e5 // (n * k * max(m, 8) // 8 / 1e3)))
            t_native = _time_us(_linear_blocks_native, (x, blocks, None), repeats, calls)
            t_int4 = _time_us(_linear_int4_cpu, (xi, int4, None), repeats, calls)
            t_dense = _time_us(F.linear, (x, dense), repeats, calls)
            lines.append(f"| {name} | {n} x {k} | {m} | {t_native:.0f} ({blocks.nbytes / t_native / 1e3:.1f}) | "
                         f"{t_int4:.0f} | {t_dense:.0f} |")
    t, hq, hk, d = 512, 9, 3, 64
    qkv = torch.randn((t, (hq + 2 * hk) * d), generator=g).to(torch.bfloat16)
    q, k_, v = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d: (hq + hk) * d].view(t, hk, d), qkv[:, (hq + hk) * d:].view(t, hk, d)
    cu = torch.tensor([0, t], dtype=torch.int32)
    args = (q, k_, v, cu, cu, None, None, None, None)
    native = _time_us(_attention_prefill_native, args, repeats, 5)
    vendor = _time_us(_attention_prefill_torch, args, repeats, 5)
    lines += ["", "| attention_prefill, 512 tokens, 9/3 heads of 64, bf16 | cpu_native us | vendor (torch SDPA) us |",
              "| --- | --- | --- |", f"| one layer | {native:.0f} | {vendor:.0f} |"]
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(r: Result) -> str:
    return (f"{r.system:24s} load {_fmt(r.load_s)} s | decode b1 {_fmt(r.decode_b1_tok_s)} tok/s | "
            f"prefill {_fmt(r.prefill_tok_s)} tok/s | decode b8 {_fmt(r.decode_b8_tok_s)} tok/s | "
            f"load avg {r.extra.get('loadavg_1min')}  {r.note}")


def format_table(results: list[Result], prefill_tokens: int = 512) -> str:
    """A markdown table; ninefold rows get their ratio to the best peer in each column."""
    keys = ("load_s", "decode_b1_tok_s", "prefill_tok_s", "decode_b8_tok_s")
    peers = [r for r in results if not r.system.startswith("ninefold")]
    best = {}
    for key in keys:
        values = [getattr(r, key) for r in peers if getattr(r, key) is not None]
        best[key] = (min(values) if key == "load_s" else max(values)) if values else None
    lines = [f"| system | load (s) | batch-1 decode (tok/s) | prefill {prefill_tokens} (tok/s) | batch-8 decode (tok/s) "
             "| machine load avg (before, after) | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        cells = []
        for key in keys:
            value = getattr(r, key)
            cell = _fmt(value)
            if r.system.startswith("ninefold") and value is not None and best[key]:
                if key == "load_s":
                    cell += f" ({value / best[key]:.1f}x best peer's time)"
                else:
                    cell += f" ({value / best[key]:.2f}x best peer)"
            cells.append(cell)
        lines.append(f"| {r.system} | " + " | ".join(cells) + f" | {r.extra.get('loadavg_1min')} | {r.note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
