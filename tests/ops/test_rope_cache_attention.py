"""``ops.rope_cache_attention_decode`` against ``rope_and_cache`` + ``attention_decode`` and float64 references.

The Triton implementation (the decode split kernel with ``ROPE``) runs under Triton's interpreter
(``test_triton_kernel_in_the_interpreter`` starts this file with TRITON_INTERPRET=1 when neither the
interpreter nor CUDA is on) and on CUDA, where it also runs with PDL and from a CUDA graph.
"""

import os

import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import references as ref

from .helpers import DTYPE_IDS, DTYPES, assert_close, call, impl_params, run_interpreted_tests
from .test_attention import ATTENTION_SCALE, paged_cache
from .test_rope import cos_sin_cache

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_RUNS = INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def _inputs(lengths, hq, hk, d, rotary, dtype, device, block_size=4, skip=(), seed=0, extra_columns=2):
    """A decode step's q/k/v as views of one fused projection row (token stride wider than the heads),
    each row's new token at position ``length - 1`` with that position's slot (``skip``: slot -1)."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = paged_cache(lengths, hk, d, block_size, dtype, device, seed=seed)
    tables = torch.cat([tables, tables[:, -1:].expand(-1, extra_columns)], 1).contiguous()
    b = len(lengths)
    row = torch.randn(b, (hq + 2 * hk) * d + 8, generator=g).to(device, dtype)
    q = row[:, : hq * d].unflatten(1, (hq, d))
    k = row[:, hq * d: (hq + hk) * d].unflatten(1, (hk, d))
    v = row[:, (hq + hk) * d: (hq + 2 * hk) * d].unflatten(1, (hk, d))
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    last = lens.long() - 1
    slots = tables.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
    for i in skip:
        slots[i] = -1
    cos_sin = cos_sin_cache(max(lengths) + 3, rotary).to(device)
    return q, k, v, last, cos_sin, k_cache, v_cache, slots, tables, lens


def _reference(q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens, is_neox):
    """float64: rope, the cache write of the rotated k (rounded to k's dtype) and v, then attention."""
    q_rot, k_rot = ref.rope(q, k, positions, cos_sin, is_neox)
    kc, vc = ref.reshape_and_cache(k_rot.to(k.dtype), v, k_cache, v_cache, slots)
    return ref.attention_decode(q_rot.to(q.dtype), kc, vc, tables, lens), kc, vc


CASES = {"gqa": ([5, 17, 1, 12], 8, 2, 16, 16, ()), "padding-row": ([3, 9, 1], 4, 2, 16, 16, (2,)),
         "partial-rotary": ([6, 2], 4, 4, 32, 16, ()), "mha-one-row": ([21], 2, 2, 16, 16, ())}


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("rope_cache_attention_decode"))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_float64_reference(device, impl, dtype, is_neox, case):
    lengths, hq, hk, d, rotary, skip = CASES[case]
    args = _inputs(lengths, hq, hk, d, rotary, dtype, device, skip=skip, seed=len(case))
    want, kc_want, vc_want = _reference(*args, is_neox)
    out = call("rope_cache_attention_decode", impl, *args, is_neox=is_neox)
    assert_close(out, want, dtype, scale=ATTENTION_SCALE)
    assert_close(args[5], kc_want, dtype)
    assert torch.equal(args[6].cpu().double(), vc_want)  # v is copied, never rounded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_vendor_is_exactly_rope_and_cache_then_attention(dtype):
    args = _inputs([5, 17, 1], 8, 2, 16, 16, dtype, "cpu", skip=(1,), seed=4)
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens = args
    kc, vc = k_cache.clone(), v_cache.clone()
    q_rot, _ = ops.rope_and_cache(q, k, v, positions, cos_sin, kc, vc, slots)
    want = ops.attention_decode(q_rot, kc, vc, tables, lens)
    with ops.use(rope_cache_attention_decode="vendor"):
        out = ops.rope_cache_attention_decode(*args)
    assert torch.equal(out, want) and torch.equal(k_cache, kc) and torch.equal(v_cache, vc)


