"""Causal attention with part of the softmax's exponentials computed on the FMA pipe (GPU experiment).

    OUT=DIR python -m ninefold.bench.attention_exp2     # one CUDA device with TMA (sm_90), ~30 s

Question (issue 3, causal attention against cuDNN): is the flash-attention loop bound by the MUFU
unit during the softmax? ``ex2`` issues at 16 per clock per SM against 128 FP32 FMAs, so computing
part of the exponentials as ``2^floor(x) * poly(frac(x))`` on the FMA pipe would shorten the softmax
if it were. A hand-written Triton kernel (host TMA descriptors, one query tile per program, longest
rows first, unmasked tiles then the diagonal) at B4 H32 S4096 D128 bf16, in three variants: all
``ex2`` (``FRACTION`` 0), a quarter of the key columns by the polynomial (3), the odd key columns (1),
every exponential (2); the splits of the score tile stay in registers (no shared-memory traffic). Each output is checked
against float64 attention on one head and against torch's SDPA before it is timed (``do_bench``
median). A diagnostic, not a benchmark with targets; results in docs/perf/dsl.md.
"""
import sys
import time

import torch
import triton
import triton.language as tl

from ninefold.bench.results import write_json

# 2^f on [0, 1) as 1 + f * (C1 + f * (C2 + f * C3)): a degree-3 fit, relative error 1.4e-4
C1 = tl.constexpr(0.6958606)
C2 = tl.constexpr(0.2251380)
C3 = tl.constexpr(0.0789985)


