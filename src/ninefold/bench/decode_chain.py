"""Batch-1 decode chain of Llama-3.1-8B shapes: cuBLAS vs Triton GEMV, PDL and fused prologues.

``OUT=DIR python -m ninefold.bench.decode_chain`` builds, on one CUDA device, the 32-layer batch-1
decode step of the 8B shapes (hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336, vocab
128256) with random bfloat16 weights and a KV cache at context 256, and times it as a CUDA graph
replayed ``--iters`` times (device time per token from CUDA events) in these variants:

- ``cublas``: the current path: ``ops.linear`` (cuBLAS at one row) plus ``ops.add_rms_norm`` and
  ``ops.silu_and_mul``;
- ``gemv``: the batch-1 Triton GEMV of ``ninefold.ops.triton.gemv_pdl`` instead of the linears;
- ``gemv_pdl``: the same launched with programmatic dependent launch (weights loaded before
  ``gdc_wait``);
- ``fused``: the GEMV with the residual add + RMSNorm in qkv's, gate_up's and lm_head's prologues and
  silu*mul in down's (no separate norm/activation kernels), no PDL;
- ``fused_pdl``: ``fused`` launched with PDL;
- ``mixed``, ``mixed_pdl``: ``fused``/``fused_pdl`` except that the GEMMs where the sweep found
  cuBLAS faster than the best GEMV stay on ``ops.linear`` with the separate norm/activation ops
  (``--smoke``/``--no-tune``: gate_up and down);
- ``ops``, ``ops_pdl``: what the engine's model calls at one row (``ops.add_rms_norm_linear``,
  ``ops.silu_and_mul_linear``, ``ops.linear`` through dispatch, shipped launch table), with
  ``NINEFOLD_GEMV_PDL`` 0 / 1.

``cublas``, ``gemv*``, ``fused*`` and ``mixed*`` pin ``ops.linear`` to cuBLAS (``vendor``) where they use it.

rope, the cache write and ``ops.attention_decode`` are the same ninefold ops in every variant. Each
variant's logits and final residual stream are first compared with ``cublas``'s (cosine >= 0.995),
eagerly and after the graph replays, then timed (and profiled per kernel); the table gives ms per
token, tok/s and the share of the roofline (weight + KV bytes over the copy bandwidth, measured
in-process with a 2 GiB device copy). Before the chain, each GEMM shape
picks its GEMV launch configuration (tile, split-K, warps) from a short sweep (a graph of 20
back-to-back calls per candidate). Results: ``$OUT/decode_chain.json``.

``--smoke`` runs tiny shapes on the CPU (kernels in the Triton interpreter, no PDL, no graphs) so tests
can exercise every code path. Exit status 1 when a variant disagrees with ``cublas``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

FULL = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, layers=32,
            context=256, block_size=16)
SMOKE = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=512, layers=2,
             context=16, block_size=16)
VARIANTS = ("cublas", "gemv", "gemv_pdl", "fused", "fused_pdl", "mixed", "mixed_pdl", "ops", "ops_pdl")
# (block_n, block_k, split_k, num_warps, num_stages, variant): variant 1 runs tl.dot on the row padded
# to 16 (Triton pipelines its loads over num_stages), 0 register double-buffered multiply-adds, 2 the
# same with two tiles in flight (ring of three).
CANDIDATES = [(32, 256, 1, 4, 2, 0), (16, 256, 1, 4, 2, 0), (16, 512, 1, 4, 2, 0), (64, 128, 1, 4, 2, 0),
              (64, 256, 1, 8, 2, 0), (32, 256, 2, 4, 2, 0), (16, 256, 2, 4, 2, 0), (32, 256, 4, 4, 2, 0),
              (32, 128, 1, 4, 4, 1), (32, 256, 1, 4, 3, 1), (64, 128, 1, 4, 4, 1), (16, 256, 1, 4, 4, 1),
              (32, 512, 1, 4, 3, 1), (32, 128, 2, 4, 4, 1), (32, 128, 4, 4, 4, 1), (64, 256, 1, 8, 3, 1),
              (16, 256, 1, 4, 2, 2), (32, 256, 1, 4, 2, 2), (16, 512, 1, 4, 2, 2), (32, 256, 2, 4, 2, 2)]
SMOKE_CONFIG = (16, 64, 2, 4, 2, 0)  # the interpreter's bf16 tl.dot is wrong in Triton 3.9
COS_MIN = 0.995
GEMMS = ("qkv", "o", "gate_up", "down", "lm_head")
# The prologue each GEMM runs with in the fused variants (o has none).
FUSED_PROLOGUES = {"qkv": "add_rms_norm", "gate_up": "add_rms_norm", "down": "silu_and_mul", "lm_head": "add_rms_norm"}


class Model:
    """Random bf16 weights and a filled KV cache of the given shapes."""

    def __init__(self, s: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        d, hd = s["hidden"], s["head_dim"]
        qkv = (s["heads"] + 2 * s["kv_heads"]) * hd

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)

        self.s = s
        self.layers = []
        for _ in range(s["layers"]):
            self.layers.append(dict(
                qkv=rand(qkv, d, scale=d ** -0.5), o=rand(d, s["heads"] * hd, scale=(s["heads"] * hd) ** -0.5),
                gate_up=rand(2 * s["intermediate"], d, scale=d ** -0.5),
                down=rand(d, s["intermediate"], scale=s["intermediate"] ** -0.5),
                norm1=1.0 + rand(d, scale=0.1), norm2=1.0 + rand(d, scale=0.1)))
        self.final_norm = 1.0 + rand(d, scale=0.1)
        self.lm_head = rand(s["vocab"], d, scale=d ** -0.5)
        blocks = math.ceil(s["context"] / s["block_size"])
        self.caches = [(rand(blocks, s["block_size"], s["kv_heads"], hd), rand(blocks, s["block_size"], s["kv_heads"], hd))
                       for _ in range(s["layers"])]
        pos = s["context"] - 1
        self.positions = torch.tensor([pos], device=device, dtype=torch.int64)
        self.slots = torch.tensor([pos], device=device, dtype=torch.int64)
        self.block_tables = torch.arange(blocks, device=device, dtype=torch.int32)[None]
        self.context_lens = torch.tensor([s["context"]], device=device, dtype=torch.int32)
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        freqs = torch.outer(torch.arange(s["context"], dtype=torch.float32), inv)
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(device)
        self.h0 = rand(d)
        self.res0 = torch.zeros(d, device=device, dtype=dtype)

    def weight_bytes(self) -> int:
        total = sum(t.nbytes for layer in self.layers for t in layer.values())
        return total + self.final_norm.nbytes + self.lm_head.nbytes

    def kv_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)

    def attention(self, i: int, qkv: torch.Tensor) -> torch.Tensor:
        from ninefold import ops

        s = self.s
        hd, q_size, kv_size = s["head_dim"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
        q, k, v = qkv.reshape(1, -1).split([q_size, kv_size, kv_size], dim=-1)
        q, k = ops.rope(q.reshape(1, s["heads"], hd), k.reshape(1, s["kv_heads"], hd), self.positions, self.cos_sin)
        kc, vc = self.caches[i]
        ops.reshape_and_cache(k, v.reshape(1, s["kv_heads"], hd), kc, vc, self.slots)
        o = ops.attention_decode(q, kc, vc, self.block_tables, self.context_lens, scale=hd ** -0.5)
        return o.reshape(-1)


def step_cublas(m: Model, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step through ``ops.linear`` and the separate norm/activation ops: (logits, final residual)."""
    from ninefold import ops

    h, res = m.h0[None], m.res0[None]
    for i, w in enumerate(m.layers):
        x, res = ops.add_rms_norm(h, res, w["norm1"], eps)
        a = m.attention(i, ops.linear(x, w["qkv"]))
        x, res = ops.add_rms_norm(ops.linear(a[None], w["o"]), res, w["norm2"], eps)
        h = ops.linear(ops.silu_and_mul(ops.linear(x, w["gate_up"])), w["down"])
    x, res = ops.add_rms_norm(h, res, m.final_norm, eps)
    return ops.linear(x, m.lm_head)[0], res[0]


