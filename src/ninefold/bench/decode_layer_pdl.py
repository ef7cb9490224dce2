"""Batch-1 decode step of Llama-3.1-8B shapes, whole layers, with and without PDL on the attention side.

The step is the engine's own op calls at one row on a GPU (``ninefold.llm.models.llama``):
per layer ``add_rms_norm_linear`` (qkv) -> ``rope_and_cache`` -> ``attention_decode`` -> ``linear``
(o) -> ``add_rms_norm_linear`` (gate_up) -> ``silu_and_mul_linear`` (down), 32 layers, then the
final norm and the lm_head; layer 0 norms separately (no residual yet). The block table is as wide
as the engine's CUDA graphs make it (17408 tokens), the context ``--context`` tokens.

Variants (each captured in a CUDA graph; the switches are read at capture):

- ``no_pdl``: ``NINEFOLD_GEMV_PDL=0`` (no PDL anywhere);
- ``pdl_gemv``: PDL on the GEMVs only (``NINEFOLD_DECODE_PDL=0``: the engine before this change);
- ``pdl_rope``, ``pdl_attn``: PDL on the GEMVs and on ``rope_and_cache`` / decode attention only;
- ``pdl_all``: PDL on every kernel of the layer (the default now);
- ``pdl_all_early``: ``pdl_all`` with ``NINEFOLD_DECODE_EARLY_KV=1`` (attention reads its first key
  tile before waiting; off by default).

Correctness first: the step without PDL against the unfused ops (cosine of the logits >= 0.995);
every variant's logits, final residual and KV caches, eagerly and from its graph,
against ``no_pdl`` run eagerly (bit-identical expected: PDL changes when kernels start, not what
they compute; a difference fails the run, exit 1). Then the graphs are replayed in interleaved
rounds (median ms per token) and checked again. Prints a table; JSON in ``$OUT/decode_layer_pdl.json``.
``--smoke`` runs tiny shapes on the CPU (Triton interpreter, no PDL, no graphs, no timing).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

from ninefold.bench import decode_chain
from ninefold.bench.results import write_json

FULL = dict(decode_chain.FULL, context=256, table_tokens=17408)
SMOKE = dict(decode_chain.SMOKE, context=40, table_tokens=128)
# variant: (NINEFOLD_GEMV_PDL, rope_and_cache PDL, decode attention PDL, NINEFOLD_DECODE_EARLY_KV)
VARIANTS = {"no_pdl": (False, False, False, False), "pdl_gemv": (True, False, False, False),
            "pdl_rope": (True, True, False, False), "pdl_attn": (True, False, True, False),
            "pdl_all": (True, True, True, False), "pdl_all_early": (True, True, True, True)}


@contextlib.contextmanager
def switches(gemv: bool, rope: bool, attention: bool, early: bool = False):
    """PDL of the GEMVs (``NINEFOLD_GEMV_PDL``), of ``rope_and_cache`` and of decode attention, and
    attention's early first tile (``NINEFOLD_DECODE_EARLY_KV``), for the block."""
    from ninefold.ops.triton import decode, rope_cache

    saved = (os.environ.get("NINEFOLD_GEMV_PDL"), rope_cache.pdl_wanted, decode.pdl_wanted,
             os.environ.get("NINEFOLD_DECODE_EARLY_KV"))
    real = decode.pdl_wanted
    os.environ["NINEFOLD_GEMV_PDL"] = "1" if gemv else "0"
    os.environ["NINEFOLD_DECODE_EARLY_KV"] = "1" if early else "0"
    rope_cache.pdl_wanted = lambda device: rope and real(device)
    decode.pdl_wanted = lambda device: attention and real(device)
    try:
        yield
    finally:
        for name, value in (("NINEFOLD_GEMV_PDL", saved[0]), ("NINEFOLD_DECODE_EARLY_KV", saved[3])):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        rope_cache.pdl_wanted, decode.pdl_wanted = saved[1], saved[2]


