"""``ninefold.bench.attention_exp2``'s kernel, compiled for sm_90 on the CPU (running it needs the GPU)."""

import re

import numpy as np
import pytest

triton = pytest.importorskip("triton")


def test_polynomial_exponential_is_accurate_to_bfloat16_and_exact_at_zero():
    from ninefold.bench.attention_exp2 import C1, C2, C3

    f = np.linspace(0.0, 1.0, 4097)
    poly = 1 + f * (C1.value + f * (C2.value + f * C3.value))
    assert np.max(np.abs(poly / 2.0 ** f - 1)) < 2e-4  # bfloat16 keeps 8 bits: 4e-3
    assert poly[0] == 1.0


def _compiled(fraction: int):
    from triton.backends.compiler import GPUTarget

    from ninefold.bench.attention_exp2 import fa_causal

    signature = {"q_desc": "tensordesc<bf16[64,128]>", "k_desc": "tensordesc<bf16[64,128]>",
                 "v_desc": "tensordesc<bf16[64,128]>", "o_ptr": "*bf16", "S": "i32", "scale_log2": "fp32",
                 "FRACTION": "constexpr", "BM": "constexpr", "BN": "constexpr", "D": "constexpr"}
    source = triton.compiler.ASTSource(fn=fa_causal, signature=signature,
                                       constexprs={"FRACTION": fraction, "BM": 64, "BN": 64, "D": 128})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}).asm["ptx"]


def test_half_of_the_exponentials_leave_the_mufu_without_shared_memory_traffic():
    ptx = {fraction: _compiled(fraction) for fraction in (0, 1, 2)}
    ex2 = {fraction: len(re.findall(r"ex2\.approx", text)) for fraction, text in ptx.items()}
    # per thread: 32 score elements in each of the two loops, plus the row rescaling factors
    assert ex2[1] < ex2[0] and ex2[0] - ex2[1] == ex2[1] - ex2[2] == 32
    shared_stores = {fraction: len(re.findall(r"st\.shared", text)) for fraction, text in ptx.items()}
    assert shared_stores[0] == shared_stores[1] == shared_stores[2]  # the column split stays in registers