def step_gemv(m: Model, cfgs: dict, *, pdl: bool, fused: bool, vendor=frozenset(), eps: float = 1e-5):
    """One decode step with the batch-1 Triton GEMV (``fused``: norms and activation in prologues;
    GEMMs named in ``vendor`` stay on ``ops.linear`` with the separate norm/activation ops)."""
    from ninefold import ops
    from ninefold.ops.triton.gemv_pdl import gemv_pdl

    def lin(x, w, name, **kw):
        if name in vendor:
            return ops.linear(x[None], w)[0]
        bn, bk, sk, nw, ns, dot = cfgs[name]
        return gemv_pdl(x, w, split_k=sk, pdl=pdl, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns,
                        dot=dot == 1, depth=2 if dot == 2 else 1, **kw)

    def norm_lin(h, res, g, w, name):
        if fused and name not in vendor:
            res_new = torch.empty_like(res)
            return lin(h, w, name, prologue="add_rms_norm", residual=res, norm_weight=g, eps=eps,
                       residual_out=res_new), res_new
        x, res = ops.add_rms_norm(h[None], res[None], g, eps)
        return lin(x[0], w, name), res[0]

    def act_lin(gu, w, name):
        if fused and name not in vendor:
            return lin(gu, w, name, prologue="silu_and_mul")
        return lin(ops.silu_and_mul(gu[None])[0], w, name)

    h, res = m.h0, m.res0
    for i, w in enumerate(m.layers):
        qkv, res = norm_lin(h, res, w["norm1"], w["qkv"], "qkv")
        o = lin(m.attention(i, qkv), w["o"], "o")
        gu, res = norm_lin(o, res, w["norm2"], w["gate_up"], "gate_up")
        h = act_lin(gu, w["down"], "down")
    return norm_lin(h, res, m.final_norm, m.lm_head, "lm_head")