class Inputs:
    """The model's weights (``decode_chain.Model``) with a graph-wide block table and this step's token."""

    def __init__(self, s: dict, device: torch.device, dtype: torch.dtype):
        self.m = m = decode_chain.Model(s, device, dtype)
        width = s["table_tokens"] // s["block_size"]
        used = m.block_tables.shape[1]
        if width > used:  # the engine's graph-width tables: padding columns repeat the last block (never read)
            m.block_tables = torch.cat([m.block_tables, m.block_tables[:, -1:].expand(1, width - used)], 1).contiguous()
        self.s = s

    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k.clone(), v.clone()) for k, v in self.m.caches]


def step(inp: Inputs, caches, eps: float = 1e-5):
    """One decode step through the engine's op calls: (logits, final residual)."""
    from ninefold import ops

    m, s = inp.m, inp.s
    hd, hq, hk = s["head_dim"], s["heads"], s["kv_heads"]
    h, res = m.h0[None], None
    for i, w in enumerate(m.layers):
        if res is None:
            res = h
            qkv = ops.linear(ops.rms_norm(h, w["norm1"], eps), w["qkv"])
        else:
            qkv, res = ops.add_rms_norm_linear(h, res, w["norm1"], w["qkv"], eps)
        q, k, v = qkv.split([hq * hd, hk * hd, hk * hd], dim=-1)
        kc, vc = caches[i]
        q, k = ops.rope_and_cache(q.reshape(1, hq, hd), k.reshape(1, hk, hd), v.reshape(1, hk, hd), m.positions,
                                  m.cos_sin, kc, vc, m.slots, is_neox=True)
        o = ops.attention_decode(q, kc, vc, m.block_tables, m.context_lens, scale=hd ** -0.5)
        x = ops.linear(o.reshape(1, hq * hd), w["o"])
        gate_up, res = ops.add_rms_norm_linear(x, res, w["norm2"], w["gate_up"], eps)
        h = ops.silu_and_mul_linear(gate_up, w["down"])
    x, res = ops.add_rms_norm(h, res, m.final_norm, eps)
    return ops.linear(x, m.lm_head)[0], res[0]


def compare(got, want, caches, want_caches) -> dict:
    """Bit equality of (logits, residual) and of every KV cache, with the logits' cosine."""
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    same_kv = all(torch.equal(a, b) for pair, want_pair in zip(caches, want_caches) for a, b in zip(pair, want_pair))
    return dict(bit_equal=same and same_kv, cos_logits=decode_chain.cosine(got[0], want[0]))


