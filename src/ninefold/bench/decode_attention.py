"""The attention-side kernels of one decode step, timed inside CUDA graphs (as the engine runs them).

    OUT=DIR python -m ninefold.bench.decode_attention        # H200, Llama-3-8B heads, bfloat16, < 4 min
    OUT=DIR python -m ninefold.bench.decode_attention --kv-cache-dtype fp8   # the same over FP8 caches
    TRITON_INTERPRET=1 python -m ninefold.bench.decode_attention --device cpu   # plumbing check (tiny, eager)

1. Correctness on the device first: the one-kernel decode attention (last split merges) and the
   two-kernel one (split + merge kernel) against a float64 evaluation on ragged lengths with a
   CUDA-graph-wide block table; the one-kernel path replayed in a CUDA graph (counters reset by
   the kernel: every replay equal); the fused ``rope_and_cache`` kernel bit-equal to ``rope`` then
   ``reshape_and_cache`` (outputs and both caches), eagerly and in a graph.
2. Timings: each variant captured ``L`` times in one CUDA graph (``L`` layers with their own caches
   and queries, so consecutive calls read different memory, as in a model step), the graph replayed
   many times; microseconds per call = replay time / L. Decode attention old (two kernels) vs new
   (one kernel) at (batch, context) in ``DECODE_CASES`` with block tables as wide as the engine's
   graphs (``--width`` tokens, the LLM bench's 17408); rope + reshape_and_cache vs rope_and_cache
   at batch 1 and 256.
3. Sweep (``--sweep``, default on CUDA): launch configurations of the one-kernel decode at the
   batch-256 cases, each checked against float64 before it is timed.

Prints a table and writes ``$OUT/decode_attention.json``. Exit 1 if a correctness check failed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from tqdm import tqdm

from ninefold.bench.results import write_json
from ninefold.runtime.kv_pool import as_bytes

DECODE_CASES = ((1, 256), (1, 4096), (64, 600), (256, 600), (256, 1200))
ROPE_BATCHES = (1, 256)
# The configuration before the one-kernel merge (the "old" column): two kernels, no split regime of its own.
OLD = dict(block_n=64, num_warps=4, num_stages=2, per_sm=4, min_tiles=2, heads_fastest=0, one_kernel=0, split_config={})
# Sweeps (the budget stops starting configs). Split regime (few programs: batch 1, 64): keys per step,
# warps, stages, fewest keys per split, merge tile; timed at SPLIT_CASES as decode.CONFIG["split_config"].
SWEEP_SPLIT = [dict(block_n=bn, num_warps=w, num_stages=st, min_split=ms, merge_rows=mr, heads_fastest=hf,
                    heads_per_program=1)
               for bn, w, st in ((64, 4, 2), (128, 4, 2), (64, 4, 3))
               for ms in (0, 256, 512) for mr in (64, 16) for hf in (0, 1)]
# Unsplit regime (one program per sequence and KV head(s): batch 256): timed at UNSPLIT_CASES. Compiled for
# sm_90 with the JIT's specialisations, 64/4/2 takes 128 registers and 39 KB of shared memory, as does
# 16 keys x 4 KV heads per program (64 tile rows: a token's 4 heads are 1 KB contiguous; 4x fewer programs).
SWEEP_UNSPLIT = [dict(block_n=bn, num_warps=w, num_stages=st, heads_fastest=hf, heads_per_program=h)
                 for bn, w, st, h in ((64, 4, 2, 1), (16, 4, 2, 4), (16, 4, 3, 4), (8, 4, 3, 4), (16, 8, 3, 4),
                                      (32, 8, 2, 4), (16, 4, 2, 2), (32, 4, 2, 2), (32, 4, 3, 1), (32, 4, 2, 1),
                                      (32, 4, 4, 1), (64, 4, 3, 1), (16, 4, 3, 1), (16, 2, 4, 1), (64, 8, 3, 1),
                                      (128, 4, 2, 1))
                 for hf in (0, 1)]
SPLIT_CASES = ((1, 256), (1, 4096), (64, 600))
UNSPLIT_CASES = ((256, 600), (256, 1200))



def _shapes(device: torch.device, kv_cache_dtype: str = "auto") -> dict:
    """Heads, block size, dtypes (``cache``: the KV cache's, float8_e4m3fn codes under ``fp8``) and cases."""
    if device.type == "cuda":
        sh = dict(hq=32, hk=8, d=128, block=16, dtype=torch.bfloat16, cases=DECODE_CASES, rope=ROPE_BATCHES)
    else:
        sh = dict(hq=4, hk=2, d=16, block=8, dtype=torch.float32, cases=((3, 70),), rope=(3,))
    sh["cache"] = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else sh["dtype"]
    return sh


def paged_caches(lengths, width_tokens, hk, d, block, dtype, device, seed):
    """Caches with each sequence's blocks at random places; tables ``width_tokens`` wide (padding -> block 0)."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // block) for n in lengths]
    num_blocks = sum(per) + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    width = max(max(per), -(-width_tokens // block))
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(per):
        tables[b, :n] = perm[start:start + n]
        start += n
    dev_g = torch.Generator(device=device).manual_seed(seed)  # gigabytes of keys: drawn on the device
    k_cache = torch.randn(num_blocks, block, hk, d, generator=dev_g, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block, hk, d, generator=dev_g, device=device).to(dtype)
    return k_cache, v_cache, tables.to(device)


def decode64(q, k_cache, v_cache, tables, lens) -> torch.Tensor:
    """Float64 decode attention, one sequence at a time (GQA by repeating KV heads)."""
    b, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float64, device=q.device)
    for i, n in enumerate(lens.tolist()):
        pages = tables[i, : -(-n // bs)].long()
        k = k_cache[pages].flatten(0, 1)[:n].double().repeat_interleave(hq // hk, 1)  # [n, Hq, D]
        v = v_cache[pages].flatten(0, 1)[:n].double().repeat_interleave(hq // hk, 1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) / math.sqrt(d)
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def _close(out, want, tol=2e-2) -> float:
    err = (out.double() - want).abs().max().item()
    if not err <= tol + tol * want.abs().max().item():
        raise AssertionError(f"max abs error {err:.3g}")
    return err


def graph_time(fns, device, replays: int) -> float:
    """Microseconds per call of ``fns`` (one per layer) captured in order into one CUDA graph."""
    if device.type != "cuda":
        for fn in fns:
            fn()
        start = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - start) * 1e6 / len(fns)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles, allocates the persistent counters) before capture
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):  # best of three batches of replays
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * len(fns)))
    del graph
    return best


def _layers(per_layer_bytes: int, device) -> int:
    """Layers in a graph: enough distinct memory per replay to leave the 50 MB L2 behind (2..32)."""
    if device.type != "cuda":
        return 2
    return max(2, min(32, math.ceil((256 << 20) / max(per_layer_bytes, 1))))


# ----------------------------------------------------------------------------- decode attention
def check_decode(sh, device, width) -> list[dict]:
    from ninefold.ops.triton import decode

    rows = [check_decode_large_batch(sh, device, width)] if device.type == "cuda" else []
    lengths = [1, 17, 1000, 4097, 300, 600] if device.type == "cuda" else [1, 5, 40, 23]
    k_cache, v_cache, tables = paged_caches(lengths, width, sh["hk"], sh["d"], sh["block"], sh["cache"], device, 1)
    q = torch.randn(len(lengths), sh["hq"], sh["d"], generator=torch.Generator().manual_seed(2)).to(device, sh["dtype"])
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    want = decode64(q, k_cache, v_cache, tables, lens)
    padded = torch.cat([lens, torch.zeros(2, dtype=torch.int32, device=device)])  # graph padding rows: context 0
    qp = torch.cat([q, q[:2]])
    tp = torch.cat([tables, torch.zeros_like(tables[:2])])
    for name, one in (("two kernels", 0), ("one kernel", 1)):
        config = dict(decode.CONFIG, one_kernel=one)
        row = {"check": f"decode {name} ragged {lengths} width {tables.shape[1] * sh['block']}"}
        try:
            row["max_abs_err"] = _close(decode.launch(q, k_cache, v_cache, tables, lens, None, config), want)
            wide = decode.launch(qp, k_cache, v_cache, tp, padded, None, config)
            _close(wide[: len(lengths)], want)
            if one and not bool((wide[len(lengths):] == 0).all()):
                raise AssertionError("rows of context 0 are not zero")
            if one and device.type == "cuda":  # replays: the counters must come back to zero every time
                out = torch.empty_like(q)
                graph = torch.cuda.CUDAGraph()
                decode.launch(q, k_cache, v_cache, tables, lens, None, config)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    out.copy_(decode.launch(q, k_cache, v_cache, tables, lens, None, config))
                results = []
                for _ in range(5):
                    graph.replay()
                    results.append(out.clone())
                torch.cuda.synchronize()
                _close(results[0], want)
                if not all(torch.equal(results[0], r) for r in results[1:]):
                    raise AssertionError("CUDA-graph replays differ")
                if int(decode.counters(device, 1).abs().sum()) != 0:
                    raise AssertionError("arrival counters not reset to zero")
                row["graph_replays_equal"] = True
            row["ok"] = True
        except Exception as error:  # noqa: BLE001  (reported; the run goes on and exits 1)
            row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:300]}")
        rows.append(row)
    return rows


def check_decode_large_batch(sh, device, width) -> dict:
    """The default configuration where one program takes a whole sequence (no split): 264 ragged sequences."""
    from ninefold.ops.triton import decode

    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(1, 1500, (264,), generator=g).tolist()
    k_cache, v_cache, tables = paged_caches(lengths, width, sh["hk"], sh["d"], sh["block"], sh["cache"], device, 5)
    q = torch.randn(len(lengths), sh["hq"], sh["d"], generator=g).to(device, sh["dtype"])
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    splits = decode.plan(len(lengths), sh["hk"], tables.shape[1] * sh["block"], decode._sm_count(device), sh["dtype"],
                         decode.CONFIG)[-1]
    row = {"check": f"decode default config, {len(lengths)} ragged sequences ({splits} split)"}
    try:
        row["max_abs_err"] = _close(decode.launch(q, k_cache, v_cache, tables, lens, None, decode.CONFIG),
                                    decode64(q, k_cache, v_cache, tables, lens))
        row["ok"] = True
    except Exception as error:  # noqa: BLE001
        row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:300]}")
    return row


def time_decode(sh, device, width, replays) -> list[dict]:
    from ninefold.ops.triton import decode

    rows = []
    for batch, context in tqdm(sh["cases"], desc="decode", file=sys.stdout, disable=None):
        item = sh["cache"].itemsize
        kv_bytes = 2 * batch * context * sh["hk"] * sh["d"] * item
        n_layers = _layers(kv_bytes, device)
        layers = []
        for i in range(n_layers):
            k_cache, v_cache, tables = paged_caches([context] * batch, width, sh["hk"], sh["d"], sh["block"], sh["cache"],
                                              device, 10 + i)
            q = torch.randn(batch, sh["hq"], sh["d"], device=device, dtype=sh["dtype"])
            lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            layers.append((q, k_cache, v_cache, tables, lens))
        capacity, sms = layers[0][3].shape[1] * sh["block"], decode._sm_count(device)
        splits = decode.plan(batch, sh["hk"], capacity, sms, sh["dtype"], decode.CONFIG)[-1]
        row = {"batch": batch, "context": context, "table_tokens": capacity, "splits": splits,
               "layers_per_graph": n_layers, "kv_bytes": kv_bytes}
        # old: the two-kernel launch as it was; two kernels now: today's configuration, merged by the second kernel.
        for name, config in (("old_us", OLD), ("two_kernels_us", dict(decode.CONFIG, one_kernel=0)),
                             ("one_kernel_us", dict(decode.CONFIG, one_kernel=1))):
            fns = [lambda a=a, c=config: decode.launch(*a, None, c) for a in layers]
            row[name] = round(graph_time(fns, device, replays), 2)
        row["one_kernel_GBps"] = round(kv_bytes / row["one_kernel_us"] / 1e3, 1)
        rows.append(row)
        print(f"decode B={batch:<4d} ctx={context:<5d} splits={splits:<3d} old {row['old_us']:8.2f} us  two kernels "
              f"{row['two_kernels_us']:8.2f} us  one kernel {row['one_kernel_us']:8.2f} us  "
              f"({row['one_kernel_GBps']:.0f} GB/s of KV)")
        del layers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# Ragged batches as the offline workload has them mid-run: (batch, shortest, longest context).
RAGGED_CASES = ((200, 400, 1900), (128, 700, 2000), (88, 900, 2000), (64, 500, 1800), (40, 700, 1800))


def _split_min(keys: int) -> dict:
    """A split regime whose splits each take at least ``keys`` keys (short contexts: fewer splits)."""
    from ninefold.ops.triton import decode

    return {"split_config": {**decode.SPLIT_CONFIG, "min_split": keys}}


RAGGED_VARIANTS = (("default", {}), ("per_sm 8", {"per_sm": 8}), ("per_sm 16", {"per_sm": 16}),
                   ("1 head/program", {"heads_per_program": 1}),
                   ("per_sm 8 min 256", {"per_sm": 8, **_split_min(256)}),
                   ("per_sm 16 min 256", {"per_sm": 16, **_split_min(256)}),
                   ("per_sm 16 min 512", {"per_sm": 16, **_split_min(512)}),
                   ("per_sm 32 min 256", {"per_sm": 32, **_split_min(256)}))


def time_ragged(sh, device, width, replays) -> list[dict]:
    """Decode attention on ragged context lengths, the rows in random order and longest first, under
    ``RAGGED_VARIANTS`` of ``decode.CONFIG``; each variant checked against float64 before it is timed."""
    from ninefold.ops.triton import decode

    cuda = device.type == "cuda"
    rows = []
    for batch, lo, hi in (RAGGED_CASES if cuda else ((5, 3, 60),)):
        g = torch.Generator().manual_seed(batch)
        lengths = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
        item = sh["cache"].itemsize
        kv_bytes = 2 * sum(lengths) * sh["hk"] * sh["d"] * item
        n_layers = _layers(kv_bytes, device)
        for order in ("random", "longest first"):
            lens_list = sorted(lengths, reverse=True) if order == "longest first" else lengths
            layers = []
            for i in range(n_layers):
                k_cache, v_cache, tables = paged_caches(lens_list, width, sh["hk"], sh["d"], sh["block"], sh["cache"],
                                                  device, 20 + i)
                q = torch.randn(batch, sh["hq"], sh["d"], device=device, dtype=sh["dtype"])
                lens = torch.tensor(lens_list, dtype=torch.int32, device=device)
                layers.append((q, k_cache, v_cache, tables, lens))
            want = decode64(*layers[0])
            for name, change in RAGGED_VARIANTS:
                config = dict(decode.CONFIG, **change)
                row = {"batch": batch, "lengths": [lo, hi], "order": order, "variant": name, "kv_bytes": kv_bytes,
                       "splits": decode.plan(batch, sh["hk"], layers[0][3].shape[1] * sh["block"],
                                             decode._sm_count(device), sh["dtype"], config)[-1]}
                try:
                    _close(decode.launch(*layers[0], None, config), want)
                except AssertionError as e:
                    row["error"] = str(e)
                    rows.append(row)
                    print(f"ragged B={batch} {order:13s} {name:15s} FAILED {e}")
                    continue
                fns = [lambda a=a, c=config: decode.launch(*a, None, c) for a in layers]
                row["us"] = round(graph_time(fns, device, replays), 2)
                row["GBps"] = round(kv_bytes / row["us"] / 1e3, 1)
                rows.append(row)
                print(f"ragged B={batch} ctx {lo}..{hi} {order:13s} {name:18s} splits={row['splits']:<3d} "
                      f"{row['us']:8.2f} us ({row['GBps']:.0f} GB/s of KV)")
            del layers
            if cuda:
                torch.cuda.empty_cache()
    return rows


def sweep_decode(sh, device, width, replays, deadline) -> dict:
    """Launch configurations of the split regime (``SWEEP_SPLIT`` at ``SPLIT_CASES``, as ``split_config``) and
    of the unsplit one (``SWEEP_UNSPLIT`` at ``UNSPLIT_CASES``), each checked against float64 first."""
    from ninefold.ops.triton import decode

    cuda = device.type == "cuda"
    check_lens = [1, 17, 1000, 300, 600] if cuda else [1, 5, 40]
    kc, vc, tb = paged_caches(check_lens, width, sh["hk"], sh["d"], sh["block"], sh["cache"], device, 3)
    qc = torch.randn(len(check_lens), sh["hq"], sh["d"], device=device, dtype=sh["dtype"])
    lc = torch.tensor(check_lens, dtype=torch.int32, device=device)
    want = decode64(qc, kc, vc, tb, lc)
    results = {}
    groups = (("split", SWEEP_SPLIT, SPLIT_CASES if cuda else sh["cases"]),
              ("unsplit", SWEEP_UNSPLIT, UNSPLIT_CASES if cuda else sh["cases"]))
    for name, candidates, cases in groups:
        # The split regime may use half of the time left; the unsplit one the rest.
        stop = time.perf_counter() + 0.5 * (deadline - time.perf_counter()) if name == "split" else deadline
        inputs = {}
        for batch, context in cases:  # as many layers as the timings use (small cases: graph overhead, L2)
            n_layers = _layers(2 * batch * context * sh["hk"] * sh["d"] * sh["cache"].itemsize, device)
            inputs[(batch, context)] = [
                (*paged_caches([context] * batch, width, sh["hk"], sh["d"], sh["block"], sh["cache"], device, 20 + i),
                 torch.randn(batch, sh["hq"], sh["d"], device=device, dtype=sh["dtype"]),
                 torch.full((batch,), context, dtype=torch.int32, device=device)) for i in range(n_layers)]
        rows = []
        for cfg in tqdm(candidates if cuda else [candidates[0], candidates[2]], desc=f"sweep {name}", file=sys.stdout,
                        disable=None):
            if time.perf_counter() > stop:
                rows.append({"config": cfg, "skipped": "time budget"})
                continue
            # Split candidates as the split_config of today's CONFIG; unsplit ones alone (no split_config).
            config = dict(decode.CONFIG, one_kernel=1, split_config=cfg) if name == "split" else \
                dict(decode.CONFIG, **cfg, one_kernel=1, split_config={})
            row = {"config": cfg}
            try:
                _close(decode.launch(qc, kc, vc, tb, lc, None, config), want)
                for (batch, context), layers in inputs.items():
                    fns = [lambda a=a, c=config: decode.launch(a[3], a[0], a[1], a[2], a[4], None, c) for a in layers]
                    row[f"B={batch} ctx={context}"] = round(graph_time(fns, device, max(5, replays // 10)), 2)
            except Exception as error:  # noqa: BLE001  (a failing config is reported, not fatal)
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            rows.append(row)
        timed = [r for r in rows if "error" not in r and "skipped" not in r]
        keys = [f"B={b} ctx={c}" for b, c in inputs]
        for key in keys:
            best = min(timed, key=lambda r: r[key], default=None)
            if best:
                print(f"sweep {name:7s} {key:16s} best {best['config']} {best[key]:.2f} us (first config "
                      f"{timed[0][key]:.2f} us)")
        if timed:
            overall = min(timed, key=lambda r: sum(r[k] / timed[0][k] for k in keys))
            print(f"sweep {name:7s} best over {', '.join(keys)} (sum of times relative to the first config): "
                  f"{overall['config']} " + ", ".join(f"{overall[k]:.2f}" for k in keys) + " us")
            results[f"best_{name}"] = overall
        results[name] = rows
        del inputs
        if cuda:
            torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------- rope + cache
def _rope_inputs(batch, sh, device, seed):
    g = torch.Generator().manual_seed(seed)
    hq, hk, d, dt = sh["hq"], sh["hk"], sh["d"], sh["dtype"]
    qkv = torch.randn(batch, (hq + 2 * hk) * d, generator=g).to(device, dt)  # a fused projection's rows
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(batch, hq, d), k.view(batch, hk, d), v.view(batch, hk, d)
    positions = torch.randint(0, 4096, (batch,), generator=g).to(device)
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * inv[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1).float().to(device)
    blocks = batch * 2 + 8
    slots = torch.randperm(blocks * sh["block"], generator=g)[:batch].to(device)
    k_cache = torch.zeros(blocks, sh["block"], hk, d, device=device, dtype=sh["cache"])
    v_cache = torch.zeros_like(k_cache)
    return q, k, v, positions, cos_sin, k_cache, v_cache, slots


def _unfused(q, k, v, positions, cos_sin, k_cache, v_cache, slots):
    from ninefold.ops.triton import cache, rope

    q2, k2 = rope.rope(q, k, positions, cos_sin, True)
    cache.reshape_and_cache(k2, v, k_cache, v_cache, slots)
    return q2, k2


def _fused(q, k, v, positions, cos_sin, k_cache, v_cache, slots):
    from ninefold.ops.triton import rope_cache

    return rope_cache.rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slots, True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal caches (FP8 codes compared as bytes)."""
    return torch.equal(as_bytes(a), as_bytes(b))


def check_rope(sh, device) -> list[dict]:
    rows = []
    for batch in sh["rope"]:
        a = _rope_inputs(batch, sh, device, 5)
        b = _rope_inputs(batch, sh, device, 5)
        row = {"check": f"rope_and_cache B={batch} bit-equal to rope + reshape_and_cache"}
        try:
            q1, k1 = _unfused(*a)
            q2, k2 = _fused(*b)
            if not (torch.equal(q1, q2) and torch.equal(k1, k2) and _same(a[5], b[5]) and _same(a[6], b[6])):
                raise AssertionError("fused results differ from the unfused kernels")
            if device.type == "cuda":
                c = _rope_inputs(batch, sh, device, 5)
                qo, ko = torch.empty_like(q1), torch.empty_like(k1)
                _fused(*c)
                torch.cuda.synchronize()
                as_bytes(c[5]).zero_()
                as_bytes(c[6]).zero_()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    q3, k3 = _fused(*c)
                    qo.copy_(q3)
                    ko.copy_(k3)
                graph.replay()
                torch.cuda.synchronize()
                if not (torch.equal(qo, q1) and torch.equal(ko, k1) and _same(c[5], a[5]) and _same(c[6], a[6])):
                    raise AssertionError("fused results in a CUDA graph differ")
            row["ok"] = True
        except Exception as error:  # noqa: BLE001
            row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:300]}")
        rows.append(row)
    return rows