def step_ops(m: Model, pdl: bool, eps: float = 1e-5):
    """One decode step through the operator API the engine's model calls at one row:
    ``ops.add_rms_norm_linear``, ``ops.silu_and_mul_linear`` and ``ops.linear`` (dispatch picks the
    one-row GEMV where it applies); ``pdl`` sets ``NINEFOLD_GEMV_PDL`` for the call."""
    from ninefold import ops

    saved = os.environ.get("NINEFOLD_GEMV_PDL")
    os.environ["NINEFOLD_GEMV_PDL"] = "1" if pdl else "0"
    try:
        h, res = m.h0[None], m.res0[None]
        for i, w in enumerate(m.layers):
            qkv, res = ops.add_rms_norm_linear(h, res, w["norm1"], w["qkv"], eps)
            o = ops.linear(m.attention(i, qkv[0])[None], w["o"])
            gu, res = ops.add_rms_norm_linear(o, res, w["norm2"], w["gate_up"], eps)
            h = ops.silu_and_mul_linear(gu, w["down"])
        x, res = ops.add_rms_norm(h, res, m.final_norm, eps)
        return ops.linear(x, m.lm_head)[0], res[0]
    finally:
        if saved is None:
            os.environ.pop("NINEFOLD_GEMV_PDL", None)
        else:
            os.environ["NINEFOLD_GEMV_PDL"] = saved