def capture(fn):
    """``(graph, outputs)`` of ``fn`` captured (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_ms(graph, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ninefold.bench.decode_layer_pdl", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter), no timing")
    p.add_argument("--context", type=int, default=None, help="context tokens (default 256)")
    p.add_argument("--iters", type=int, default=100, help="graph replays per timing round (default 100)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5; median reported)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args(argv)
    for name in ("iters", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    shapes = dict(SMOKE if args.smoke else FULL)
    if args.context is not None:
        if not 1 <= args.context <= shapes["table_tokens"]:
            p.error(f"--context must be in 1..{shapes['table_tokens']}, got {args.context}")
        shapes["context"] = args.context
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("decode_layer_pdl needs a CUDA device (or --smoke); nothing measured.", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    import triton

    from ninefold.ops.triton.gemv_pdl import pdl_available

    t0 = time.perf_counter()
    pdl_ok = device.type == "cuda" and pdl_available(device)
    result = dict(shapes=shapes, device=str(device), torch=torch.__version__, triton=triton.__version__,
                  pdl_available=pdl_ok, variants={})
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    print(f"{result.get('gpu', 'cpu')}, torch {torch.__version__}, Triton {triton.__version__}, "
          f"PDL {'available' if pdl_ok else 'NOT available'}; {shapes['layers']} layers, context {shapes['context']}, "
          f"table {shapes['table_tokens']} tokens", flush=True)
    inp = Inputs(shapes, device, torch.bfloat16)
    ref_caches = inp.caches()
    with switches(False, False, False):
        want = step(inp, ref_caches)
        kept, inp.m.caches = inp.m.caches, inp.caches()
        try:  # the unfused ops (cuBLAS, separate norms, rope + reshape_and_cache): a sanity check of the step
            unfused = decode_chain.step_cublas(inp.m)
        finally:
            inp.m.caches = kept
    result["cos_vs_unfused"] = cos = decode_chain.cosine(want[0], unfused[0])
    failed = cos < decode_chain.COS_MIN
    print(f"no_pdl step vs the unfused ops: cos(logits) {cos:.5f} {'ok' if not failed else 'FAILED'}", flush=True)
    graphs = {}
    for name in args.variants:
        entry = result["variants"].setdefault(name, {})
        flags = VARIANTS[name]
        if any(flags) and not pdl_ok:
            entry["skipped"] = "PDL not available (sm_90+, Triton with launch_pdl, no interpreter)"
            print(f"{name:9s} skipped: {entry['skipped']}", flush=True)
            continue
        caches = inp.caches()
        try:
            with switches(*flags):
                got = step(inp, caches)
                entry["eager"] = compare(got, want, caches, ref_caches)
                if device.type == "cuda":
                    graph_caches = inp.caches()
                    graph, out = capture(lambda caches=graph_caches: step(inp, caches))
                    for _ in range(2):
                        graph.replay()
                    torch.cuda.synchronize()
                    entry["graph"] = compare(out, want, graph_caches, ref_caches)
                    # The graph writes into these caches and its outputs: they must outlive it (each
                    # capture empties the allocator's cache, so freed memory would go back to the driver).
                    graphs[name] = (graph, out, graph_caches)
        except Exception as error:  # reported; the other variants still run
            entry["error"] = f"{error!r}"[:800]
            failed = True
            print(f"{name:9s} FAILED to run: {entry['error']}", flush=True)
            continue
        checks = [entry["eager"]] + ([entry["graph"]] if "graph" in entry else [])
        entry["ok"] = all(c["bit_equal"] for c in checks)
        failed |= not entry["ok"]
        print(f"{name:9s} check vs no_pdl eager: " + ", ".join(
            f"{kind} {'bit-equal' if c['bit_equal'] else 'DIFFERS'} (cos {c['cos_logits']:.6f})"
            for kind, c in zip(("eager", "graph"), checks)) + ("" if entry["ok"] else "  FAILED"), flush=True)
    if graphs:
        rounds = {name: [] for name in graphs}
        for _ in range(args.rounds):
            for name, (graph, _, _) in graphs.items():
                rounds[name].append(replay_ms(graph, args.iters))
        for name, (_, out, graph_caches) in graphs.items():  # the last replay's results, after the timing
            entry = result["variants"][name]
            entry["after_timing"] = compare(out, want, graph_caches, ref_caches)
            if not entry["after_timing"]["bit_equal"]:
                entry["ok"], failed = False, True
                print(f"{name:9s} DIFFERS from no_pdl after the timed replays  FAILED", flush=True)
        base = statistics.median(rounds["pdl_gemv"]) if "pdl_gemv" in rounds else None
        print(f"\nbatch-1 decode step in a CUDA graph ({args.rounds} rounds x {args.iters} replays, median)")
        print(f"{'variant':13s} {'ms/token':>9s} {'tok/s':>8s} {'us/layer vs pdl_gemv':>21s}")
        for name, times in rounds.items():
            ms = statistics.median(times)
            entry = result["variants"][name]
            entry.update(ms_per_token=ms, tok_per_s=1e3 / ms, rounds_ms=times)
            delta = f"{(ms - base) * 1e3 / shapes['layers']:+.2f}" if base else "-"
            print(f"{name:13s} {ms:9.4f} {1e3 / ms:8.1f} {delta:>21s}")
    result["seconds"] = time.perf_counter() - t0
    write_json("decode_layer_pdl.json", result)
    print(f"total {result['seconds']:.1f} s" + ("; a variant differed from no_pdl or failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
