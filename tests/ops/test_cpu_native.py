"""ops.linear_blocks / BlockWeight and the native CPU kernel library (ninefold.ops.cpu_native).

References are float64, built here from the codes and scales: the activations are rounded to int8
per 32 values with the float32 arithmetic the contract names (dx = max|x| / 127, q = round(x * (127 /
max|x|))), then everything else is float64. The kernels sum exact int32 block products in float32,
so they agree with it to float32 rounding. A second check bounds the distance to the unrounded
product by the rounding itself (sum |w| dx / 2 per output), so the int8 error is what it claims.
"""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import cpu_native

from .helpers import call, impl_params

NATIVE = cpu_native.available()


def _weight(n, k, bits, seed=0, terms=1):
    if bits in ("4+8", "5+8"):  # a 4- or 5-bit head of 32 rows stacked over an 8-bit tail (BlockWeight.stacked)
        head_bits = int(bits[0])
        (head, head_dense), (tail, tail_dense) = (_weight(32, k, head_bits, seed, terms),
                                                  _weight(n - 32, k, 8, seed + 1, terms))
        return ops.BlockWeight.stacked(head, tail), torch.cat((head_dense, tail_dense))
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand((n, k // 32), generator=g) * 0.02 + 0.001).half().float()
    if bits == "L4":  # 4-bit codes indexing 16 int8 levels (GGUF's IQ4): the extremes -128 and 127 included
        levels = torch.tensor([-128, -104, -83, -65, -49, -35, -22, -10, 0, 13, 25, 38, 53, 69, 89, 127], dtype=torch.int8)
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        dense = levels.double()[codes.long()].reshape(n, k // 32, 32) * scales.double()[..., None]
        weight = ops.BlockWeight(codes, scales, None, 4, activation_terms=terms, levels=levels)
        return weight, dense.reshape(n, k)
    if bits in (4, 5):
        codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
        offsets = (-(2 ** (bits - 1)) * scales + torch.randn((n, k // 32), generator=g) * 0.01).half().float()
        dense = codes.double().reshape(n, k // 32, 32) * scales.double()[..., None] + offsets.double()[..., None]
        return ops.BlockWeight(codes, scales, offsets, bits, activation_terms=terms), dense.reshape(n, k)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    dense = codes.double().reshape(n, k // 32, 32) * scales.double()[..., None]
    return ops.BlockWeight(codes, scales, None, 8, activation_terms=terms), dense.reshape(n, k)


def _round_int8(x: np.ndarray) -> np.ndarray:
    """Per 32 values: q * dx in float64, q from float32 arithmetic (the contract)."""
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def _reference(x, dense, bias, terms):
    xf = x.detach().float().numpy().astype(np.float64)
    xr = _round_int8(xf)
    if terms == 2:
        xr = xr + _round_int8((xf.astype(np.float32) - xr.astype(np.float32)).astype(np.float64))
    out = torch.from_numpy(xr) @ dense.T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("device,impl", impl_params("linear_blocks"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bits,lead,n,k,bias,strided,terms", [
    (4, (1,), 16, 32, False, False, 1),
    (4, (3,), 33, 64, True, False, 1),  # N not a multiple of 16: padded rows
    (4, (2, 5), 70, 256, False, True, 1),  # 3-D, non-contiguous x
    (4, (17,), 48, 576, True, False, 2),  # more rows than one pass of a group (8)
    (8, (1,), 40, 96, False, False, 1),
    (8, (9,), 64, 128, False, True, 2),
    (8, (4,), 16, 512, True, False, 1),
    ("4+8", (1,), 48, 96, True, False, 1),  # a stacked weight: 4-bit row groups, then 8-bit ones
    ("4+8", (11,), 41, 64, False, True, 2),
    (5, (1,), 16, 64, False, False, 1),
    (5, (9,), 37, 96, True, True, 2),
    (5, (5,), 48, 256, False, False, 1),
    ("5+8", (3,), 41, 64, True, False, 1),
    ("L4", (1,), 16, 64, False, False, 1),
    ("L4", (13,), 37, 96, True, True, 1),
    ("L4", (3,), 48, 256, False, False, 2),
])
def test_linear_blocks_matches_float64(device, impl, dtype, bits, lead, n, k, bias, strided, terms):
    weight, dense = _weight(n, k, bits, seed=n + k, terms=terms)
    g = torch.Generator().manual_seed(1)
    x = torch.randn((*lead, 2 * k if strided else k), generator=g).to(dtype)
    if strided:
        x = x[..., ::2]
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = call("linear_blocks", impl, x, weight, b)
    assert out.shape == (*lead, n) and out.dtype == dtype
    want = _reference(x, dense, b, terms)
    scale = want.abs().max().item()
    # float32: float32 sums of exact block products; bf16 output: its own rounding (2^-8 relative)
    tol = 2e-6 * (k / 32) ** 0.5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * scale)


@pytest.mark.skipif(not NATIVE, reason=f"native CPU kernels: {cpu_native.reason()}")
@pytest.mark.parametrize("bits", [4, 5, 8, "L4"])
def test_int8_rounding_error_is_bounded_by_the_rounding(bits):
    n, k = 64, 320
    weight, dense = _weight(n, k, bits, seed=5)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.01, 3, k)
    out = ops.linear_blocks(x, weight).double()
    exact = x.double() @ dense.T
    dx = x.abs().reshape(6, k // 32, 32).amax(-1).double() / 127  # [M, K/32]
    bound = (dx.repeat_interleave(32, dim=1) / 2) @ dense.abs().T  # sum |w| dx / 2 per output
    err = (out - exact).abs()
    assert (err <= bound * 1.001 + 1e-5).all()
    assert err.max() > 0  # it is a rounding, not the exact product
    # the two-term rounding is ~127x finer
    fine = ops.linear_blocks(x, ops.BlockWeight(*_codes_of(weight), bits=weight.bits, activation_terms=2,
                                                levels=weight.levels)).double()
    assert (fine - exact).abs().max() < err.max() / 20


def _codes_of(weight):
    codes, d, m = weight._records()
    if weight.bits == 8:
        return (codes.to(torch.int16) - 128).to(torch.int8), d, None
    return codes, d, m


def test_block_weight_stores_the_blocks_exactly():
    for bits in (4, 5, 8, "L4"):
        weight, dense = _weight(37, 96, bits, seed=3)
        assert torch.equal(weight.dequantize64(), dense)
        assert weight.dequantize(torch.bfloat16).dtype == torch.bfloat16
        assert weight.nbytes == 3 * 3 * {4: 320, 5: 384, 8: 544, "L4": 288}[bits]  # 3 groups of 16 rows x 3 blocks


@pytest.mark.skipif(not NATIVE, reason=f"native CPU kernels: {cpu_native.reason()}")
@pytest.mark.parametrize("bits", [4, 5, 8, "L4"])
def test_native_packing_is_the_torch_packing_byte_for_byte(bits):
    from ninefold.ops.quantized import _pack_blocks_torch

    for n, k in ((16, 32), (37, 96), (70, 256)):  # padded last group; several blocks
        weight, _ = _weight(n, k, bits, seed=n)
        codes, d, m = _codes_of(weight)
        assert torch.equal(weight.data, _pack_blocks_torch(codes, d, m, weight.bits))


def test_stacked_block_weight_keeps_both_parts_exactly():
    weight, dense = _weight(41, 96, "4+8", seed=3)
    assert (weight.shape, weight.bits, weight.lead) == ((41, 96), 8, 32)
    assert torch.equal(weight.dequantize64(), dense)
    assert weight.nbytes == 2 * 3 * 320 + 1 * 3 * 544  # two 4-bit groups, one 8-bit group (9 rows), 3 blocks
    head, _ = _weight(16, 96, 4)
    tail, _ = _weight(9, 96, 8)
    with pytest.raises(ValueError, match="head rows must be a multiple of 16"):
        ops.BlockWeight.stacked(_weight(17, 96, 4)[0], tail)
    with pytest.raises(ValueError, match="head must be a plain 4- or 5-bit weight and tail a plain 8-bit one"):
        ops.BlockWeight.stacked(tail, head)
    with pytest.raises(ValueError, match="head must be a plain 4- or 5-bit weight"):
        ops.BlockWeight.stacked(_weight(16, 96, "L4")[0], tail)
    five, five_dense = _weight(41, 96, "5+8", seed=4)
    assert (five.bits, five.lead, five.lead_bits) == (8, 32, 5) and torch.equal(five.dequantize64(), five_dense)
    assert five.nbytes == 2 * 3 * 384 + 1 * 3 * 544


def test_block_weight_refuses_bad_input():
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    s = torch.full((16, 2), 0.5)
    with pytest.raises(ValueError, match="bits must be 4, 5 or 8, got 3"):
        ops.BlockWeight(codes, s, s, 3)
    with pytest.raises(ValueError, match="offsets are required with bits=4 or 5 and not accepted with bits=8, got "
                                         "bits=5 and no offsets"):
        ops.BlockWeight(codes, s, None, 5)
    with pytest.raises(ValueError, match="5-bit codes must lie in \\[0, 31\\], got values from 0 to 60"):
        ops.BlockWeight(codes * 4, s, s, 5)
    with pytest.raises(ValueError, match="must lie in \\[0, 15\\]"):
        ops.BlockWeight(codes * 2, s, s, 4)
    with pytest.raises(ValueError, match="K must be a positive multiple of 32"):
        ops.BlockWeight(codes[:, :48], s[:, :1], s[:, :1], 4)
    with pytest.raises(ValueError, match="scales must be exactly representable in float16"):
        ops.BlockWeight(codes, s + 1e-5, s, 4)
    with pytest.raises(TypeError, match="codes must be an integer tensor"):
        ops.BlockWeight(codes.float(), s, s, 4)
    with pytest.raises(ValueError, match="activation_terms must be 1 or 2, got 3"):
        ops.BlockWeight(codes, s, s, 4, activation_terms=3)
    levels = torch.arange(-8, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="levels must be 16 int8 values with bits=4, got 15 int8 values"):
        ops.BlockWeight(codes, s, None, 4, levels=levels[:15])
    with pytest.raises(ValueError, match="levels must be 16 int8 values with bits=4, got 16 int32 values"):
        ops.BlockWeight(codes, s, None, 4, levels=levels.int())
    with pytest.raises(ValueError, match="offsets are not accepted with levels"):
        ops.BlockWeight(codes, s, s, 4, levels=levels)
    weight = ops.BlockWeight(codes, s, s, 4)
    with pytest.raises(ops.OpError, match="x's last dimension must be weight's K = 64"):
        ops.linear_blocks(torch.zeros(2, 32), weight)
    with pytest.raises(TypeError, match="weight must be an ninefold.ops.BlockWeight"):
        ops.linear_blocks(torch.zeros(2, 64), torch.zeros(16, 64))


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_turned_off_the_torch_paths_run_and_say_so(tmp_path):
    code = ("import torch, ninefold.ops as ops; from ninefold.ops import cpu_native\n"
            "w = ops.BlockWeight(torch.ones(16, 32, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1))\n"
            "print(cpu_native.available(), ops.choose('linear_blocks', torch.ones(1, 32), w),"
            " ops.linear_blocks(torch.ones(1, 32), w)[0, 0].item())")
    off = _run(code, NINEFOLD_CPU_NATIVE="0", NINEFOLD_CACHE_DIR=str(tmp_path))
    assert off.stdout.split() == ["False", "dequantize", "32.0"], off.stderr
    assert "native CPU kernels off (NINEFOLD_CPU_NATIVE=0)" in off.stderr
    empty = tmp_path / "bin"
    empty.mkdir()
    nocc = _run(code, PATH=str(empty), CC="", NINEFOLD_CACHE_DIR=str(tmp_path))
    assert nocc.stdout.split() == ["False", "dequantize", "32.0"], nocc.stderr
    assert "no C compiler found" in nocc.stderr


@pytest.mark.skipif(not NATIVE, reason=f"native CPU kernels: {cpu_native.reason()}")
def test_first_use_compiles_into_the_cache_then_loads(tmp_path):
    code = "from ninefold.ops import cpu_native; print(cpu_native.available())"
    first = _run(code, NINEFOLD_CACHE_DIR=str(tmp_path))
    assert first.stdout.strip() == "True", first.stderr
    assert "compiling the native CPU kernels" in first.stderr
    built = list((tmp_path / "cpu_native").glob("libninefold_cpu-*.so"))
    assert len(built) == 1 and cpu_native.build_key(cpu_native._compiler()) in built[0].name
    again = _run(code, NINEFOLD_CACHE_DIR=str(tmp_path))
    assert again.stdout.strip() == "True" and "compiling" not in again.stderr


@pytest.mark.skipif(not NATIVE, reason=f"native CPU kernels: {cpu_native.reason()}")
@pytest.mark.parametrize("tier", list(cpu_native.TIER_MARCH))
def test_every_tier_this_cpu_runs_computes_what_the_references_do(tmp_path, tier):
    """Each instruction tier (portable C, AVX2, AVX-512 VNNI), built here for itself when this CPU runs it,
    through the library's own entry points: the linear kernel on both weight kinds (1, 5 and 11 rows:
    passes of 8 rows and a remainder; one and two activation terms; float32 and bf16 in and out) against
    float64, the prefill attention against float64, the row operators against the loaded build's
    ``ops`` results (themselves checked against vendor above) and the 8-bit requantization against torch. The loaded build is one of the tiers; the
    others are what CPUs of other kinds run."""
    if tier not in cpu_native.tiers_runnable_here():
        pytest.skip(f"this CPU cannot run the {tier} tier")
    try:
        lib = cpu_native.build_tier(tier, tmp_path)
    except cpu_native.TierUnsupported as error:
        pytest.skip(str(error))
    assert lib.nf_simd() == {"portable": 0, "avx2": 1, "avx512-vnni": 2}[tier]
    g = torch.Generator().manual_seed(4)
    for bits, terms, m, dtype in itertools.product((4, 5, 8, "L4", "5+8"), (1, 2), (1, 5, 11),
                                                   (torch.float32, torch.bfloat16)):
        weight, dense = _weight(40, 128, bits, seed=9 + (bits if isinstance(bits, int) else 0), terms=terms)
        x = torch.randn(m, 128, generator=g).to(dtype)
        out = torch.empty(m, 40, dtype=dtype)
        scratch = torch.empty(lib.nf_linear_scratch_bytes(m * terms, 128), dtype=torch.uint8)
        flag = int(dtype == torch.bfloat16)
        lib.nf_linear(weight.mat(), x.data_ptr(), flag, 128, m, out.data_ptr(), flag, 40, terms, scratch.data_ptr())
        want = _reference(x, dense, None, terms)
        tol = 2e-6 * 2 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * want.abs().max().item(),
                                   msg=lambda s, c=f"bits={bits} terms={terms} rows={m} {dtype}": f"{c}: {s}")
    for d in (32, 64, 80):  # 64: the value pass in 64-wide chunks; 32 and 80 in chunks of 16
        q = torch.randn(27, 4, d, generator=g)
        cu = torch.tensor([0, 20, 27], dtype=torch.int64)
        cu_k = torch.tensor([0, 20, 43], dtype=torch.int64)  # the second sequence: 7 queries after 16 cached keys
        k, v = (torch.randn(43, 2, d, generator=g) for _ in range(2))
        out = torch.empty(27, 4, d)
        scratch = torch.empty(lib.nf_attention_scratch_floats(cu_k.data_ptr(), 2, 2, d), dtype=torch.float32)
        lib.nf_attention_prefill(q.data_ptr(), 4 * d, k.data_ptr(), 2 * d, v.data_ptr(), 2 * d, 0, cu.data_ptr(),
                                 cu_k.data_ptr(), 2, 4, 2, d, 0.25, out.data_ptr(), 4 * d, scratch.data_ptr())
        want = _attention64(q, k, v, cu.tolist(), cu_k.tolist(), 0.25)
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5, msg=lambda s, c=f"head size {d}": f"{c}: {s}")
    for dtype in (torch.float32, torch.bfloat16):
        _rows_with(lib, dtype, g)
    _requantize_with(lib, g)


def _requantize_with(lib, g):
    """``nf_requantize_q8`` against torch: block maxima from float16-subnormal scales to past float16's range."""
    w = torch.randn(9, 128, generator=g) * torch.logspace(-9, 3, 9)[:, None]
    w[4, :32] = 0.0
    w[8, 0] = 65504 * 127 * 1.01  # a scale beyond float16: inf, its block's codes zero
    codes, scales = torch.empty(9, 128, dtype=torch.int8), torch.empty(9, 4)
    lib.nf_requantize_q8(w.data_ptr(), 9, 128, scales.data_ptr(), codes.data_ptr())
    want_scales = (w.reshape(9, 4, 32).abs().amax(-1) / 127).half().float()
    safe = torch.where(want_scales > 0, want_scales, torch.ones_like(want_scales))
    want_codes = torch.round(w.reshape(9, 4, 32) / safe[..., None]).clamp(-127, 127).to(torch.int8).reshape(9, 128)
    assert torch.equal(scales, want_scales) and torch.equal(codes, want_codes)
    assert ((scales > 0) & (scales < 2**-14)).sum() >= 4 and torch.isinf(scales[8, 0])  # float16-subnormal scales


def _rows_with(lib, dtype, g):
    """nf_add_rms_norm, nf_silu_and_mul and nf_rope_neox of ``lib`` against the loaded build's through ops."""
    flag = int(dtype == torch.bfloat16)
    x, r = (torch.randn(9, 104, generator=g).to(dtype) for _ in range(2))  # 104: 6 vectors of 16 and a tail
    w = torch.rand(104, generator=g) + 0.5
    out, total = torch.empty_like(x), torch.empty_like(x)
    lib.nf_add_rms_norm(x.data_ptr(), 104, r.data_ptr(), 104, w.data_ptr(), 9, 104, 1e-6, flag, out.data_ptr(),
                        total.data_ptr())
    want = ops.add_rms_norm(x, r, w, 1e-6)
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    for a, b in zip((out, total), want):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    gu = torch.randn(9, 2 * 88, generator=g).to(dtype) * 4
    act = torch.empty(9, 88, dtype=dtype)
    lib.nf_silu_and_mul(gu.data_ptr(), 2 * 88, 9, 88, flag, act.data_ptr())
    torch.testing.assert_close(act.float(), ops.silu_and_mul(gu).float(), rtol=tol, atol=tol)
    qkv = torch.randn(9, 6 * 64, generator=g).to(dtype)
    q, k = qkv[:, :256].view(9, 4, 64), qkv[:, 256:].view(9, 2, 64)
    cache = torch.randn(50, 48, generator=g)  # rotary over the first 48 of 64 features
    pos = torch.randint(0, 50, (9,), generator=g)
    qo, ko = torch.empty(9, 4, 64, dtype=dtype), torch.empty(9, 2, 64, dtype=dtype)
    lib.nf_rope_neox(q.data_ptr(), 6 * 64, k.data_ptr(), 6 * 64, pos.data_ptr(), cache.data_ptr(), 48, 9, 4, 2, 64,
                     flag, qo.data_ptr(), ko.data_ptr())
    for a, b in zip((qo, ko), ops.rope(q, k, pos, cache, True)):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def _attention64(q, k, v, cu_q, cu_k, scale):
    """Causal attention per sequence in float64, queries the last Lq of Lk positions (bottom-right)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for h in range(q.shape[1]):
            qs = q[cu_q[b]:cu_q[b + 1], h].double()
            ks, vs = k[cu_k[b]:cu_k[b + 1], h // group].double(), v[cu_k[b]:cu_k[b + 1], h // group].double()
            s = qs @ ks.T * scale
            visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            out[cu_q[b]:cu_q[b + 1], h] = torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ vs
    return out


@pytest.mark.skipif(not cpu_native.fast(), reason="native CPU kernels without vector code here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("hq,hk,d,lens", [
    (9, 3, 64, [(70, 70), (5, 5), (33, 33)]),  # packed prompts, GQA 3, tiles of 32 rows and 16 keys partly filled
    (4, 4, 32, [(3, 40), (17, 17)]),  # queries after cached keys (Lq < Lk), head size not a multiple of 64
    (2, 1, 128, [(1, 1), (48, 100)]),
])
def test_native_prefill_attention_matches_float64(dtype, hq, hk, d, lens):
    g = torch.Generator().manual_seed(len(lens) + d)
    cu_q = np.cumsum([0] + [a for a, _ in lens]).tolist()
    cu_k = np.cumsum([0] + [b for _, b in lens]).tolist()
    qkv = torch.randn((cu_q[-1], (hq + 1) * d), generator=g).to(dtype)  # q as a view with a wider row
    q = qkv[:, : hq * d].view(-1, hq, d)
    k = torch.randn((cu_k[-1], hk, d), generator=g).to(dtype)
    v = torch.randn((cu_k[-1], hk, d), generator=g).to(dtype)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    with ops.use(attention_prefill="cpu_native"):
        assert ops.choose("attention_prefill", q, k, v, cq, ck) == "cpu_native"
        out = ops.attention_prefill(q, k, v, cq, ck, scale=0.2)
    want = _attention64(q, k, v, cu_q, cu_k, 0.2)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(not cpu_native.fast(), reason="native CPU kernels without vector code here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_row_operators_run_natively_and_round_like_vendor(dtype):
    """add_rms_norm, silu_and_mul and rope on many rows dispatch to cpu_native (one row does not) and
    round at the vendor formulas' points: equal to vendor up to float32 summation order."""
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(37, 96, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(96, generator=g) + 0.5
    gu = torch.randn(37, 2 * 80, generator=g).to(dtype)
    qkv = torch.randn(37, 6 * 64, generator=g).to(dtype)
    q, k = qkv[:, :256].view(37, 4, 64), qkv[:, 256:].view(37, 2, 64)
    cache = torch.randn(100, 48, generator=g)  # rotary over the first 48 of 64 features
    pos = torch.randint(0, 100, (37,), generator=g)
    cases = (("add_rms_norm", (x, r, w, 1e-6)), ("silu_and_mul", (gu,)), ("rope", (q, k, pos, cache, True)))
    for op, args in cases:
        assert ops.choose(op, *args) == "cpu_native", op
        with ops.use(**{op: "vendor"}):
            want = getattr(ops, op)(*args)
        got = getattr(ops, op)(*args)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert a.dtype == dtype and a.shape == b.shape
            ulp = 2e-6 if dtype == torch.float32 else 8e-3  # one bf16 rounding step apart at most
            torch.testing.assert_close(a.float(), b.float(), rtol=ulp, atol=ulp)
    assert ops.choose("add_rms_norm", x[:1], r[:1], w, 1e-6) != "cpu_native"