def step_fn(m: Model, variant: str, cfgs: dict, vendor=frozenset()):
    """The step function of ``variant`` (``vendor``: the GEMMs ``mixed*`` variants leave on cuBLAS).
    Every variant but ``ops*`` pins ``ops.linear`` to cuBLAS (``vendor``), the path before the one-row GEMV."""
    from ninefold import ops

    if variant.startswith("ops"):
        return lambda: step_ops(m, pdl=variant.endswith("_pdl"))

    def run():
        with ops.use(linear="vendor"):
            if variant == "cublas":
                return step_cublas(m)
            return step_gemv(m, cfgs, pdl=variant.endswith("_pdl"), fused=not variant.startswith("gemv"),
                             vendor=vendor if variant.startswith("mixed") else frozenset())
    return run


def recommend_pdl(variants: dict) -> int:
    """1 when a PDL variant was correct and >= 0.5% faster than its plain twin (``ops_pdl`` vs ``ops``,
    else ``fused_pdl`` vs ``fused``), else 0."""
    for plain, pdl in (("ops", "ops_pdl"), ("fused", "fused_pdl")):
        a, b = variants.get(plain, {}), variants.get(pdl, {})
        ms_a, ms_b = a.get("ms_per_token"), b.get("ms_per_token")
        if ms_a == ms_a and ms_b == ms_b and ms_a and ms_b and a.get("ok") and b.get("ok"):
            return int(ms_b < 0.995 * ms_a)
    return 0


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def graph_time(fn, iters: int) -> tuple[float, str | None, object]:
    """Device ms per call of ``fn`` replayed as a CUDA graph, the error (capture failed: ms is nan)
    and what the captured call returned (its buffers hold the last replay's results)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as error:  # reported per variant; the others still run
        torch.cuda.synchronize()
        return float("nan"), f"graph capture failed: {error!r}"[:800], None
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters, None, out


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes/s of a ``gib`` GiB device-to-device copy (read + write counted)."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / best


def _tuning_inputs(w: torch.Tensor, prologue: str, eps: float = 1e-5, rows: int | None = None) -> tuple[dict, torch.Tensor]:
    """Keyword arguments of a GEMV call with ``prologue`` for weight ``w`` and the float activations
    the GEMV should see (the prologue applied in torch, rounded like the model): one row ``[K]`` for
    ``gemv_pdl``, or ``[rows, K]`` for ``gemv_rows`` when ``rows`` is given."""
    k, dt, dev = w.shape[1], w.dtype, w.device
    lead = () if rows is None else (rows,)
    if prologue == "add_rms_norm":
        x, r = (torch.randn(*lead, k, device=dev).to(dt) for _ in range(2))
        g = torch.randn(k, device=dev).to(dt)
        s = (x.float() + r.float()).to(dt).float()
        xin = ((s * torch.rsqrt((s * s).mean(-1, keepdim=True) + eps)).to(dt).float() * g.float()).to(dt).float()
        return dict(x=x, prologue=prologue, residual=r, norm_weight=g, eps=eps,
                    residual_out=torch.empty_like(r)), xin
    if prologue == "silu_and_mul":
        a = torch.randn(*lead, 2 * k, device=dev).to(dt)
        xin = (torch.nn.functional.silu(a[..., :k].float()).to(dt).float() * a[..., k:].float()).to(dt).float()
        return dict(x=a, prologue=prologue), xin
    x = torch.randn(*lead, k, device=dev).to(dt)
    return dict(x=x), x.float()


def tune(m: Model, pdl: bool, prologues: dict, calls: int = 20, budget_s: float = 20.0) -> tuple[dict, list]:
    """The fastest GEMV candidate per GEMM (``prologues``: name -> prologue it runs with) from graphs
    of ``calls`` back-to-back calls, cycling through the layers' weights so that L2 does not serve
    them; with PDL when ``pdl`` (falling back to plain launches for a shape where no PDL graph
    worked). Plain GEMMs are also timed with cuBLAS (``torch.nn.functional.linear``). Past
    ``budget_s`` seconds on one shape, it keeps the best of the candidates tried so far."""
    from ninefold.ops.triton.gemv_pdl import gemv_pdl

    chosen, rows = {}, []
    for name, prologue in prologues.items():
        # Back-to-back calls cycle through the layers' copies: one weight reread from L2 is not a decode step.
        ws = [m.lm_head] if name == "lm_head" else [layer[name] for layer in m.layers]
        w = ws[0]
        kwargs, xin = _tuning_inputs(w, prologue)
        ref = w.float() @ xin
        tag = name if prologue == "none" else f"{name}+{prologue}"
        cublas_us = None
        if prologue == "none":
            x = kwargs["x"]
            cublas_ms, _, _ = graph_time(lambda x=x, ws=ws: [torch.nn.functional.linear(x[None], ws[i % len(ws)])
                                                             for i in range(calls)], 5)
            cublas_us = cublas_ms * 1e3 / calls
            rows.append(dict(shape=name, prologue=prologue, config="cublas", us=cublas_us))
        best = None
        deadline = time.perf_counter() + budget_s
        for use_pdl in dict.fromkeys((pdl, False)):
            for cand in CANDIDATES:
                bn, bk, sk, nw, ns, dot = cand
                if w.shape[1] % (bk * sk) or (best is not None and time.perf_counter() > deadline):
                    continue

                def once(w=w, bn=bn, bk=bk, sk=sk, nw=nw, ns=ns, dot=dot, use_pdl=use_pdl, kwargs=kwargs):
                    return gemv_pdl(weight=w, split_k=sk, pdl=use_pdl, block_n=bn, block_k=bk, num_warps=nw,
                                    num_stages=ns, dot=dot == 1, depth=2 if dot == 2 else 1, **kwargs)

                def fn(once=once, ws=ws):
                    for i in range(calls):
                        once(w=ws[i % len(ws)])
                try:
                    y = once()
                    err = float((y.float() - ref).abs().max() / ref.abs().max())
                    ms, error, _ = graph_time(fn, 5)
                except Exception as e:  # a candidate that does not compile or launch is skipped
                    err, ms, error = float("nan"), float("nan"), repr(e)[:500]
                us = ms * 1e3 / calls
                rows.append(dict(shape=name, prologue=prologue, config=list(cand), pdl=use_pdl, us=us, rel_err=err,
                                 error=error))
                if error is None and err < 2e-2 and (best is None or us < best[0]):
                    best = (us, cand)
            if best is not None:
                break
            print(f"  {tag}: no candidate worked with PDL={use_pdl}: {rows[-1]}", flush=True)
        if best is None:
            raise RuntimeError(f"no GEMV candidate worked for {tag} {tuple(w.shape)}: {rows[-1]}")
        chosen[name] = best[1]
        gbps = w.nbytes / (best[0] * 1e-6) / 1e9
        plain = ""
        if pdl and use_pdl:  # the same configuration without PDL: what PDL itself buys back to back
            bn, bk, sk, nw, ns, dot = best[1]
            ms, error, _ = graph_time(lambda ws=ws, bn=bn, bk=bk, sk=sk, nw=nw, ns=ns, dot=dot, kwargs=kwargs: [
                gemv_pdl(weight=ws[i % len(ws)], split_k=sk, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns,
                         dot=dot == 1, depth=2 if dot == 2 else 1, **kwargs) for i in range(calls)], 5)
            rows.append(dict(shape=name, prologue=prologue, config=list(best[1]), pdl=False, us=ms * 1e3 / calls,
                             error=error))
            plain = f"; same without PDL {ms * 1e3 / calls:.1f} us"
        vendor = "" if cublas_us is None else (f"; cuBLAS {cublas_us:.1f} us "
                                              f"({w.nbytes / (cublas_us * 1e-6) / 1e9:.0f} GB/s)")
        print(f"  {tag:21s} {tuple(w.shape)}: best {best[1]} {best[0]:.1f} us ({gbps:.0f} GB/s){plain}{vendor}",
              flush=True)
    return chosen, rows


def pdl_graph_probe(device: torch.device) -> str | None:
    """``None`` when two PDL-launched GEMVs captured in a CUDA graph replay to the eager result,
    else what went wrong."""
    from ninefold.ops.triton.gemv_pdl import gemv_pdl

    try:
        w1 = torch.randn(512, 1024, device=device, dtype=torch.bfloat16)
        w2 = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
        x = torch.randn(1024, device=device, dtype=torch.bfloat16)

        def fn():
            a = gemv_pdl(x, w1, pdl=True, split_k=2, block_k=256)
            return gemv_pdl(a, w2, prologue="silu_and_mul", pdl=True, split_k=2, block_k=128)
        want = fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fn()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        return None if torch.equal(got, want) else "graph replay differs from the eager result"
    except Exception as error:
        torch.cuda.synchronize()
        return f"{error!r}"[:800]


def launch_table(m: Model, cfgs: dict, fused_cfgs: dict) -> list[dict]:
    """The sweep's picks as ``gemv_pdl_ops`` launch-table entries (``NINEFOLD_GEMV_TABLE`` format)."""
    shapes = {name: tuple((m.lm_head if name == "lm_head" else m.layers[0][name]).shape) for name in GEMMS}
    table = [dict(n=shapes[name], k=None, prologue="none", config=list(cfg)) for name, cfg in cfgs.items()]
    table += [dict(n=shapes[name], k=None, prologue=prologue, config=list(fused_cfgs[name]))
              for name, prologue in FUSED_PROLOGUES.items()]
    for entry in table:
        entry["n"], entry["k"] = entry["n"]
    return table


