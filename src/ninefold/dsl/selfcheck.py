"""End-to-end check of the triton backend on a GPU: ``python -m ninefold.dsl.selfcheck``.

Checks small hand kernels (vector add, a tiled row reduction, a matmul loop over the middle level,
a scalar with ``+=``, a ``jit`` softmax with a non-power-of-two constexpr) against float64 torch
at odd sizes and on strided inputs, in float32/float16/bfloat16; the tuning cache across
processes; an AOT artifact launched through the CUDA driver. Then times add and mm against torch.
Prints a table and writes ``$OUT/dsl_selfcheck.json`` when ``OUT`` is set. Exits 1 on a failure.

To check that an artifact compiled by another Triton (here 3.9, on a machine without a GPU)
launches on the GPU: ``python -m ninefold.dsl.selfcheck --write-aot DIR`` there, then
``python -m ninefold.dsl.selfcheck --aot-dir DIR`` on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from ninefold.dsl import examples

add = examples.add_kernel()
row_sum = examples.row_sum_kernel(rows=(1, 16), cols=(16, 256))
mm = examples.mm_kernel(m=(32, 128), n=(32, 256), k=(32, 64))
axpy = examples.axpy_kernel()
softmax_rows = examples.softmax_rows_kernel()

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _rand(shape, dtype, strided=False):
    t = torch.randn(shape, dtype=torch.float64, device="cuda")
    if strided:
        big = torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=torch.float64, device="cuda")
        big[..., ::2] = t
        t = big[..., ::2]
    return t.to(dtype)


def _err(got, want):
    return ((got.double() - want).abs() / (want.abs() + 1)).max().item()


def correctness():
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tol = TOL[dtype]
        x, y = _rand((100003,), dtype, strided=True), _rand((100003,), dtype)
        z = torch.empty(100003, dtype=dtype, device="cuda")
        add(x, y, z)
        rows.append(("add", dtype, _err(z, x.double() + y.double()), tol))
        add(x, y, z, BLOCK=128)
        rows.append(("add BLOCK=128", dtype, _err(z, x.double() + y.double()), tol))
        a = _rand((301, 777), dtype, strided=True)
        out = torch.empty(301, dtype=dtype, device="cuda")
        row_sum(a, out)
        rows.append(("row_sum", dtype, _err(out, a.double().sum(1)) / 30, tol))
        a, b = _rand((515, 300), dtype, strided=True), _rand((300, 389), dtype)
        c = torch.empty(515, 389, dtype=dtype, device="cuda")
        mm(a, b, c)
        rows.append(("mm", dtype, _err(c, a.double() @ b.double()) / 20, tol if dtype != torch.float32 else 1e-3))
        mm(a, b, c, BM=32, BN=32, BK=32)
        rows.append(("mm small blocks", dtype, _err(c, a.double() @ b.double()) / 20, tol if dtype != torch.float32 else 1e-3))
        s = _rand((333, 1000), dtype)
        t = torch.empty_like(s)
        softmax_rows(s, t, WIDTH=1000)
        rows.append(("softmax WIDTH=1000", dtype, _err(t, torch.softmax(s.double(), 1)), tol))
        v, w = _rand((5000,), dtype), _rand((5000,), dtype)
        want = w.double() + 0.5 * v.double()
        axpy(v, 0.5, w)
        rows.append(("axpy +=", dtype, _err(w, want), tol))
    return [{"check": n, "dtype": str(d).replace("torch.", ""), "error": e, "tolerance": t, "ok": e <= t} for n, d, e, t in rows]


def write_aot(directory, target="cuda:90"):
    """Compile the AOT artifact the check launches (runs without a GPU)."""
    from ninefold.dsl import aot

    example = tuple(torch.empty(8, 8, dtype=torch.float16, device="meta") for _ in range(3))
    return aot.compile(mm, [{"args": example, "kwargs": {"BM": 64, "BN": 64, "BK": 32}}], target=target, out=directory)


def aot_roundtrip(directory=None):
    """Launch the AOT mm through the CUDA driver: from ``directory`` (compiled elsewhere) or compiled here."""
    from ninefold.dsl import aot

    with tempfile.TemporaryDirectory() as tmp:
        if directory is None:
            major, minor = torch.cuda.get_device_capability()
            write_aot(tmp, f"cuda:{major}{minor}")
            directory = tmp
        kernel = aot.load(directory)
        a, b = _rand((300, 200), torch.float16), _rand((200, 170), torch.float16)
        c = torch.empty(300, 170, dtype=torch.float16, device="cuda")
        kernel(a, b, c)
        torch.cuda.synchronize()
        error = _err(c, a.double() @ b.double()) / 20
        version = kernel.artifacts[0].meta["triton_version"]
    name = f"aot mm (compiled by triton {version})"
    return {"check": name, "dtype": "float16", "error": error, "tolerance": 2e-3, "ok": error <= 2e-3}


def _time(fn, repeat=20):
    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat / 1e3


def speed():
    rows = []
    n = 1 << 26
    x, y = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    z = torch.empty_like(x)
    t0 = time.perf_counter()
    add(x, y, z)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ours, theirs = _time(lambda: add(x, y, z)), _time(lambda: torch.add(x, y, out=z))
    rows.append({"kernel": "add bf16 2^26", "ninefold_GBps": 3 * n * 2 / ours / 1e9, "torch_GBps": 3 * n * 2 / theirs / 1e9, "first_call_s": first})
    m = 4096
    a, b = torch.randn(m, m, device="cuda", dtype=torch.float16), torch.randn(m, m, device="cuda", dtype=torch.float16)
    c = torch.empty_like(a)
    t0 = time.perf_counter()
    mm(a, b, c)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ours, theirs = _time(lambda: mm(a, b, c)), _time(lambda: torch.mm(a, b, out=c))
    rows.append({"kernel": "mm fp16 4096^3", "ninefold_TFLOPs": 2 * m**3 / ours / 1e12, "torch_TFLOPs": 2 * m**3 / theirs / 1e12, "first_call_s": first})
    return rows


def second_process_seconds() -> float:
    """A fresh process calling the (already tuned) mm: the tuning cache must make it cheap."""
    code = (
        "import time, torch; t0 = time.perf_counter(); from ninefold.dsl.selfcheck import mm; "
        "a = torch.randn(4096, 4096, device='cuda', dtype=torch.float16); c = torch.empty_like(a); "
        "t1 = time.perf_counter(); mm(a, a, c); torch.cuda.synchronize(); print(time.perf_counter() - t1)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return float(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.dsl.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--write-aot", metavar="DIR", help="only compile the AOT artifact into DIR (no GPU needed)")
    parser.add_argument("--aot-dir", metavar="DIR", help="launch the AOT artifact in DIR (e.g. compiled by another Triton)")
    args = parser.parse_args(argv)
    if args.write_aot:
        for path in write_aot(args.write_aot):
            print(path)
        return 0
    if not torch.cuda.is_available():
        print("ninefold.dsl.selfcheck: no CUDA device; nothing to check", file=sys.stderr)
        return 2
    import triton

    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    checks = correctness()
    for directory in [None] + ([args.aot_dir] if args.aot_dir else []):
        try:
            checks.append(aot_roundtrip(directory))
        except Exception as error:  # reported as a failed check
            checks.append({"check": f"aot mm ({directory or 'compiled here'})", "dtype": "float16", "error": repr(error), "tolerance": 0, "ok": False})
    for row in checks:
        error = row["error"] if isinstance(row["error"], str) else f"{row['error']:.2e}"
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['check']:<30} {row['dtype']:<9} err {error}  tol {row['tolerance']:.0e}")
    timings = speed()
    for row in timings:
        print("  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    cached = second_process_seconds()
    print(f"second process, mm 4096^3 first call (tuning cache hit): {cached:.3f} s")
    result = {"checks": checks, "speed": timings, "second_process_first_call_s": cached}
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "dsl_selfcheck.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(row["ok"] for row in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
