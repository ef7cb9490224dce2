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


def test_the_polynomial_takes_its_share_of_the_exponentials_without_shared_memory_traffic():
    ptx = {fraction: _compiled(fraction) for fraction in (0, 1, 2, 3)}
    ex2 = {fraction: len(re.findall(r"ex2\.approx", text)) for fraction, text in ptx.items()}
    # per thread: 32 score elements in each of the two loops, plus the row rescaling factors
    assert ex2[0] - ex2[1] == ex2[1] - ex2[2] == 32 and ex2[0] - ex2[3] == 16
    shared_stores = {fraction: len(re.findall(r"st\.shared", text)) for fraction, text in ptx.items()}
    assert len(set(shared_stores.values())) == 1  # the splits of the score tile stay in registers


_EXP2_CHECK = """
import numpy as np, torch, triton, triton.language as tl
from ninefold.bench.attention_exp2 import _exp2

@triton.jit
def apply(x_ptr, y_ptr, FRACTION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    tl.store(y_ptr + offs, _exp2(tl.load(x_ptr + offs), FRACTION, BM, BN))

x = -torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) * 40
x[3, 5] = float("-inf")
for fraction in (0, 1, 2, 3):
    y = torch.empty_like(x)
    apply[(1,)](x, y, FRACTION=fraction, BM=64, BN=64)
    want = torch.exp2(x.double())
    rel = ((y.double() - want).abs() / want.clamp_min(1e-30)).max().item()
    assert rel < 2e-4 and y[3, 5].item() < 1e-37, (fraction, rel, y[3, 5].item())
print("ok")
"""


def test_every_fraction_computes_the_same_exponentials_in_the_same_places():
    # Under Triton's interpreter: the splits, joins and permutes put every element back where it was.
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _EXP2_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-2000:]