def vendor_faster(rows: list, cfgs: dict) -> frozenset:
    """The GEMM shapes whose cuBLAS time in the sweep beat the chosen GEMV configuration's."""
    found = set()
    for name, cand in cfgs.items():
        cublas = [r["us"] for r in rows if r["shape"] == name and r["config"] == "cublas"]
        mine = [r["us"] for r in rows if r["shape"] == name and r["config"] == list(cand) and r.get("error") is None]
        if cublas and mine and cublas[0] < min(mine):
            found.add(name)
    return frozenset(found)


def profile(fn, replays: int = 5) -> dict | None:
    """Kernel device time per replay of ``fn``'s CUDA graph by kernel name (``None`` if tracing fails)."""
    try:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        found = {}
        for ev in prof.key_averages():
            total = getattr(ev, "device_time_total", None)
            if total is None:
                total = getattr(ev, "cuda_time_total", 0)
            if total > 0 and ev.count:
                found[ev.key[:80]] = dict(us_per_token=total / replays, calls_per_token=ev.count / replays)
        return dict(sorted(found.items(), key=lambda kv: -kv[1]["us_per_token"]))
    except Exception as error:  # the profile is extra information; timing stands without it
        return {"error": repr(error)[:500]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ninefold.bench.decode_chain", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter), no timing")
    p.add_argument("--iters", type=int, default=200, help="graph replays timed per variant (default 200)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; smoke 2)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--no-tune", action="store_true", help="skip the per-shape GEMV sweep (first candidate)")
    p.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile of each variant's graph")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    shapes = dict(SMOKE if args.smoke else FULL)
    if args.layers is not None:
        if args.layers < 1:
            p.error(f"--layers must be >= 1, got {args.layers}")
        shapes["layers"] = args.layers
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("decode_chain needs a CUDA device (or --smoke); nothing measured.", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    from ninefold.ops.triton.gemv_pdl import pdl_api, pdl_available

    t0 = time.perf_counter()
    dtype = torch.bfloat16
    result = dict(shapes=shapes, device=str(device), torch=torch.__version__, variants={})
    import triton
    result["triton"] = triton.__version__
    result["pdl_api"] = pdl_api()
    pdl_ok = pdl_available(device) if device.type == "cuda" else False
    result["pdl_available"] = pdl_ok
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
        bw = copy_bandwidth(device)
        result["copy_GBps"] = bw / 1e9
        print(f"{result['gpu']}, torch {torch.__version__}, Triton {triton.__version__}, PDL "
              f"{'available' if pdl_ok else 'NOT available'}; copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    if pdl_ok:
        problem = pdl_graph_probe(device)
        result["pdl_graph_capture"] = problem or "ok"
        print(f"PDL launches in a captured CUDA graph: {problem or 'ok (replay equals eager)'}", flush=True)
        if problem:
            pdl_ok = False
    model = Model(shapes, device, dtype)
    result["weight_bytes"] = model.weight_bytes()
    result["kv_bytes"] = model.kv_bytes()
    if args.smoke or args.no_tune:
        cfg = SMOKE_CONFIG if args.smoke else CANDIDATES[0]
        cfgs = dict.fromkeys(GEMMS, cfg)
        fused_cfgs = dict(cfgs)
        vendor = frozenset({"gate_up", "down"})
    else:
        print("GEMV launch configurations (graph of 20 back-to-back calls" + (", PDL)" if pdl_ok else ")"), flush=True)
        cfgs, rows = tune(model, pdl_ok, dict.fromkeys(GEMMS, "none"))
        vendor = vendor_faster(rows, cfgs)
        fused_cfgs, fused_rows = tune(model, pdl_ok, FUSED_PROLOGUES)
        fused_cfgs["o"] = cfgs["o"]
        result["tuning"] = rows + fused_rows
    result["mixed_on_cublas"] = sorted(vendor)
    result["configs"] = {k: list(v) for k, v in cfgs.items()}
    result["fused_configs"] = {k: list(v) for k, v in fused_cfgs.items()}
    result["gemv_table"] = launch_table(model, cfgs, fused_cfgs)
    from ninefold.ops.triton import gemv_pdl_ops

    gemv_pdl_ops.OVERRIDE.update({(e["n"], e["k"], e["prologue"]): tuple(e["config"]) for e in result["gemv_table"]})
    failed = False
    ref_logits, ref_hidden = step_fn(model, "cublas", cfgs)()
    for variant in args.variants:
        entry = result["variants"].setdefault(variant, {})
        if variant.endswith("_pdl") and not pdl_ok:
            entry["skipped"] = ("PDL not available (needs Triton's launch_pdl, sm_90+, no interpreter, and "
                                "PDL launches that survive CUDA-graph capture)")
            print(f"{variant:10s} skipped: {entry['skipped']}", flush=True)
            continue
        fn = step_fn(model, variant, fused_cfgs if variant.startswith(("fused", "mixed")) else cfgs, vendor)
        try:
            logits, hidden = fn()
        except Exception as error:  # e.g. a Triton without launch_pdl: reported, the others still run
            entry.update(ok=False, error=f"eager run failed: {error!r}"[:800])
            failed = True
            print(f"{variant:10s} {entry['error']}", flush=True)
            continue
        entry["cos_logits"] = cosine(logits, ref_logits)
        entry["cos_hidden"] = cosine(hidden, ref_hidden)
        entry["max_rel_logits"] = float((logits.float() - ref_logits.float()).abs().max()
                                        / ref_logits.float().abs().max())
        entry["ok"] = entry["cos_logits"] >= COS_MIN and entry["cos_hidden"] >= COS_MIN
        failed |= not entry["ok"]
        if device.type == "cuda":
            ms, error, graph_out = graph_time(fn, args.iters)
            entry["ms_per_token"] = ms
            if graph_out is not None:
                entry["cos_logits_graph"] = cosine(graph_out[0], ref_logits)
                entry["ok"] &= entry["cos_logits_graph"] >= COS_MIN
                failed |= not entry["ok"]
            if error:
                entry["error"] = error
                print(f"{variant:10s} {error}", flush=True)
            elif not args.no_profile:
                entry["kernels"] = prof = profile(fn)
                if prof and "error" not in prof:
                    total = sum(v["us_per_token"] for v in prof.values())
                    count = sum(v["calls_per_token"] for v in prof.values())
                    top = ", ".join(f"{k[:40]} {v['us_per_token']:.0f}" for k, v in list(prof.items())[:5])
                    print(f"{variant:10s} profile: {count:.0f} kernels, {total / 1e3:.3f} ms of kernel time per "
                          f"token; top (us): {top}", flush=True)
                else:
                    print(f"{variant:10s} profile failed: {prof}", flush=True)
        graph_cos = f" (graph {entry['cos_logits_graph']:.5f})" if "cos_logits_graph" in entry else ""
        print(f"{variant:10s} check vs cublas: cos(logits) {entry['cos_logits']:.5f}{graph_cos} cos(residual) "
              f"{entry['cos_hidden']:.5f} max rel {entry['max_rel_logits']:.4f} {'ok' if entry['ok'] else 'FAILED'}",
              flush=True)
    if device.type == "cuda":
        roof_ms = (result["weight_bytes"] + result["kv_bytes"]) / (result["copy_GBps"] * 1e9) * 1e3
        result["roofline_ms"] = roof_ms
        base = result["variants"].get("cublas", {}).get("ms_per_token")
        print(f"\nbatch-1 decode, {shapes['layers']} layers, context {shapes['context']}: weights "
              f"{result['weight_bytes'] / 1e9:.2f} GB + KV {result['kv_bytes'] / 1e6:.1f} MB, roofline {roof_ms:.3f} ms")
        print(f"{'variant':10s} {'ms/token':>9s} {'tok/s':>8s} {'roofline':>9s} {'vs cublas':>9s}")
        for variant, e in result["variants"].items():
            ms = e.get("ms_per_token")
            if ms is None or ms != ms:
                print(f"{variant:10s} {'-':>9s}  {e.get('skipped') or e.get('error', '')}")
                continue
            e["tok_per_s"] = 1e3 / ms
            e["roofline_fraction"] = roof_ms / ms
            speed = f"{base / ms:.3f}x" if base else "-"
            print(f"{variant:10s} {ms:9.3f} {1e3 / ms:8.1f} {100 * roof_ms / ms:8.1f}% {speed:>9s}")
        print("launch configurations (block_n, block_k, split_k, warps, stages, dot) by (N, K): "
              + ", ".join(f"{tuple(model.layers[0][k].shape if k != 'lm_head' else model.lm_head.shape)}: "
                          f"{tuple(v)}" for k, v in cfgs.items()))
    result["recommend_NINEFOLD_GEMV_PDL"] = recommend_pdl(result["variants"])
    result["seconds"] = time.perf_counter() - t0
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "decode_chain.json"), "w") as f:
            json.dump(result, f, indent=1)
        table_path = os.path.abspath(os.path.join(out, "gemv_table.json"))
        with open(table_path, "w") as f:
            json.dump(result["gemv_table"], f, indent=1)
        with open(os.path.join(out, "gemv_pdl.env"), "w") as f:
            f.write(f"NINEFOLD_GEMV_PDL={result['recommend_NINEFOLD_GEMV_PDL']}\n")
            if not args.smoke:
                f.write(f"NINEFOLD_GEMV_TABLE={table_path}\n")
    print(f"NINEFOLD_GEMV_PDL={result['recommend_NINEFOLD_GEMV_PDL']} recommended (1 when the PDL chain was "
          f"correct and at least 0.5% faster than the same chain without PDL)")
    print(f"total {result['seconds']:.1f} s" + ("; a variant disagreed with cublas" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