def test_bad_inputs_name_the_operator_and_the_argument():
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens = _inputs([5, 17], 4, 2, 16, 16, torch.float32,
                                                                                  "cpu")
    op = ops.rope_cache_attention_decode
    with pytest.raises(ValueError, match=r"rope_cache_attention_decode: v must have 3 dimensions"):
        op(q, k, v[0], positions, cos_sin, k_cache, v_cache, slots, tables, lens)
    with pytest.raises(ValueError, match=r"rope_cache_attention_decode: positions must lie in \[0, 20\)"):
        op(q, k, v, positions + 10, cos_sin, k_cache, v_cache, slots, tables, lens)
    with pytest.raises(ValueError, match=r"rope_cache_attention_decode: context_lens must lie in 1\.\."):
        op(q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens * 0)
    with pytest.raises(ValueError, match=r"rope_cache_attention_decode: block_tables must have shape \(2, \*\)"):
        op(q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables[:1], lens)
    moved = slots.clone()
    moved[1] += 1
    with pytest.raises(ValueError, match=r"rope_cache_attention_decode: slot_mapping\[1\] is \d+, but the row's last "
                                         r"position \(16\) is slot \d+ of its block table"):
        op(q, k, v, positions, cos_sin, k_cache, v_cache, moved, tables, lens)
    with pytest.raises(TypeError, match=r"rope_cache_attention_decode: is_neox must be a bool"):
        op(q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens, is_neox=1)
    with pytest.raises(ValueError, match=r"rope_cache_attention_decode: scale must be"):
        op(q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens, scale=-1.0)


def _split_launch_configs():
    from ninefold.ops.triton import decode

    # (name, configuration, table columns past the contexts): the engine's defaults at a few rows and a
    # short table (one split per row), the split regime (a wide table) merged in the split kernel and by
    # the merge kernel, one KV head per program.
    return [("unsplit", decode.CONFIG, 2), ("split-one-kernel", decode.CONFIG, 300),
            ("split-two-kernels", {**decode.CONFIG, "one_kernel": 0}, 300),
            ("one-head-per-program", {**decode.CONFIG, "heads_per_program": 1}, 2)]


