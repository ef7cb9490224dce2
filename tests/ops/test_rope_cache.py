"""``ops.rope_and_cache`` against the unfused ``rope`` + ``reshape_and_cache`` and float64 references.

The Triton kernel runs under Triton's interpreter (``test_triton_kernel_in_the_interpreter`` starts
this file with TRITON_INTERPRET=1 when neither the interpreter nor CUDA is on) and on CUDA.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import references as ref

from .helpers import DTYPE_IDS, DTYPES, assert_close, call, impl_params, run_interpreted_tests
from .test_rope import cos_sin_cache

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_RUNS = INTERPRETED or torch.cuda.is_available()


def _inputs(t, hq, hk, d, rotary, dtype, device, strided=False, num_blocks=6, block_size=4, skip=(), seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        if strided:  # rows of a fused qkv projection: token stride wider than the heads
            wide = torch.randn(shape[0], shape[1] * shape[2] + 5, generator=g).to(device, dtype)
            return wide[:, : shape[1] * shape[2]].unflatten(1, shape[1:])
        return torch.randn(*shape, generator=g).to(device, dtype)

    q, k, v = rand(t, hq, d), rand(t, hk, d), rand(t, hk, d)
    positions = torch.randint(0, 50, (t,), generator=g).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    for i in skip:
        slots[i] = -1
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(device, dtype)
    return q, k, v, positions, cos_sin_cache(50, rotary).to(device), k_cache, v_cache, slots.to(device)


def _unfused(q, k, v, positions, cache, k_cache, v_cache, slots, is_neox):
    """float64 references of rope then reshape_and_cache (the cached k rounded to k's dtype first)."""
    q_want, k_want = ref.rope(q, k, positions, cache, is_neox)
    k_cache, v_cache = ref.reshape_and_cache(k_want.to(k.dtype), v, k_cache, v_cache, slots)
    return q_want, k_want, k_cache, v_cache


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("rope_and_cache"))
@pytest.mark.parametrize("t,hq,hk,d,rotary,strided,skip", [(1, 1, 1, 16, 16, False, ()),
                                                           (7, 6, 2, 16, 16, True, (3,)),
                                                           (5, 4, 4, 24, 12, False, (0, 4))],
                         ids=["one-token", "gqa-strided-skip", "partial-rotary"])
def test_rope_and_cache_matches_reference(device, impl, dtype, is_neox, t, hq, hk, d, rotary, strided, skip):
    args = _inputs(t, hq, hk, d, rotary, dtype, device, strided=strided, skip=skip, seed=t)
    q_want, k_want, kc_want, vc_want = _unfused(*args, is_neox)
    q_out, k_out = call("rope_and_cache", impl, *args, is_neox)
    assert_close(q_out, q_want, dtype)
    assert_close(k_out, k_want, dtype)
    kc, vc = args[5], args[6]
    assert_close(kc, kc_want, dtype)
    assert torch.equal(vc.cpu().double(), vc_want)  # v is copied, never rounded


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_vendor_is_exactly_the_unfused_ops(is_neox):
    # The CPU path of the engine must not change: the vendor implementation is rope + reshape_and_cache.
    for dtype in (torch.float32, torch.bfloat16):
        args = _inputs(6, 4, 2, 16, 16, dtype, "cpu", skip=(2,), seed=5)
        kc, vc = args[5].clone(), args[6].clone()
        q1, k1 = ops.rope(*args[:2], args[3], args[4], is_neox)
        ops.reshape_and_cache(k1, args[2], kc, vc, args[7])
        with ops.use(rope_and_cache="vendor"):
            q2, k2 = ops.rope_and_cache(*args, is_neox=is_neox)
        assert torch.equal(q1, q2) and torch.equal(k1, k2)
        assert torch.equal(kc, args[5]) and torch.equal(vc, args[6])


