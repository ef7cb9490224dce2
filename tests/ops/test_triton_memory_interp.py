"""Under TRITON_INTERPRET=1 only (tests/ops/test_triton_memory.py runs it so): the memory-bound Triton
kernels against the float64 references, in float32 at odd sizes, under every launch-configuration
form (one and several rows/tokens per program), with strided rows and rotary tails."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 (see test_triton_memory.py)", allow_module_level=True)

from ninefold.ops import references, workloads  # noqa: E402
from ninefold.ops.triton import activation, norm, rope, softmax  # noqa: E402

TOL = 2e-5
failures = []


def close(what, got, want):
    got, want = got.double(), want.double()
    err = ((got - want).abs() / (want.abs() + 1)).max().item() if got.numel() else 0.0
    if not err <= TOL:
        failures.append(f"{what}: max relative error {err:.3g}")


def strided(rows, d, gen):
    """A [rows, d] view with row stride d + 3 (not contiguous, unit stride inside rows)."""
    return torch.randn(rows, d + 3, generator=gen)[:, :d]


def with_config(mod, cfg):
    mod.OVERRIDE.clear()
    mod.OVERRIDE.update(cfg)


def test_memory_kernels_match_float64_references():
    gen = torch.Generator().manual_seed(0)
    for cfg in ({}, {"rows": 1, "num_warps": 4}, {"rows": 4, "num_warps": 2}, {"rows": 2, "num_warps": 2, "store": ".cs", "load": ""}):
        with_config(norm, cfg)
        for rows, d in ((1, 8), (7, 100), (9, 64), (3, 257)):
            x, r, w = strided(rows, d, gen), strided(rows, d, gen), torch.randn(d, generator=gen)
            close(f"rms_norm {cfg} {rows}x{d}", norm.rms_norm(x, w, 1e-5), references.rms_norm(x, w, 1e-5))
            out, total = norm.add_rms_norm(x, r, w, 1e-6)
            want_out, want_total = references.add_rms_norm(x, r, w, 1e-6)
            close(f"add_rms_norm {cfg} {rows}x{d}", out, want_out)
            close(f"add_rms_norm residual {cfg} {rows}x{d}", total, want_total)
        x3 = torch.randn(2, 3, 40, generator=gen)
        close(f"rms_norm 3-D {cfg}", norm.rms_norm(x3, torch.ones(40), 1e-5), references.rms_norm(x3, torch.ones(40), 1e-5))
    norm.OVERRIDE.clear()

    for cfg in ({}, {"rows": 1, "num_warps": 4}, {"rows": 4, "num_warps": 2}):
        with_config(softmax, cfg)
        for rows, n in ((1, 1), (5, 33), (11, 70), (7, 300), (3, 20000)):
            x = strided(rows, n, gen) * 4
            close(f"softmax {cfg} {rows}x{n}", softmax.softmax(x, -1), references.softmax(x))
        x = torch.randn(5, 17, generator=gen)
        x[1, 3:] = float("-inf")
        close(f"softmax -inf {cfg}", softmax.softmax(x, -1), references.softmax(x))
    softmax.OVERRIDE.clear()

    for cfg in ({}, {"block": 16, "num_warps": 4}, {"block": 64, "num_warps": 2}, {"block": 16, "num_warps": 2, "flat": True},
                {"block": 32, "num_warps": 2, "libdevice_erf": True}, {"block": 16, "num_warps": 2, "store": ".cs", "load": ""}):
        with_config(activation, cfg)
        for rows, d in ((1, 3), (6, 50), (3, 130)):
            x = strided(rows, 2 * d, gen) * 3
            close(f"silu_and_mul {cfg} {rows}x{d}", activation.silu_and_mul(x), references.silu_and_mul(x))
            for approximate in ("none", "tanh"):
                close(f"gelu_and_mul {approximate} {cfg} {rows}x{d}", activation.gelu_and_mul(x, approximate),
                      references.gelu_and_mul(x, approximate))
    activation.OVERRIDE.clear()

    for cfg in ({}, {"tokens": 1, "num_warps": 4}, {"tokens": 4, "num_warps": 2}):
        with_config(rope, cfg)
        for t, hq, hk, d, rotary in ((1, 4, 2, 16, 16), (7, 3, 1, 20, 12), (5, 8, 8, 64, 64), (6, 2, 1, 36, 20)):
            cache = workloads.cos_sin_cache(50, rotary)
            # q and k as strided views of one fused projection, as a model produces them.
            qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen)
            q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
            positions = torch.randint(0, 50, (t,), generator=gen)
            for neox in (True, False):
                got = rope.rope(q, k, positions, cache, neox)
                want = references.rope(q, k, positions, cache, neox)
                close(f"rope q neox={neox} {cfg} {t}x{hq}/{hk}x{d} r={rotary}", got[0], want[0])
                close(f"rope k neox={neox} {cfg} {t}x{hq}/{hk}x{d} r={rotary}", got[1], want[1])
            close("rope int32 positions", rope.rope(q, k, positions.int(), cache, True)[0],
                  references.rope(q, k, positions, cache, True)[0])
    rope.OVERRIDE.clear()
    assert not failures, "\n".join(failures)