def time_rope(sh, device, replays) -> list[dict]:
    rows = []
    for batch in sh["rope"]:
        layers = [_rope_inputs(batch, sh, device, 30 + i) for i in range(32 if device.type == "cuda" else 2)]
        row = {"batch": batch, "layers_per_graph": len(layers)}
        row["rope_plus_cache_us"] = round(graph_time([lambda a=a: _unfused(*a) for a in layers], device, replays), 2)
        row["fused_us"] = round(graph_time([lambda a=a: _fused(*a) for a in layers], device, replays), 2)
        rows.append(row)
        print(f"rope+cache B={batch:<4d} rope + reshape_and_cache {row['rope_plus_cache_us']:8.2f} us  "
              f"rope_and_cache {row['fused_us']:8.2f} us")
    return rows


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sh = _shapes(device, args.kv_cache_dtype)
    import triton

    from ninefold.ops.triton import decode

    start = time.perf_counter()
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "triton": triton.__version__, "dtype": str(sh["dtype"]),
               "kv_cache_dtype": str(sh["cache"]),
               "heads": [sh["hq"], sh["hk"], sh["d"]], "block_size": sh["block"], "table_tokens": args.width,
               "command": "python -m ninefold.bench.decode_attention " + " ".join(args.argv)}
    print(f"ninefold.bench.decode_attention on {results['device']}, torch {torch.__version__}, triton "
          f"{triton.__version__}, heads {sh['hq']}/{sh['hk']}x{sh['d']} {sh['dtype']}, "
          f"KV cache {sh['cache']}")
    if args.ragged_only:
        results["ragged"] = time_ragged(sh, device, args.width, args.replays)
        results["failed_checks"] = sum("error" in r for r in results["ragged"])
        return results
    results["checks"] = check_decode(sh, device, args.width) + check_rope(sh, device)
    for row in results["checks"]:
        print(f"check {row['check']:80s} " + ("ok" if row["ok"] else "FAILED " + row["error"]))
    failed = sum(not r["ok"] for r in results["checks"])
    results["decode"] = time_decode(sh, device, args.width, args.replays)
    results["rope_and_cache"] = time_rope(sh, device, args.replays)
    results["ragged"] = time_ragged(sh, device, args.width, args.replays)
    failed += sum("error" in r for r in results["ragged"])
    if args.sweep:
        results["sweep"] = sweep_decode(sh, device, args.width, args.replays, start + args.budget)
    print("\n| case | old (us) | two kernels now (us) | one kernel (us) | splits |\n|---|---|---|---|---|")
    for r in results["decode"]:
        print(f"| decode B={r['batch']} ctx={r['context']} | {r['old_us']:.2f} | {r['two_kernels_us']:.2f} | "
              f"{r['one_kernel_us']:.2f} | {r['splits']} |")
    for r in results["rope_and_cache"]:
        print(f"| rope+cache B={r['batch']} | {r['rope_plus_cache_us']:.2f} (rope + reshape_and_cache) | | "
              f"{r['fused_us']:.2f} (rope_and_cache) | |")
    print(f"decode CONFIG: {decode.CONFIG}")
    results["config"] = dict(decode.CONFIG)
    results["failed_checks"] = failed
    results["seconds"] = round(time.perf_counter() - start, 1)
    print(f"done in {results['seconds']} s; {failed} failed checks")
    return results


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.decode_attention",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="cuda (default when present) or cpu (Triton through TRITON_INTERPRET=1)")
    parser.add_argument("--width", type=int, help="block-table width in tokens (default: the CUDA graphs' 17408 of "
                        "the LLM bench; 128 on the CPU)")
    parser.add_argument("--replays", type=int, default=200, help="graph replays per timing (best of 3)")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds after which the sweep starts no config")
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None,
                        help="sweep one-kernel launch configurations at the largest batch (default: on CUDA)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the caches' dtype: the queries' (auto) or float8_e4m3fn codes (fp8), as the engine's")
    parser.add_argument("--ragged-only", action="store_true", help="only the ragged-length timings")
    args = parser.parse_args(argv)
    args.argv = argv
    on_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    args.sweep = on_cuda if args.sweep is None else args.sweep
    args.width = args.width or (17408 if on_cuda else 128)
    results = run(args)
    write_json("decode_attention.json", results, default=str, announce=True)
    return 1 if results["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