def test_bad_inputs_name_the_argument():
    q, k, v, positions, cache, k_cache, v_cache, slots = _inputs(3, 4, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"rope_and_cache: v must have 3 dimensions"):
        ops.rope_and_cache(q, k, v[0], positions, cache, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match=r"rope_and_cache: .*value must have key's shape"):
        ops.rope_and_cache(q, k, v[:, :1], positions, cache, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match=r"rope_and_cache: .*positions"):
        ops.rope_and_cache(q, k, v, positions[:2], cache, k_cache, v_cache, slots)
    with pytest.raises(TypeError, match=r"rope_and_cache: slot_mapping must be int32 or int64, got float32"):
        ops.rope_and_cache(q, k, v, positions, cache, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match=r"rope_and_cache: k_cache must be"):
        ops.rope_and_cache(q, k, v, positions, cache, k_cache[:, :, :1], v_cache[:, :, :1], slots)
    with pytest.raises(TypeError, match=r"rope_and_cache: k_cache is float64 but key is float32"):
        ops.rope_and_cache(q, k, v, positions, cache, k_cache.double(), v_cache.double(), slots)
    with pytest.raises(TypeError, match=r"rope_and_cache: is_neox must be a bool"):
        ops.rope_and_cache(q, k, v, positions, cache, k_cache, v_cache, slots, is_neox=1)


@pytest.mark.skipif(not TRITON_RUNS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["direct-f32", "direct-f16"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("tokens", [1, 4], ids=["one-per-program", "four-per-program"])
def test_triton_kernel_equals_unfused_kernels(dtype, is_neox, tokens):
    # The fused kernel against the unfused Triton kernels, bit for bit (same float32 math, same rounding).
    from ninefold.ops.triton import cache, rope, rope_cache

    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    args = _inputs(7, 6, 2, 32, 24, dtype, device, strided=True, num_blocks=4, block_size=8, skip=(1, 5), seed=9)
    q, k, v, positions, cos_sin, k_cache, v_cache, slots = args
    kc, vc = k_cache.clone(), v_cache.clone()
    rope.OVERRIDE.update({"tokens": tokens, "num_warps": 2})
    try:
        q1, k1 = rope.rope(q, k, positions, cos_sin, is_neox)
        cache.reshape_and_cache(k1, v, kc, vc, slots)
        q2, k2 = rope_cache.rope_and_cache(*args, is_neox)
    finally:
        rope.OVERRIDE.clear()
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)


@pytest.mark.skipif(TRITON_RUNS, reason="already under the interpreter or on CUDA")
@pytest.mark.parametrize("file,select,least", [("test_rope_cache.py", "(cpu-triton and not f16 and not bf16) or direct", 14),
                                               ("test_attention_decode_merge.py", "", 20)])
def test_triton_kernels_in_the_interpreter(file, select, least):
    # This file's Triton cases and the one-kernel decode attention's tests, through Triton's interpreter.
    run_interpreted_tests([file], select, at_least=least)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_triton_kernel_compiles_for_sm90(dtype):
    # What the launcher runs at Llama-3-8B heads (both rotary layouts), compiled here for the H200.
    pytest.importorskip("triton")
    from ninefold.ops import workloads
    from ninefold.ops.triton import aot, rope_cache

    target = aot.parse_target("cuda:90")
    variants = [aot.Variant("rope_and_cache", **v)
                for v in rope_cache.aot_variants("rope_and_cache", dtype, workloads.shapes("llama-8b"))]
    assert {v.constexprs["IS_NEOX"] for v in variants} == {True, False}
    for variant in variants:
        compiled = aot.compile_variant(variant, dtype, target)
        assert ".target sm_90" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 1000


def test_trimmed_build_without_it_raises_unsupported(tmp_path):
    # llama's attention catches exactly this and falls back to rope + reshape_and_cache.
    from ninefold.ops import build

    (tmp_path / "ops.toml").write_text('[ops.rope]\nimpls = ["vendor"]\n[ops.reshape_and_cache]\nimpls = ["vendor"]\n')
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    code = ("import torch, ninefold.ops as ops\n"
            "from tests.ops.test_rope_cache import _inputs\n"
            "args = _inputs(3, 4, 2, 16, 16, torch.float32, 'cpu')\n"
            "try:\n    ops.rope_and_cache(*args)\nexcept ops.UnsupportedError as e:\n    print('unsupported:', e)\n"
            "q, k = ops.rope(args[0], args[1], args[3], args[4])\n"
            "ops.reshape_and_cache(k, args[2], args[5], args[6], args[7])\nprint('pair ran')\n")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NINEFOLD_OPS_BUILD": str(tmp_path / "b")},
                         capture_output=True, text=True, cwd=root, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("unsupported: rope_and_cache") and lines[-1] == "pair ran", lines
