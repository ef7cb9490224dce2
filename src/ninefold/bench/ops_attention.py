"""Attention operators on one GPU: correctness first, then every implementation, torch SDPA on
contiguous tensors, and a sweep of the Triton kernels' launch configurations.

    OUT=DIR python -m ninefold.bench.ops_attention            # H200: Llama-3-8B heads, bfloat16, < 3 min
    TRITON_INTERPRET=1 python -m ninefold.bench.ops_attention --device cpu --shapes tiny   # plumbing check

1. Correctness: every registered implementation of ``attention_decode`` / ``attention_prefill``
   (and every swept launch configuration before it is timed) against a float64 evaluation of the
   same call written here (dense masks over gathered keys), ragged lengths, GQA, a paged prefix.
2. Ceilings measured in this process: device copy bandwidth (1 GiB) and a bf16 8192^3 matmul.
3. Timings (median over calls, each after an L2 flush, CUDA events; "triton(no flush)" is a lone
   call without it, host launch included): decode at B in {1, 16, 64}
   x 4096 and B=8 x 32768 (GB/s over the KV bytes read, % of copy bandwidth); prefill at B=1 L in
   {4096, 16384}, B=4 L=1024, B=2 x 512 new over 3584 cached (causal TFLOP/s, % of the matmul
   rate); torch SDPA per backend (FLASH, CUDNN, EFFICIENT) on contiguous [B, H, L, D] tensors.
4. Sweep: Triton launch configurations on the largest calls, each checked for correctness first.

Prints one line per measurement and writes ``$OUT/ops_attention.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

import torch
from tqdm import tqdm

from ninefold.bench.results import write_json
from ninefold.ops import dispatch, registry, workloads

DECODE_CASES = ((1, 4096), (16, 4096), (64, 4096), (8, 32768))
PREFILL_CASES = ((1, 4096, 0), (1, 16384, 0), (4, 1024, 0), (2, 512, 3584))
# Launch configurations swept (most promising first: the sweep stops starting new ones at the budget).
DECODE_SWEEP = [dict(block_n=bn, num_warps=w, num_stages=s, per_sm=p, heads_fastest=hf)
                for p in (8, 16, 4, 32)
                for hf in (1, 0)
                for bn, w, s in ((64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 4, 4), (32, 4, 6), (128, 4, 3),
                                 (128, 8, 3), (64, 8, 3))]
PREFILL_SWEEP = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
                 for m, n, w, s in ((128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3),
                                    (128, 64, 8, 4), (64, 128, 4, 2))]


PROBES_OK: set = set()  # probes that passed the correctness check (only those are timed)


# ----------------------------------------------------------------------------- float64 evaluation
def _keys(cache_or_packed, tables, b, start, length):
    """``length`` keys of sequence ``b`` as float64 ``[L, Hk, D]`` (paged or packed)."""
    if tables is None:
        return cache_or_packed[start:start + length].double()
    bs = cache_or_packed.shape[1]
    pages = tables[b, : -(-length // bs)].long()
    return cache_or_packed[pages].flatten(0, 1)[:length].double()


def _attend64(q, keys, values, scale, offset):
    """Float64 causal attention of ``q [Lq, Hq, D]`` over ``keys [Lk, Hk, D]``; query ``i`` sees keys ``<= offset + i``."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, 1).transpose(0, 1)  # [Hq, Lk, D]
    v = values.repeat_interleave(group, 1).transpose(0, 1)
    s = (q.double().transpose(0, 1) @ k.transpose(1, 2)) * scale  # [Hq, Lq, Lk]
    rows = torch.arange(q.shape[0], device=q.device)[:, None] + offset
    s = s.masked_fill(torch.arange(k.shape[1], device=q.device)[None, :] > rows, float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1)  # [Lq, Hq, D]


def decode64(q, k_cache, v_cache, tables, lens, scale=None):
    scale = scale or q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b, length in enumerate(lens.tolist()):
        keys, values = _keys(k_cache, tables, b, 0, length), _keys(v_cache, tables, b, 0, length)
        out[b] = _attend64(q[b:b + 1], keys, values, scale, length - 1)[0]
    return out


