"""The LoRA delta kernels (``ninefold.ops.triton.lora``): float64 references in the interpreter (row tiles of 16
and 64, K divided among programs, adapter columns in several tiles, rows without an adapter), the operands they
refuse, the sm_90 code, and on CUDA the same products in bfloat16 against torch's three-kernel form."""

import pytest
import torch

triton = pytest.importorskip("triton")

from ninefold.ops.triton import lora as lk  # noqa: E402

from .helpers import run_interpreted  # noqa: E402


def reference(x, a, b, row_slots, per_slot, y):
    """float64 ``y + ((x @ a) * mask) @ b`` with the kernels' rounding of ``x @ a`` to the weights' dtype."""
    mask = (row_slots[:, None] == torch.arange(a.shape[1], device=x.device)[None, :] // per_slot).double()
    down = (x.double() @ a.double()).to(a.dtype).double() * mask
    return y.double() + down @ b.double()


CASES = [(1, 96, 48, 130, 4), (5, 200, 64, 70, 4), (20, 128, 192, 256, 4), (32, 100, 64, 50, 2), (70, 64, 16, 40, 1), (3, 4096, 192, 64, 4),
         (130, 72, 128, 129, 4)]

CHECK = f"""
import torch
from ninefold.ops.triton import lora as lk
import tests.ops.test_lora_kernels as t
torch.manual_seed(0)
for T, K, W, N, slots in {CASES!r}:
    per = W // slots
    x, a = torch.randn(T, K).half(), (torch.randn(K, W) / K**0.5).half()
    b, y = (torch.randn(W, N) * 0.1).half(), torch.randn(T, N).half()
    rows = torch.randint(-1, slots, (T,))
    rows[0] = -1  # a row without an adapter keeps y
    want = t.reference(x, a, b, rows, per, y)
    got = lk.lora_add(x, a, b, rows, per, y.clone())
    err = ((got.double() - want).abs() / want.abs().clamp_min(1)).max().item()
    assert err < 2e-3, (T, K, W, N, err)
    assert torch.equal(got[0], y[0])
    assert not lk._COUNTERS[x.device][-1].any()  # left at zero for the next call
print("ok")
"""


def test_matches_float64_in_the_interpreter():
    assert "ok" in run_interpreted(["-c", CHECK]).stdout


@pytest.mark.parametrize("change, message", [
    (lambda x, a, b, y: (x.float(), a.float(), b.float(), y.float()), "float16 or bfloat16"),
    (lambda x, a, b, y: (x, a, b.half(), y), "got bfloat16, bfloat16, float16, bfloat16"),
    (lambda x, a, b, y: (x[:, :-1], a, b, y), "shapes"),
    (lambda x, a, b, y: (x, a, b, y.t().contiguous().t()), "contiguous"),
    (lambda x, a, b, y: (x.repeat(129, 1), a, b, y.repeat(129, 1)), "at most 512 rows (more: cuBLAS's GEMMs); got 516"),
    (lambda x, a, b, y: (x[:, :0], a[:0], b, y), "K >= 1; got x (4, 0), A (0, 16)"),
])
def test_refuses_what_it_cannot_run(change, message):
    x, a, b, y = (torch.zeros(s, dtype=torch.bfloat16) for s in ((4, 32), (32, 16), (16, 24), (4, 24)))
    assert lk.supports(x, a, b, y) is None
    assert message in lk.supports(*change(x, a, b, y))


def _compile_sm90(kernel, types: dict, consts: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in consts else types[n] for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n].startswith("*")}
    return triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 2})


@pytest.mark.parametrize("bt", [16, 32, 64])
def test_compiles_for_sm90(bt):
    ints = dict.fromkeys(("T", "K", "W", "N", "splits", "per_slot", "stride_x", "stride_a", "stride_b",
                          "stride_y", "k_per_split"), "i32")
    shrink = _compile_sm90(lk.lora_shrink_kernel, {**ints, "x_ptr": "*bf16", "a_ptr": "*bf16", "slot_ptr": "*i64",
                                                   "part_ptr": "*fp32", "down_ptr": "*bf16", "count_ptr": "*i32"},
                           dict(BT=bt, BK=lk.BK, BW=lk.BW))
    expand = _compile_sm90(lk.lora_expand_kernel, {**ints, "down_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16"},
                           dict(BT=bt, BN=lk.BN, BW=lk.BW))
    for compiled in (shrink, expand):
        assert "mma" in compiled.asm["ptx"]  # the products run on tensor cores
    assert "atom" in shrink.asm["ptx"]  # the arrival counter


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 16, 32, 77, 256])
def test_cuda_bfloat16_against_torch(T):
    g = torch.Generator(device="cuda").manual_seed(T)
    K, W, N, slots = 4096, 192, 6144, 4
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
    a = (torch.randn(K, W, device="cuda", generator=g) / K**0.5).bfloat16()
    b = (torch.randn(W, N, device="cuda", generator=g) * 0.05).bfloat16()
    y = torch.randn(T, N, device="cuda", generator=g).bfloat16()
    rows = torch.randint(-1, slots, (T,), device="cuda", generator=g)
    want = reference(x, a, b, rows, W // slots, y)
    got = lk.lora_add(x, a, b, rows, W // slots, y.clone())
    graph_out = y.clone()
    lk.lora_add(x, a, b, rows, W // slots, graph_out.clone())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lk.lora_add(x, a, b, rows, W // slots, graph_out)
    for _ in range(2):  # each replay finds the counters at zero again
        graph_out.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, got)  # the partials add up in one order, whichever program arrives last
    err = ((got.double() - want).abs() / want.abs().clamp_min(1)).max().item()
    assert err < 1e-2, err  # one bfloat16 rounding of the output


def test_row_slots_must_match_the_rows():
    x, a, b, y = (torch.zeros(s, dtype=torch.bfloat16) for s in ((4, 32), (32, 16), (16, 24), (4, 24)))
    with pytest.raises(ValueError, match=r"row_slots: expected \[4\] on cpu; got \[3\] on cpu"):
        lk.lora_add(x, a, b, torch.zeros(3, dtype=torch.int64), 4, y)