@pytest.mark.skipif(not TRITON_RUNS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["direct-f32", "direct-bf16"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("launch", range(4), ids=[c[0] for c in _split_launch_configs()])
def test_triton_kernel_equals_the_unfused_kernels(dtype, is_neox, launch):
    # The split kernel with ROPE against rope_and_cache's kernel then the split kernel: bit for bit under the
    # interpreter (the same float32 rotation rounded alike, the same tiles over the same cache contents); on
    # CUDA to rounding (the compiled kernels contract and order the float32 arithmetic each their own way:
    # last-bit differences in float32 on an H100), and every launch of the fused kernel bit-equal to its first.
    from ninefold.ops.triton import decode, rope_cache

    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bfloat16 wrongly")
    _, config, extra = _split_launch_configs()[launch]
    args = _inputs([7, 33, 1, 20], 8, 2, 32, 24, dtype, DEVICE, skip=(2,), seed=launch, extra_columns=extra)
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens = args
    kc, vc = k_cache.clone(), v_cache.clone()
    q_rot, _ = rope_cache.rope_and_cache(q, k, v, positions, cos_sin, kc, vc, slots, is_neox)
    want = decode.launch(q_rot, kc, vc, tables, lens, None, config)
    new = decode.NewTokens(k, v, positions, cos_sin, slots, is_neox)
    first = decode.launch(q, k_cache, v_cache, tables, lens, None, config, rope=new)
    first_k = k_cache.clone()
    if INTERPRETED:
        assert torch.equal(first, want) and torch.equal(k_cache, kc)
    else:
        assert_close(first, want.cpu().double(), dtype, scale=ATTENTION_SCALE)
        assert_close(k_cache, kc.cpu().double(), dtype)
    assert torch.equal(v_cache, vc)  # v is copied
    again = decode.launch(q, k_cache, v_cache, tables, lens, None, config, rope=new)  # merge counters were reset
    assert torch.equal(again, first) and torch.equal(k_cache, first_k) and torch.equal(v_cache, vc)


@pytest.mark.skipif(TRITON_RUNS, reason="already under the interpreter or on CUDA")
def test_triton_kernel_in_the_interpreter():
    run_interpreted_tests(["test_rope_cache_attention.py"], "(cpu-triton and not f16 and not bf16) or direct-f32",
                          at_least=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_sm90_kernel_with_pdl_writes_and_reads_activations_after_waiting(dtype):
    # With PDL the kernel reads before the wait only what the host copied (lengths, tables, positions,
    # slots) and the cos/sin table; q, the new keys/values and the cache (read or written) come after it.
    pytest.importorskip("triton")
    from ninefold.ops import workloads
    from ninefold.ops.triton import decode, gemv_pdl

    from .test_decode_pdl import _check_waits_first, _compile_pdl

    if not gemv_pdl.pdl_api():
        pytest.skip("this Triton has no gdc_wait/launch_pdl")
    variants = [v for v in decode.aot_variants("attention_decode", dtype, workloads.shapes("llama-8b"))
                if v["kernel"] is decode.decode_split_kernel]
    activation = "bf16" if dtype == torch.bfloat16 else "f16"
    for variant in variants:
        rope = {**variant, "constexprs": {**variant["constexprs"], "ROPE": True, "HALF": 64, "IS_NEOX": True}}
        compiled = _compile_pdl(rope, dtype)
        _check_waits_first(compiled, {"i32", "i64", "f32"}, activation)
        assert "st.global" in compiled.asm["ptx"] and "bar.sync" in compiled.asm["ptx"]


pdl_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")


@pdl_cuda
@pytest.mark.parametrize("regime", ["batch1-long", "batch3-ragged-split", "batch200-ragged-unsplit"])
def test_engine_shaped_step_with_pdl_and_in_a_graph_cuda(regime):
    # Llama-3-8B heads, bf16, one q/k/v projection: rope_and_cache then attention (plain launches) against
    # rope_cache_attention_decode's launch with PDL where available: equal to rounding eagerly (on an H100 a
    # few bf16 elements differ, see the test above), and every CUDA-graph replay bit-equal to the eager launch.
    from ninefold.ops.triton import decode, gemv_pdl, rope_cache

    from .test_decode_pdl import REGIMES, _Layer

    layer = _Layer(REGIMES[regime], seed=len(regime))
    b, hq, hk, d = layer.x.shape[0], layer.hq, layer.hk, layer.d
    q, k, v = (layer.x @ layer.w_qkv.T).split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(b, hq, d), k.view(b, hk, d), v.view(b, hk, d)
    plain_caches = layer.caches()
    q_rot, _ = rope_cache.rope_and_cache(q, k, v, layer.positions, layer.cos_sin, *plain_caches, layer.slots, True,
                                         pdl=False)
    want = decode.launch(q_rot, *plain_caches, layer.tables, layer.lens, None, decode.CONFIG, pdl=False)
    new = decode.NewTokens(k, v, layer.positions, layer.cos_sin, layer.slots, True)

    def fused(k_cache, v_cache):
        return decode.launch(q, k_cache, v_cache, layer.tables, layer.lens, None, decode.CONFIG,
                             pdl=gemv_pdl.pdl_available(), rope=new)

    eager_caches = layer.caches()
    eager = fused(*eager_caches)
    assert_close(eager, want.cpu().double(), torch.bfloat16, scale=ATTENTION_SCALE)
    assert_close(eager_caches[0], plain_caches[0].cpu().double(), torch.bfloat16)
    assert torch.equal(eager_caches[1], plain_caches[1])
    graph_caches = layer.caches()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused(*graph_caches)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        assert torch.equal(graph_caches[0], eager_caches[0]) and torch.equal(graph_caches[1], eager_caches[1])
    assert int(decode.counters(torch.device("cuda"), 1).abs().sum()) == 0