def prefill64(q, k, v, cu_q, cu_k, scale=None, k_cache=None, v_cache=None, block_tables=None):
    scale = scale or q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if block_tables is None:
            keys, values = _keys(k, None, b, ck[b], lk), _keys(v, None, b, ck[b], lk)
        else:
            keys, values = _keys(k_cache, block_tables, b, 0, lk), _keys(v_cache, block_tables, b, 0, lk)
        out[cq[b]:cq[b + 1]] = _attend64(q[cq[b]:cq[b + 1]], keys, values, scale, lk - lq)
    return out


# ----------------------------------------------------------------------------- timing
class Timer:
    """Median GPU time of single calls, each after an L2 flush (CUDA events); wall time on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn, repeats: int = 20, max_seconds: float = 0.5, flush: bool = True) -> float:
        fn()
        times = []
        deadline = time.perf_counter() + max_seconds
        if self.device.type != "cuda":
            for _ in range(max(3, repeats // 4)):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
            return statistics.median(times)
        torch.cuda.synchronize()
        for _ in range(repeats):
            if flush:
                self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
            if time.perf_counter() > deadline and len(times) >= 5:
                break
        return statistics.median(times)


def ceilings(device: torch.device) -> dict:
    """Copy bandwidth (1 GiB, bytes read + written) and bf16 8192^3 matmul rate, measured here."""
    from ninefold.bench.ops import ceilings as measure

    return measure(device)


# ----------------------------------------------------------------------------- cases
def _shapes(name: str, device: torch.device):
    s = workloads.shapes(name)
    if name == "llama-8b":
        s = dataclasses.replace(s, decode=DECODE_CASES, prefill=PREFILL_CASES)
    return s


def cases(op: str, shapes, device, dtype) -> list:
    return list(workloads.cases(op, shapes, device, dtype))


def _impls(op: str, device: torch.device, bound: tuple) -> dict:
    """Registered implementations of ``op`` that run ``bound`` on ``device``: name -> (fn, reason)."""
    found = {}
    for impl in registry.all_implementations(op):
        if device.type not in impl.devices or bound[0].dtype not in impl.dtypes:
            continue
        found[impl.name] = (impl.fn, impl.reason(bound))
    return found


def _contiguous_kv(op: str, bound: tuple):
    """The call's keys and values as contiguous ``[B, Hk, Lk, D]`` and queries as SDPA wants them."""
    if op == "attention_decode":
        q, k_cache, v_cache, tables, lens = bound[:5]
        b, hq, d = q.shape
        hk = k_cache.shape[2]
        n = tables.shape[1]
        k = k_cache[tables.long()].reshape(b, n * k_cache.shape[1], hk, d).transpose(1, 2).contiguous()
        v = v_cache[tables.long()].reshape(b, n * k_cache.shape[1], hk, d).transpose(1, 2).contiguous()
        return q.reshape(b, hk, hq // hk, d).contiguous(), k, v, None  # GQA folded into query rows
    q, k, v, cu_q, cu_k, _, k_cache, v_cache, tables = bound[:9]
    seqs = cu_q.shape[0] - 1
    lq, lk = q.shape[0] // seqs, int(cu_k[1] - cu_k[0])
    qs = q.reshape(seqs, lq, q.shape[1], q.shape[2]).transpose(1, 2).contiguous()
    if tables is None:
        ks = k.reshape(seqs, lk, k.shape[1], k.shape[2]).transpose(1, 2).contiguous()
        vs = v.reshape(seqs, lk, v.shape[1], v.shape[2]).transpose(1, 2).contiguous()
    else:
        n = -(-lk // k_cache.shape[1])
        t = tables[:, :n].long()
        ks = k_cache[t].flatten(1, 2)[:, :lk].transpose(1, 2).contiguous()
        vs = v_cache[t].flatten(1, 2)[:, :lk].transpose(1, 2).contiguous()
    return qs, ks, vs, (lq, lk)


def sdpa_variants(op: str, bound: tuple, device: torch.device) -> dict:
    """torch SDPA per backend on contiguous tensors: name -> zero-argument callable."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, causal = _contiguous_kv(op, bound)
    scale = bound[5] if op == "attention_decode" else bound[5]
    scale = scale or q.shape[-1] ** -0.5
    kwargs = {"scale": scale}
    if causal is not None:
        lq, lk = causal
        if lq == lk:
            kwargs["is_causal"] = True
        else:
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(lq, lk)
    expanded = None
    found = {}
    backends = ([("FLASH", SDPBackend.FLASH_ATTENTION), ("CUDNN", SDPBackend.CUDNN_ATTENTION),
                 ("EFFICIENT", SDPBackend.EFFICIENT_ATTENTION)] if device.type == "cuda" else [("MATH", SDPBackend.MATH)])
    for name, backend in backends:
        for gqa in (True, False):
            if gqa and q.shape[1] == k.shape[1]:
                continue
            if not gqa and q.shape[1] != k.shape[1]:
                if expanded is None:
                    g = q.shape[1] // k.shape[1]
                    expanded = (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
                kk, vv = expanded
            else:
                kk, vv = k, v
            extra = {"enable_gqa": True} if gqa else {}

            def call(kk=kk, vv=vv, backend=backend, extra=extra):
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, **kwargs, **extra)

            try:
                call()
            except Exception:  # noqa: BLE001  (this backend does not take this call)
                continue
            found[f"sdpa_{name.lower()}" + ("" if gqa or q.shape[1] == k.shape[1] else "_expanded_kv")] = call
            break
    return found


def probes(op: str, bound: tuple, device: torch.device) -> dict:
    """Vendor kernels not registered as implementations, measured to decide whether to register them:
    cuDNN's packed-sequence attention (``aten._cudnn_attention_forward`` with cumulative lengths;
    KV heads repeated for GQA inside the call). Packed k/v only."""
    if op != "attention_prefill" or device.type != "cuda" or bound[6] is not None or bound[0].dtype == torch.float32:
        return {}
    q, k, v, cu_q, cu_k, scale = bound[:6]
    max_q, max_k = q.shape[0], k.shape[0]
    if bool((cu_q == cu_k).all()):  # exact maxima for the benchmark's equal-length calls
        max_q = max_k = int((cu_q[1:] - cu_q[:-1]).max())
    group = q.shape[1] // k.shape[1]
    cu_q32, cu_k32 = cu_q.to(torch.int32), cu_k.to(torch.int32)

    def cudnn():
        kk = k.repeat_interleave(group, 1) if group > 1 else k
        vv = v.repeat_interleave(group, 1) if group > 1 else v
        return torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu_q32, cu_k32, max_q, max_k, False, 0.0, True,
                                                       False, scale=scale or q.shape[-1] ** -0.5)[0]

    return {"probe_cudnn_varlen": cudnn}


# ----------------------------------------------------------------------------- correctness
def _check(out, want, tol=2e-2) -> float:
    err = (out.double() - want).abs().max().item()
    bound = tol + tol * want.abs().max().item()
    if not err <= bound or not math.isfinite(err):
        raise AssertionError(f"max abs error {err:.3g} > {bound:.3g}")
    return err


def correctness_cases(shapes, device, dtype):
    """Ragged calls at the model's head shapes: (op, label, bound args, float64 expectation)."""
    g = torch.Generator().manual_seed(0)
    hq, hk, d = shapes.heads, shapes.kv_heads, shapes.head_dim
    small = shapes.head_dim <= 32
    lengths = [1, 5, 40, 23] if small else [1, 17, 1000, 4097, 300]
    k_cache, v_cache, tables = workloads.paged(shapes, lengths, device, dtype, g)
    q = torch.randn(len(lengths), hq, d, generator=g).to(device, dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    dec = dispatch.operator("attention_decode").bind(q, k_cache, v_cache, tables, lens)
    yield "attention_decode", f"ragged {lengths}", dec, decode64(*dec[:5])
    q_lens = [1, 9, 33, 20] if small else [1, 17, 300, 129, 1000]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    qp = torch.randn(sum(q_lens), hq, d, generator=g).to(device, dtype)
    kp = torch.randn(sum(q_lens), hk, d, generator=g).to(device, dtype)
    vp = torch.randn(sum(q_lens), hk, d, generator=g).to(device, dtype)
    packed = dispatch.operator("attention_prefill").bind(qp, kp, vp, cu, cu)
    yield "attention_prefill", f"packed {q_lens}", packed, prefill64(*packed[:9])
    new = [1, 5, 33, 20] if small else [1, 17, 1, 129, 64]
    cu_new = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_all = torch.tensor([0, *torch.tensor(lengths[:len(new)]).cumsum(0).tolist()], dtype=torch.int32, device=device)
    qn = torch.randn(sum(new), hq, d, generator=g).to(device, dtype)
    paged = dispatch.operator("attention_prefill").bind(qn, None, None, cu_new, cu_all, k_cache=k_cache,
                                                      v_cache=v_cache, block_tables=tables)
    yield "attention_prefill", f"paged prefix, new {new} of {lengths[:len(new)]}", paged, prefill64(*paged[:9])


def check_all(shapes, device, dtype) -> list[dict]:
    rows = []
    for op, label, bound, want in correctness_cases(shapes, device, dtype):
        candidates = dict(_impls(op, device, bound))
        candidates.update({name: (lambda *_, fn=fn: fn(), None) for name, fn in probes(op, bound, device).items()})
        for name, (fn, reason) in candidates.items():
            row = {"op": op, "case": label, "impl": name}
            if reason:
                row["skipped"] = reason
            else:
                try:
                    row["max_abs_err"] = _check(fn(*bound), want)
                    if name.startswith("probe_"):
                        PROBES_OK.add((op, name))
                    row["ok"] = True
                except Exception as error:  # noqa: BLE001  (reported; the run goes on)
                    row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:300]}")
            rows.append(row)
            print(f"check {op:17s} {name:13s} {label:40s} "
                  + ("skipped: " + row["skipped"] if "skipped" in row else
                     f"ok (max err {row['max_abs_err']:.2e})" if row.get("ok") else "FAILED " + row["error"]))
    return rows


