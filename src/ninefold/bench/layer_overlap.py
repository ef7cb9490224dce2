"""Can a decode layer overlap its attention with its GEMMs? Heads split in two halves on two streams.

    OUT=DIR python -m ninefold.bench.layer_overlap               # GPU: Llama-3.1-8B layer, bfloat16, < 3 min
    python -m ninefold.bench.layer_overlap --device cpu          # plumbing check (tiny, eager, one stream)

A decode step runs each layer's GEMMs (compute-bound from about 190 rows) and its attention (bound by the
KV bytes) one after the other. With the query heads split in halves A and B (each half with its own KV
heads: GQA keeps a KV head's query heads together), half A's attention needs only half A's q/k/v columns
and feeds only half A's columns of the o projection's input:

    main:  qkv_A  | qkv_B    | attention_B         | o_B += (join)
    side:         | attention_A | o_A              |

so attention A can run beside the qkv GEMM of B, and o_A beside attention B, without reading any weight
twice (the qkv weight's rows are reordered into the two halves; o's columns are split). Variants, each
captured in one CUDA graph of ``L`` layers with their own weights and caches, replayed many times,
interleaved over rounds: ``serial`` (the engine's order: one qkv GEMM, one attention, one o GEMM),
``split_one_stream`` (the halves on one stream: what the split costs) and ``split_two_streams`` (the
overlap) and ``o_split_two_streams`` (one qkv GEMM in the usual layout, the halves' attention launched at once
on the two streams, o_A beside attention B: no weight reordered, only o's columns split). Each layer also runs the MLP (gate_up, SwiGLU, down) so the figures are shares of a layer.
The two halves' attention launches get separate arrival counters (``decode.counters`` is replaced for
the run; it is one buffer per device in the library).

Checks first: every variant's o output against the serial one (bfloat16 tolerance). Prints a table;
writes ``$OUT/layer_overlap.json`` and ``layer_overlap.png`` (``--replot JSON PNG`` redraws a stored run).
Exit 1 if a check failed.

Measured on an H100 (docs/perf/llm.md, thirtieth session): no variant gains more than 2.6% of a layer, and
the engine's offline run was slower with the o-split path; the split was not kept in the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ninefold import ops
from ninefold.bench.decode_attention import paged_caches
from ninefold.bench.decode_layer_pdl import capture, replay_ms
from ninefold.bench.results import pyplot, write_json

CASES = ((64, 1500), (128, 1200), (192, 900), (256, 700))  # (sequences, mean context): the offline run's range
VARIANTS = ("serial", "split_one_stream", "split_two_streams", "o_split_two_streams")


def _shape(device: torch.device) -> dict:
    if device.type == "cuda":
        return dict(hidden=4096, hq=32, hk=8, d=128, inter=14336, block=16, width=17408, dtype=torch.bfloat16)
    return dict(hidden=64, hq=4, hk=2, d=16, inter=96, block=8, width=256, dtype=torch.float32)


class _Lanes:
    """Arrival counters per lane, so that two attention launches in flight at once never share one."""

    def __init__(self, device: torch.device):
        self.buffers = [torch.zeros(1 << 16, dtype=torch.int32, device=device) for _ in range(2)]
        self.lane = 0

    def __call__(self, device, n):
        assert n <= self.buffers[self.lane].numel(), n
        return self.buffers[self.lane]


@contextlib.contextmanager
def _lanes_installed(device: torch.device):
    if device.type != "cuda":
        yield None
        return
    from ninefold.ops.triton import decode
    lanes, kept = _Lanes(device), decode.counters
    decode.counters = lanes
    try:
        yield lanes
    finally:
        decode.counters = kept


def _attention(q, kc, vc, tables, lens, lanes, lane: int):
    if lanes is None:
        return ops.attention_decode(q, kc, vc, tables, lens)
    from ninefold.ops.triton import decode
    lanes.lane = lane
    return decode.launch(q, kc, vc, tables, lens, None, decode.CONFIG)


class Layer:
    """One decode layer's weights and caches, whole and split into head halves A and B."""

    def __init__(self, s: dict, batch: int, context: int, device, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        h, hq, hk, d, dt = s["hidden"], s["hq"], s["hk"], s["d"], s["dtype"]
        w = lambda *shape: (torch.randn(*shape, generator=g, device=device) / shape[-1] ** 0.5).to(dt)  # noqa: E731
        self.s, self.batch = s, batch
        self.qkv, self.o = w(hq * d + 2 * hk * d, h), w(h, hq * d)
        self.gate_up, self.down = w(2 * s["inter"], h), w(h, s["inter"])
        self.x = torch.randn(batch, h, generator=g, device=device).to(dt)
        gl = torch.Generator().manual_seed(seed)
        lens = torch.randint(context // 2, context * 3 // 2 + 1, (batch,), generator=gl)
        self.lens = lens.to(torch.int32).to(device)
        self.kc, self.vc, self.tables = paged_caches(lens.tolist(), s["width"], hk, d, s["block"], dt, device, seed)
        qd, kd = hq * d // 2, hk * d // 2  # one half's q and k (= v) columns
        q, k, v = self.qkv.split([hq * d, hk * d, hk * d])
        self.qkv_half = [torch.cat([q[i * qd:(i + 1) * qd], k[i * kd:(i + 1) * kd], v[i * kd:(i + 1) * kd]])
                         for i in range(2)]
        self.o_half = [self.o[:, i * qd:(i + 1) * qd].contiguous() for i in range(2)]
        # Views of the one cache (the kernel reads the cache through its strides), as an engine would pass them.
        self.kc_half = [self.kc[:, :, i * hk // 2:(i + 1) * hk // 2] for i in range(2)]
        self.vc_half = [self.vc[:, :, i * hk // 2:(i + 1) * hk // 2] for i in range(2)]
        self.out = None

    def mlp(self, x):
        return F.linear(ops.silu_and_mul(F.linear(x, self.gate_up)), self.down)

    def serial(self, lanes, side=None):
        s, b = self.s, self.batch
        qkv = F.linear(self.x, self.qkv)
        q = qkv[:, : s["hq"] * s["d"]].view(b, s["hq"], s["d"])
        att = _attention(q, self.kc, self.vc, self.tables, self.lens, lanes, 0)
        self.out = F.linear(att.view(b, -1), self.o)
        return self.mlp(self.out)

    def _half_attention(self, i: int, qkv, lanes):
        s, b = self.s, self.batch
        q = qkv[:, : s["hq"] * s["d"] // 2].view(b, s["hq"] // 2, s["d"])
        return _attention(q, self.kc_half[i], self.vc_half[i], self.tables, self.lens, lanes, i).view(b, -1)

    def split(self, lanes, side=None):
        qkv_a = F.linear(self.x, self.qkv_half[0])
        if side is None:
            o_a = F.linear(self._half_attention(0, qkv_a, lanes), self.o_half[0])
        else:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                o_a = F.linear(self._half_attention(0, qkv_a, lanes), self.o_half[0])
        qkv_b = F.linear(self.x, self.qkv_half[1])
        att_b = self._half_attention(1, qkv_b, lanes)
        if side is not None:
            main.wait_stream(side)
        self.out = torch.addmm(o_a, att_b, self.o_half[1].t())
        return self.mlp(self.out)

    def o_split(self, lanes, side):
        """One qkv GEMM over the usual layout; the halves' attention at once (A on ``side``), o_A beside B's."""
        s, b = self.s, self.batch
        qkv = F.linear(self.x, self.qkv)
        q = qkv[:, : s["hq"] * s["d"]].view(b, s["hq"], s["d"])
        half = s["hq"] // 2
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            att_a = _attention(q[:, :half], self.kc_half[0], self.vc_half[0], self.tables, self.lens, lanes, 1)
            o_a = F.linear(att_a.view(b, -1), self.o[:, : half * s["d"]])
        att_b = _attention(q[:, half:], self.kc_half[1], self.vc_half[1], self.tables, self.lens, lanes, 0)
        main.wait_stream(side)
        self.out = torch.addmm(o_a, att_b.view(b, -1), self.o[:, half * s["d"]:].t())
        return self.mlp(self.out)


def _run(layers, variant: str, lanes, side):
    fn = {"serial": Layer.serial, "split_one_stream": Layer.split, "split_two_streams": Layer.split,
          "o_split_two_streams": Layer.o_split}[variant]
    stream = side if "two_streams" in variant else None
    for layer in layers:
        fn(layer, lanes, stream)


def check(layers, lanes, side) -> dict:
    """Each variant's o output against the serial one: max abs error over max abs value."""
    errors = {}
    for layer in layers:
        layer.serial(lanes)
        want = layer.out.float()
        for variant in VARIANTS[1:] if side is not None else VARIANTS[1:2]:
            _run([layer], variant, lanes, side)
            if side is not None:
                torch.cuda.synchronize()
            err = ((layer.out.float() - want).abs().max() / want.abs().max()).item()
            errors[variant] = max(errors.get(variant, 0.0), err)
    return errors


def plot(run: dict, path: str) -> None:
    """Microseconds per layer of every variant, one group of bars per (sequences, context) case."""
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in run["results"] if "us_per_layer" in r]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        xs = [j + (i - (len(VARIANTS) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r["us_per_layer"][variant] for r in rows], width, label=variant.replace("_", " "))
    ax.set_xticks(range(len(rows)), [f"{r['batch']} seqs\n~{r['context']} keys" for r in rows])
    ax.set_ylabel("us per layer (qkv, attention, o, MLP)")
    ax.set_title(f"decode layer, heads split over two streams: {run['device']}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ninefold.bench.layer_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=4, help="layers per graph (own weights and caches)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--cases", default=",".join(f"{b}x{c}" for b, c in CASES), help="BATCHxCONTEXT,...")
    p.add_argument("--replot", nargs=2, metavar=("JSON", "PNG"), help="only: draw a stored run's plot")
    args = p.parse_args(argv)
    if args.replot:
        plot(json.loads(pathlib.Path(args.replot[0]).read_text()), args.replot[1])
        return 0
    device = torch.device(args.device)
    s = _shape(device)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    if device.type != "cuda":
        cases = [(3, 20)]
    tol = 2e-2 if s["dtype"] == torch.bfloat16 else 1e-5
    results, failed = [], False
    side = torch.cuda.Stream() if device.type == "cuda" else None
    with _lanes_installed(device) as lanes:
        for batch, context in cases:
            layers = [Layer(s, batch, context, device, seed=i) for i in range(args.layers)]
            errors = check(layers, lanes, side)
            bad = {v: e for v, e in errors.items() if not e <= tol}
            failed |= bool(bad)
            row = {"batch": batch, "context": context, "relative_error": errors}
            if device.type == "cuda" and not bad:
                graphs = {v: capture(functools.partial(_run, layers, v, lanes, side))[0] for v in VARIANTS}
                times = {v: [] for v in VARIANTS}
                for _ in tqdm(range(args.rounds), desc=f"{batch}x{context}", leave=False):
                    for v in VARIANTS:
                        times[v].append(replay_ms(graphs[v], args.replays) * 1e3 / len(layers))
                row["us_per_layer"] = {v: min(t) for v, t in times.items()}
                row["us_per_layer_all"] = times
                del graphs
            results.append(row)
            del layers
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{v:>20}" for v in VARIANTS) + "   (us per layer; vs serial)")
    for r in results:
        t = r.get("us_per_layer")
        if t is None:
            print(f"{r['batch']:5d} {r['context']:7d}  errors {r['relative_error']}")
            continue
        print(f"{r['batch']:5d} {r['context']:7d} "
              + " ".join(f"{t[v]:9.1f} ({t[v] / t['serial'] - 1:+6.1%})" for v in VARIANTS))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    run = {"device": name, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "layers": args.layers, "results": results}
    written = write_json("layer_overlap.json", run, announce=True)
    if written is not None and device.type == "cuda":
        plot(run, str(written.with_suffix(".png")))
    if failed:
        print("FAILED: a variant's output differs from the serial one", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