@triton.jit
def _exp2_fma(x):
    """2^x for x <= 0 without ``ex2``: the exponent field from floor(x), the mantissa from the polynomial."""
    x = tl.maximum(x, -127.0)
    whole = tl.floor(x)
    f = x - whole
    p = tl.fma(tl.fma(tl.fma(f, C3, C2), f, C1), f, 1.0)
    bits = p.to(tl.int32, bitcast=True) + (whole.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_quarter(x, BM: tl.constexpr, BN: tl.constexpr):
    """2^x with a quarter of the elements on the FMA pipe. Column 16a + 8b + c of a score tile: a thread
    holds c in {2t, 2t + 1} for every (a, b), so splitting over b and then over c's parity stays in registers."""
    x4 = tl.permute(tl.reshape(x, [BM, BN // 16, 2, 8]), [0, 1, 3, 2])
    low, high = tl.split(x4)
    high_even, high_odd = tl.split(tl.reshape(high, [BM, BN // 16, 4, 2]))
    high = tl.reshape(tl.join(tl.exp2(high_even), _exp2_fma(high_odd)), [BM, BN // 16, 8])
    return tl.reshape(tl.permute(tl.join(tl.exp2(low), high), [0, 1, 3, 2]), [BM, BN])


@triton.jit
def _exp2(x, FRACTION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """2^x with none (``FRACTION`` 0), half (1), all (2) or a quarter (3) of the elements by the polynomial."""
    if FRACTION == 0:
        return tl.exp2(x)
    elif FRACTION == 2:
        return _exp2_fma(x)
    elif FRACTION == 3:
        return _exp2_quarter(x, BM, BN)
    else:
        even, odd = tl.split(tl.reshape(x, [BM, BN // 2, 2]))
        return tl.reshape(tl.join(tl.exp2(even), _exp2_fma(odd)), [BM, BN])


@triton.jit
def _step(q, k, v, acc, l_i, m_i, row, col, MASK: tl.constexpr, FRACTION: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr):
    s = tl.dot(q, tl.trans(k))
    if MASK:
        s = tl.where(col[None, :] <= row[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = _exp2(s - m_new[:, None], FRACTION, BM, BN)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(tl.bfloat16), v, acc)
    return acc, l_i, m_new


@triton.jit
def fa_causal(q_desc, k_desc, v_desc, o_ptr, S, scale_log2, FRACTION: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, D: tl.constexpr):
    tiles_m = S // BM
    pid_m = tiles_m - 1 - tl.program_id(0)  # longest rows first
    bh = tl.program_id(1)
    base = bh * S
    q = q_desc.load([base + pid_m * BM, 0])
    q = (q * scale_log2).to(tl.bfloat16)
    row = pid_m * BM + tl.arange(0, BM)
    acc = tl.zeros([BM, D], tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    full = (pid_m * BM) // BN
    for j in range(0, full):
        k = k_desc.load([base + j * BN, 0])
        v = v_desc.load([base + j * BN, 0])
        acc, l_i, m_i = _step(q, k, v, acc, l_i, m_i, row, j * BN + tl.arange(0, BN), False, FRACTION, BM, BN)
    for j in range(full, tl.cdiv((pid_m + 1) * BM, BN)):
        k = k_desc.load([base + j * BN, 0])
        v = v_desc.load([base + j * BN, 0])
        acc, l_i, m_i = _step(q, k, v, acc, l_i, m_i, row, j * BN + tl.arange(0, BN), True, FRACTION, BM, BN)
    out = acc / l_i[:, None]
    cols = tl.arange(0, D)
    tl.store(o_ptr + (base + row)[:, None] * D + cols[None, :], out.to(tl.bfloat16))


def causal_head_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: tuple[int, int]) -> torch.Tensor:
    """Causal attention of one (batch, head) ``h`` of ``[B, H, S, D]`` tensors, in float64 on their device."""
    qd, kd, vd = (t[h].double() for t in (q, k, v))
    scores = qd @ kd.T / q.shape[-1] ** 0.5
    future = torch.ones(q.shape[2], k.shape[2], device=q.device, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ vd


TOLERANCE = 0.02  # max abs error against float64 attention on one head (bfloat16 outputs of unit-scale inputs)
# BM, BN, warps, stages, maxnreg (a register cap per thread: 168 lets three 4-warp programs share an SM)
CONFIGS = ((64, 64, 4, 3, None), (64, 64, 4, 2, None), (128, 64, 8, 2, None), (128, 128, 8, 2, None),
           (64, 64, 4, 2, 168), (64, 64, 4, 2, 160), (64, 32, 4, 2, None), (64, 32, 4, 3, 168), (64, 32, 4, 2, 128))


def run(q, k, v, fraction, bm, bn, warps, stages, maxnreg=None):
    """The kernel on ``[B, H, S, D]`` bfloat16 tensors (S a multiple of both tiles)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    B, H, S, D = q.shape
    flat = lambda t, rows: TensorDescriptor(t.view(B * H * S, D), [B * H * S, D], [D, 1], [rows, D])
    o = torch.empty_like(q)
    grid = (S // bm, B * H)
    fa_causal[grid](flat(q, bm), flat(k, bn), flat(v, bn), o, S, (D ** -0.5) * 1.4426950408889634,
                    FRACTION=fraction, BM=bm, BN=bn, D=D, num_warps=warps, num_stages=stages,
                    **({"maxnreg": maxnreg} if maxnreg else {}))
    return o


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.attention_exp2", description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="0,3,1,2", help="FRACTION values to run (0: ex2 only)")
    parser.add_argument("--configs", default=None, help="indices into CONFIGS to run (default: all)")
    args = parser.parse_args(argv)
    fractions = [int(f) for f in args.fractions.split(",")]
    configs = CONFIGS if args.configs is None else [CONFIGS[int(i)] for i in args.configs.split(",")]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("ninefold.bench.attention_exp2 needs a CUDA device with TMA (sm_90+); nothing measured.", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    B, H, S, D = 4, 32, 4096, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = (0, 5)  # one head in float64
    ref64 = causal_head_float64(q, k, v, h)
    flops = 4 * B * H * S * S * D / 2
    t_torch = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    print(f"torch SDPA: {t_torch * 1e3:.1f} us, {flops / t_torch / 1e9:.0f} TFLOP/s; "
          f"its error on head {h}: {(ref[h].double() - ref64).abs().max().item():.4f}")
    rows = []
    for bm, bn, warps, stages, maxnreg in configs:
        for fraction in fractions:
            t0 = time.time()
            try:
                out = run(q, k, v, fraction, bm, bn, warps, stages, maxnreg)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001  (a configuration that does not compile is reported, not fatal)
                print(f"{bm}x{bn} w{warps} s{stages} r{maxnreg} fraction {fraction}: {type(e).__name__}: {str(e)[:200]}")
                continue
            err64 = (out[h].double() - ref64).abs().max().item()
            err = (out.float() - ref.float()).abs().max().item()
            if not (err64 <= TOLERANCE and err <= 2 * TOLERANCE):
                print(f"{bm}x{bn} w{warps} s{stages} r{maxnreg} fraction {fraction}: WRONG (max error {err64:.4f} against "
                      f"float64, {err:.4f} against torch); not timed")
                continue
            t = triton.testing.do_bench(lambda args=(fraction, bm, bn, warps, stages, maxnreg): run(q, k, v, *args))
            rows.append({"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages, "maxnreg": maxnreg,
                         "fraction": fraction,
                         "us": t * 1e3, "tflops": flops / t / 1e9, "of_torch": t_torch / t, "err_vs_fp64": err64})
            print(f"{bm}x{bn} w{warps} s{stages} r{maxnreg} fraction {fraction}: {t * 1e3:7.1f} us {flops / t / 1e9:4.0f} TFLOP/s "
                  f"({t_torch / t:.1%} of torch); max err vs fp64 head {err64:.4f}, vs torch {err:.4f}; "
                  f"first call {time.time() - t0:.1f} s")
    write_json("attention_exp2.json", {"device": torch.cuda.get_device_name(), "torch_us": t_torch * 1e3, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