# ----------------------------------------------------------------------------- timings
def _rate(op, case, us, ceiling) -> tuple[str, float]:
    if op == "attention_decode":
        gbps = case.bytes / us / 1e3
        return f"{gbps:7.0f} GB/s", gbps / ceiling["copy_GBps"]
    tflops = case.flops / us / 1e6
    return f"{tflops:6.1f} TFLOP/s", tflops / ceiling["mm_TFLOPs"]


def time_cases(op, shapes, device, dtype, ceiling, timer) -> list[dict]:
    rows = []
    for case in cases(op, shapes, device, dtype):
        bound = dispatch.operator(op).bind(*case.args, **case.kwargs)
        entry = {"op": op, "case": case.label, "bytes": case.bytes, "flops": case.flops, "impls": {}}
        try:
            entry["choice"] = dispatch.choose(op, *case.args, **case.kwargs)
        except Exception as error:  # noqa: BLE001
            entry["choice"] = f"error: {error}"
        candidates = {name: (lambda fn=fn, bound=bound: fn(*bound)) for name, (fn, reason) in _impls(op, device, bound).items()
                      if not reason}
        if op == "attention_prefill" and "vendor_varlen" in candidates and bound[6] is None:
            seqs = bound[3].shape[0] - 1
            exact = bound[:9] + (bound[0].shape[0] // seqs, bound[1].shape[0] // seqs)
            fn = dict((i.name, i.fn) for i in registry.all_implementations(op))["vendor_varlen"]
            candidates["vendor_varlen(max_seqlen)"] = lambda fn=fn, exact=exact: fn(*exact)
        candidates.update({name: fn for name, fn in probes(op, bound, device).items() if (op, name) in PROBES_OK})
        try:
            candidates.update(sdpa_variants(op, bound, device))
        except Exception as error:  # noqa: BLE001
            entry["sdpa_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        if "triton" in candidates:  # what a lone call costs, host launch included (the flush hides it)
            candidates["triton(no flush)"] = candidates["triton"]
        for name, fn in candidates.items():
            try:
                us = timer(fn, flush=name != "triton(no flush)")
            except Exception as error:  # noqa: BLE001
                entry["impls"][name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
                print(f"time  {op:17s} {case.label:24s} {name:28s} error {error}")
                continue
            text, fraction = _rate(op, case, us, ceiling)
            entry["impls"][name] = {"us": round(us, 2), "fraction": round(fraction, 4)}
            print(f"time  {op:17s} {case.label:24s} {name:28s} {us:10.1f} us  {text}  {fraction * 100:5.1f}%")
        print(f"      {op:17s} {case.label:24s} dispatch chooses {entry['choice']}")
        rows.append(entry)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def sweep(op, shapes, device, dtype, ceiling, timer, configs, deadline) -> list[dict]:
    """Each launch configuration: checked against float64 on the ragged cases, then timed on the three largest calls."""
    from ninefold.ops.triton import decode, prefill

    launch = decode.launch if op == "attention_decode" else prefill.launch
    checks = [(bound, want) for o, _, bound, want in correctness_cases(shapes, device, dtype) if o == op]
    largest = sorted(cases(op, shapes, device, dtype), key=lambda c: -(c.bytes + c.flops))[:3]
    bounds = [dispatch.operator(op).bind(*c.args, **c.kwargs) for c in largest]
    rows = []
    for config in tqdm(configs, desc=f"sweep {op}", file=sys.stdout, disable=None):
        if time.perf_counter() > deadline:
            rows.append({"config": config, "skipped": "time budget"})
            continue
        row = {"config": config}
        try:
            for bound, want in checks:
                _check(launch(*bound[:9 if op == "attention_prefill" else 6], config), want)
            for case, bound in zip(largest, bounds):
                args = bound[:9 if op == "attention_prefill" else 6]
                us = timer(lambda args=args, config=config: launch(*args, config), repeats=10, max_seconds=0.3)
                row[case.label] = {"us": round(us, 2), "fraction": round(_rate(op, case, us, ceiling)[1], 4)}
        except Exception as error:  # noqa: BLE001  (a config that fails is reported, not fatal)
            row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
    timed = [r for r in rows if "error" not in r and "skipped" not in r]
    for case in largest:
        best = min(timed, key=lambda r: r[case.label]["us"], default=None)
        if best:
            print(f"sweep {op:17s} {case.label:24s} best {best['config']} {best[case.label]['us']:.1f} us "
                  f"({best[case.label]['fraction'] * 100:.1f}% of ceiling)")
    if timed:  # best over the swept calls together (sum of times)
        overall = min(timed, key=lambda r: sum(r[c.label]["us"] for c in largest))
        print(f"sweep {op:17s} best overall {overall['config']}")
    return rows


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shapes = _shapes(args.shapes or ("llama-8b" if device.type == "cuda" else "tiny"), device)
    start = time.perf_counter()
    deadline = start + args.budget
    import triton

    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype),
               "command": "python -m ninefold.bench.ops_attention " + " ".join(args.argv)}
    print(f"ninefold.bench.ops_attention on {results['device']}, torch {torch.__version__}, triton {triton.__version__}")
    results["correctness"] = check_all(shapes, device, dtype)
    failed = [r for r in results["correctness"] if r.get("ok") is False and not r["impl"].startswith("probe_")]
    results["ceilings"] = ceiling = ceilings(device)
    print(f"ceilings: copy {ceiling['copy_GBps']:.0f} GB/s, bf16 matmul {ceiling['mm_TFLOPs']:.0f} TFLOP/s")
    timer = Timer(device)
    results["decode"] = time_cases("attention_decode", shapes, device, dtype, ceiling, timer)
    results["prefill"] = time_cases("attention_prefill", shapes, device, dtype, ceiling, timer)
    if "triton" in {i.name for i in registry.all_implementations("attention_decode")} and not args.no_sweep:
        remaining = deadline - time.perf_counter()
        results["sweep_decode"] = sweep("attention_decode", shapes, device, dtype, ceiling, timer, DECODE_SWEEP,
                                        time.perf_counter() + 0.4 * remaining)
        results["sweep_prefill"] = sweep("attention_prefill", shapes, device, dtype, ceiling, timer, PREFILL_SWEEP,
                                         deadline)
    results["seconds"] = round(time.perf_counter() - start, 1)
    results["failed_checks"] = len(failed)
    print(f"done in {results['seconds']} s; {len(failed)} failed correctness checks")
    return results


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.ops_attention", description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="cuda (default when present) or cpu (Triton through TRITON_INTERPRET=1)")
    parser.add_argument("--dtype", help="bfloat16 on CUDA (default), float32 on the CPU")
    parser.add_argument("--shapes", help="llama-8b (default on CUDA) or tiny / smollm2")
    parser.add_argument("--budget", type=float, default=130.0, help="seconds after which sweeps stop starting configs")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    args = parser.parse_args(argv)
    args.argv = argv
    results = run(args)
    write_json("ops_attention.json", results, default=str, announce=True)
    return 1 if results["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
