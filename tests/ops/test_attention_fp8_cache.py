"""KV caches of FP8 codes (``float8_e4m3fn``, ``kv_cache_dtype="fp8"``): writes round to the nearest code and
saturate at +-448, every implementation reads the codes widened to the query's dtype."""

import os
import re

import pytest
import torch

from ninefold import ops
from ninefold.llm.config import ModelConfig, rope_cos_sin_cache
from ninefold.ops import references as ref
from ninefold.ops.attention import KV_FP8

from .helpers import assert_close, call, impl_params, run_interpreted
from .test_attention import ATTENTION_SCALE, cu, packed, paged_cache

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["f32", "bf16"]


def fp8_caches(lengths, hk, d, block_size, device, seed):
    """Paged caches of FP8 codes spread over their range (values up to about +-12), and their tables."""
    k, v, tables = paged_cache(lengths, hk, d, block_size, torch.float32, device, seed)
    return (3 * k).to(KV_FP8), (3 * v).to(KV_FP8), tables


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("device,impl", impl_params("reshape_and_cache"))
def test_writes_round_to_the_nearest_code_saturate_and_skip_minus_one(device, impl, dtype):
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter rounds halves away from zero (the GPU's cvt.rn rounds them to even)")
    g = torch.Generator().manual_seed(0)
    key = (200 * torch.randn(5, 2, 16, generator=g)).to(device, dtype)  # many beyond +-448
    value = torch.randn(5, 2, 16, generator=g).to(device, dtype)
    slots = torch.tensor([3, -1, 0, 9, 14], device=device)
    k8 = torch.zeros(4, 4, 2, 16, dtype=KV_FP8, device=device)
    v8 = torch.zeros_like(k8)
    call("reshape_and_cache", impl, key, value, k8, v8, slots)
    want_k, want_v = torch.zeros(4, 4, 2, 16, dtype=KV_FP8), torch.zeros(4, 4, 2, 16, dtype=KV_FP8)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // 4, s % 4] = key[t].cpu().float().clamp(-448, 448).to(KV_FP8)
            want_v[s // 4, s % 4] = value[t].cpu().float().to(KV_FP8)
    assert torch.equal(k8.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v8.cpu().view(torch.uint8), want_v.view(torch.uint8))
    assert k8.float().abs().max() == 448  # saturated, not NaN


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("device,impl", impl_params("attention_decode"))
def test_decode_reads_the_widened_codes(device, impl, dtype):
    lengths = [5, 17, 1, 32]
    k8, v8, tables = fp8_caches(lengths, 2, 16, 8, device, seed=3)
    q = torch.randn(len(lengths), 6, 16, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out = call("attention_decode", impl, q, k8, v8, tables, lens)
    assert out.dtype == dtype
    assert_close(out, ref.attention_decode(q, k8, v8, tables, lens), dtype, scale=ATTENTION_SCALE)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("device,impl", impl_params("attention_prefill"))
def test_prefill_over_a_cached_prefix_reads_the_widened_codes(device, impl, dtype):
    prefix, new = [0, 13, 30], [6, 4, 1]
    totals = [p + n for p, n in zip(prefix, new)]
    k8, v8, tables = fp8_caches(totals, 2, 16, 8, device, seed=7)
    q = packed(new, 4, 16, dtype, device, 8)
    args = (q, None, None, cu(new, device), cu(totals, device))
    out = call("attention_prefill", impl, *args, scale=0.2, k_cache=k8, v_cache=v8, block_tables=tables)
    want = ref.attention_prefill(*args, scale=0.2, k_cache=k8, v_cache=v8, block_tables=tables)
    assert_close(out, want, dtype, scale=ATTENTION_SCALE)


def test_fused_rope_and_cache_writes_the_codes_the_unfused_pair_writes():
    """rope_and_cache (one Triton kernel on GPUs) against rope, then reshape_and_cache."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    t, hq, hk, d, bs = 3, 4, 2, 64, 8
    q, k, v = (torch.randn(t, h, d, generator=g).to(device, torch.bfloat16) for h in (hq, hk, hk))
    k, v = 300 * k, 300 * v  # many beyond +-448: the fused kernel saturates as the unfused write does
    positions = torch.tensor([4, 11, 0], device=device)
    mc = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], hidden_size=hq * d, intermediate_size=8,
                                    num_attention_heads=hq, num_key_value_heads=hk, num_hidden_layers=1, vocab_size=8,
                                    head_dim=d))
    cos_sin = rope_cos_sin_cache(mc, 64, torch.device(device))
    slots = torch.tensor([2, 9, 17], device=device)
    caches = [torch.zeros(4, bs, hk, d, dtype=KV_FP8, device=device) for _ in range(4)]
    fused = ops.rope_and_cache(q, k, v, positions, cos_sin, caches[0], caches[1], slots)
    rq, rk = ops.rope(q, k, positions, cos_sin)
    ops.reshape_and_cache(rk, v, caches[2], caches[3], slots)
    torch.testing.assert_close(fused[0], rq)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):  # codes equal up to one step of rounding
        torch.testing.assert_close(got.float(), want.float(), rtol=0.07, atol=2 ** -9)
    assert caches[0].float().abs().sum() > 0 and caches[1].float().abs().max() == 448


def test_triton_refuses_fp8_caches_before_compute_capability_8_9(monkeypatch):
    """Triton has no fp8e4nv before sm_89 (A100, RTX 30xx): the torch implementations serve FP8 caches there."""
    from types import SimpleNamespace

    from ninefold.ops.triton import cache

    gpu = SimpleNamespace(dtype=KV_FP8, device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability 8.9" in cache.fp8_cache_refusal(gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cache.fp8_cache_refusal(gpu) is None
    assert cache.fp8_cache_refusal(SimpleNamespace(dtype=torch.bfloat16, device=gpu.device)) is None


def test_rope_folded_into_decode_attention_writes_and_reads_the_codes_as_the_unfused_calls():
    """rope_cache_attention_decode (on GPUs one kernel that rotates, caches and attends) against rope_and_cache, then
    attention_decode, over FP8 caches that already hold each sequence's earlier tokens."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(6)
    b, hq, hk, d, bs = 3, 8, 2, 64, 16
    lengths = [9, 40, 1]
    k8, v8, tables = fp8_caches(lengths, hk, d, bs, device, seed=11)
    q, k, v = (torch.randn(b, h, d, generator=g).to(device, torch.bfloat16) for h in (hq, hk, hk))
    positions = torch.tensor([n - 1 for n in lengths], device=device)
    slots = torch.stack([tables[i, (n - 1) // bs].long() * bs + (n - 1) % bs for i, n in enumerate(lengths)])
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    mc = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], hidden_size=hq * d, intermediate_size=8,
                                    num_attention_heads=hq, num_key_value_heads=hk, num_hidden_layers=1, vocab_size=8,
                                    head_dim=d))
    cos_sin = rope_cos_sin_cache(mc, 64, torch.device(device))
    folded_k, folded_v = k8.clone(), v8.clone()
    out = ops.rope_cache_attention_decode(q, k, v, positions, cos_sin, folded_k, folded_v, slots, tables, lens)
    rq, _ = ops.rope_and_cache(q, k, v, positions, cos_sin, k8, v8, slots)
    want = ops.attention_decode(rq, k8, v8, tables, lens)
    torch.testing.assert_close(folded_k.float(), k8.float(), rtol=0.07, atol=2 ** -9)
    assert torch.equal(folded_v.view(torch.uint8), v8.view(torch.uint8))
    torch.testing.assert_close(out.float(), want.float(), rtol=0.02, atol=0.02)


def test_a_cache_of_another_float_dtype_is_still_refused():
    q = torch.randn(1, 2, 16, dtype=torch.bfloat16)
    k16 = torch.zeros(2, 4, 2, 16, dtype=torch.float16)
    with pytest.raises(TypeError, match="attention_decode: k_cache is float16 but q is bfloat16"):
        ops.attention_decode(q, k16, k16, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    mixed = torch.zeros(2, 4, 2, 16, dtype=KV_FP8)
    with pytest.raises(TypeError, match="k_cache is float8_e4m3fn but v_cache is float16; both hold q's dtype or both"):
        ops.attention_decode(q, mixed, k16, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))


def _compiled_for_sm90(name: str, cache_dtype: torch.dtype) -> str:
    """The PTX of the Triton kernel ``name`` launches over caches of ``cache_dtype`` (Llama-3-8B heads, bfloat16
    activations), recorded on meta tensors and compiled here for an H100/H200 as the GPU's JIT would."""
    from ninefold.ops.triton import aot, cache, decode, launch, prebuilt, prefill, rope_cache

    meta, bf16 = "meta", torch.bfloat16
    b, hq, hk, d, bs = 64, 32, 8, 128, 16
    q, k = torch.empty(b, hq, d, dtype=bf16, device=meta), torch.empty(b, hk, d, dtype=bf16, device=meta)
    kc = torch.empty(256, bs, hk, d, dtype=cache_dtype, device=meta)
    tables, lens = torch.empty(b, 16, dtype=torch.int32, device=meta), torch.empty(b, dtype=torch.int32, device=meta)
    pos, slots = torch.empty(b, dtype=torch.int64, device=meta), torch.empty(b, dtype=torch.int64, device=meta)
    cos_sin, cu = torch.empty(4096, d, device=meta), torch.empty(5, dtype=torch.int32, device=meta)
    calls = {
        "decode": lambda: decode.attention_decode(q, kc, kc, tables, lens, None),
        "rope_fold": lambda: decode.rope_cache_attention_decode(q, k, k, pos, cos_sin, kc, kc, slots, tables, lens, None,
                                                                True),
        "prefill": lambda: prefill.attention_prefill(torch.empty(512, hq, d, dtype=bf16, device=meta), None, None, cu,
                                                     cu, None, kc, kc, tables[:4], 128, 256),
        "cache": lambda: cache.reshape_and_cache(k, k, kc, kc, slots),
        "rope_cache": lambda: rope_cache.rope_and_cache(q, k, k, pos, cos_sin, kc, kc, slots, True),
    }
    with aot.sized_as(132), launch.recording() as recorded:
        calls[name]()
    kernel, values, warps, stages = recorded[0]
    spec = prebuilt.specialisation(kernel, values)
    return aot.compile_spec(kernel, spec, warps, stages, aot.parse_target("cuda:90")).asm["ptx"]


@pytest.mark.parametrize("name", ["decode", "rope_fold", "prefill", "cache", "rope_cache"])
def test_triton_kernels_over_fp8_caches_compile_for_sm90(name):
    """Every Triton kernel that reads or writes the cache compiles over FP8 codes (widened with cvt from e4m3 to the
    float16 of the dot products; writes clamped, then rounded with satfinite), and over a bfloat16 cache stores
    without any clamp."""
    pytest.importorskip("triton")
    ptx = _compiled_for_sm90(name, KV_FP8)
    assert ".target sm_90" in ptx and "e4m3" in ptx
    writes = name in ("rope_fold", "cache", "rope_cache")
    if writes:  # the clamp keeps NaN (min/max .NaN: in bf16 from Triton 3.9, in f32 on 3.6), the conversion
        # rounds to nearest and saturates
        assert "cvt.rn.satfinite.e4m3x2" in ptx
        assert re.search(r"min\.NaN\.(bf16|f32)", ptx) and re.search(r"max\.NaN\.(bf16|f32)", ptx)
        plain = _compiled_for_sm90(name, torch.bfloat16)
        assert "e4m3" not in plain and "min.NaN" not in plain and "max.NaN" not in plain
    if name in ("decode", "rope_fold", "prefill"):  # reads: codes widen to float16 in one cvt per pair, the dots
        # multiply float16 (bfloat16 would take a second conversion per code)
        assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx
        assert re.search(r"mma\S*\.f32\.f16\.f16", ptx) and not re.search(r"mma\S*\.bf16", ptx)
        assert "max.NaN.f32" in ptx and "min.NaN.f32" in ptx  # the queries' float16 saturation keeps NaN


# Runs with TRITON_INTERPRET=1: Triton's decode and prefill over FP8 caches, called directly with bfloat16 queries
# (the float16 dot path; CPU dispatch would give Triton float32 queries only), against float64.
INTERPRETED_BF16 = r"""
import torch
from ninefold.ops import references as ref
from ninefold.ops.triton import decode, prefill
g = torch.Generator().manual_seed(0)
bs, hk, d = 8, 2, 16
k, v = ((3 * torch.randn(20, bs, hk, d, generator=g)).to(torch.float8_e4m3fn) for _ in range(2))
tables = torch.randperm(20, generator=g)[:16].view(4, 4).int()
lens = torch.tensor([5, 17, 1, 32], dtype=torch.int32)
q = torch.randn(4, 6, d, generator=g).to(torch.bfloat16)
out = decode.attention_decode(q, k, v, tables, lens, None)
err = (out.double() - ref.attention_decode(q, k, v, tables, lens)).abs().max().item()
assert out.dtype == torch.bfloat16 and err < 5e-2, ("decode", err)
cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 12, 29], dtype=torch.int32)
qp = torch.randn(7, 6, d, generator=g).to(torch.bfloat16)
out = prefill.attention_prefill(qp, None, None, cu_q, cu_k, None, k, v, tables[:2], 4, 17)
want = ref.attention_prefill(qp, None, None, cu_q, cu_k, k_cache=k, v_cache=v, block_tables=tables[:2])
err = (out.double() - want).abs().max().item()
assert out.dtype == torch.bfloat16 and err < 5e-2, ("prefill", err)
print("ok")
"""


def test_triton_attention_over_fp8_caches_with_bfloat16_queries_in_the_interpreter():
    assert run_interpreted(["-c", INTERPRETED_BF16]).stdout.strip().endswith("ok")
