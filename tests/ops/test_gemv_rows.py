"""The few-rows PDL GEMV (``ninefold.ops.triton.gemv_rows``): float64 references in the interpreter,
argument errors, the sm_90 code (weight loads before ``griddepcontrol.wait``), and CUDA (eager, PDL,
CUDA graphs)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from ninefold.ops.triton import gemv_pdl as gp  # noqa: E402
from ninefold.ops.triton import gemv_rows as gr  # noqa: E402

from .helpers import run_interpreted  # noqa: E402


def _normed(x, r, g, dtype, eps):
    """float64 ``rms_norm(x + r) * g`` per row with the kernel's roundings to ``dtype``, and the rounded sum."""
    s = (x.double() + r.double()).to(dtype).double()
    normed = (s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps)).to(dtype).double() * g.double()
    return normed.to(dtype).double(), s


def _gated(a, dtype):
    """float64 ``silu(gate) * up`` per row of ``a = [gate, up]`` with the kernel's roundings to ``dtype``."""
    k, h = a.shape[-1] // 2, a.double()
    return (torch.nn.functional.silu(h[:, :k]).to(dtype).double() * h[:, k:]).to(dtype).double()


def _references(x, w, r, g, a, dtype, eps=1e-5):
    """float64 (want, residual sum) for the three prologues, rounding where the kernel rounds."""
    normed, s = _normed(x, r, g, dtype, eps)
    wd = w.double()
    return {"none": x.double() @ wd.T, "add_rms_norm": normed @ wd.T, "silu_and_mul": _gated(a, dtype) @ wd.T}, s


# Runs in a child process with TRITON_INTERPRET=1 (set before Triton is imported). The interpreter's
# bfloat16 tl.dot is wrong (Triton 3.9): float32 and float16 only.
CHECK = r"""
import torch
from ninefold.ops.triton.gemv_rows import gemv_rows
from ninefold.ops.triton.gemv_pdl import WORKSPACE
from tests.ops.test_gemv_rows import _references
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
    for m, n, k, split_k, block_k in ((2, 50, 256, 1, 64), (5, 50, 256, 2, 64), (16, 33, 512, 4, 128),
                                      (9, 16, 128, 1, 128), (20, 40, 256, 2, 64)):
        w = torch.randn(n, k).to(dtype)
        x, r = torch.randn(m, k).to(dtype), torch.randn(m, k).to(dtype)
        g, a = torch.randn(k).to(dtype), torch.randn(m, 2 * k).to(dtype)
        want, s = _references(x, w, r, g, a, dtype)
        for prologue in ("none", "add_rms_norm", "silu_and_mul"):
            for rep in range(2):  # the second call checks that split-K counters were reset
                r_out = torch.full_like(r, float("nan"))
                kw = dict(residual=r, norm_weight=g, residual_out=r_out, eps=1e-5) if prologue == "add_rms_norm" else {}
                y = gemv_rows(a if prologue == "silu_and_mul" else x, w, prologue=prologue, split_k=split_k,
                              block_n=16, block_k=block_k, **kw)
                ref = want[prologue]
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                assert y.shape == (m, n) and y.dtype == dtype and err < tol, (prologue, dtype, m, n, k, split_k, err)
                if prologue == "add_rms_norm":
                    ulp = 2.0 ** -10 if dtype == torch.float16 else 1e-6
                    assert ((r_out.double() - s).abs() <= ulp * s.abs() + 1e-30).all(), "residual_out"
# FP8 codes with a scale per row, x kept in its dtype (weight-only)
for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
    for m, n, k, split_k, block_k in ((3, 50, 256, 1, 64), (16, 33, 512, 4, 128)):
        scales = torch.rand(n) + 0.01
        codes = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = codes.double() * scales.double()[:, None]
        x, r = torch.randn(m, k).to(dtype), torch.randn(m, k).to(dtype)
        g, a = torch.randn(k).to(dtype), torch.randn(m, 2 * k).to(dtype)
        want, s = _references(x, w, r, g, a, dtype)
        for prologue in ("none", "add_rms_norm", "silu_and_mul"):
            kw = dict(residual=r, norm_weight=g, residual_out=torch.empty_like(r), eps=1e-5) if prologue == "add_rms_norm" else {}
            y = gemv_rows(a if prologue == "silu_and_mul" else x, codes, prologue=prologue, split_k=split_k,
                          block_n=16, block_k=block_k, scales=scales, **kw)
            ref = want[prologue]
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            assert y.dtype == dtype and err < tol, ("fp8", prologue, dtype, m, n, k, split_k, err)
for ws, cnt in WORKSPACE._bufs.values():
    assert int(cnt.abs().sum()) == 0, "split-K counters left non-zero"
print("ok")
"""


def test_matches_float64_in_the_interpreter():
    done = run_interpreted(["-c", CHECK])
    assert done.stdout.strip().endswith("ok"), done.stdout[-3000:]


@pytest.mark.parametrize("rows, kwargs, match", [
    (4, dict(prologue="gelu"), "prologue must be one of"),
    (4, dict(split_k=0), "split_k must be a positive int"),
    (4, dict(split_k=True), "split_k must be a positive int"),
    (4, dict(split_k=3), "multiple of split_k"),
    (4, dict(prologue="add_rms_norm"), r"needs a contiguous \[4, 256\] residual"),
    (4, dict(prologue="silu_and_mul"), r"x must be a contiguous \[M, 512\] tensor"),
    (1, {}, r"2 <= M <= 32 .* got shape \(1, 256\)"),
    (33, {}, r"2 <= M <= 32 .* got shape \(33, 256\)"),
])
def test_bad_arguments_raise_value_error(rows, kwargs, match):
    w, x = torch.randn(8, 256), torch.randn(rows, 256)
    with pytest.raises(ValueError, match=match):
        gr.gemv_rows(x, w, block_k=64, **kwargs)


def test_residual_out_must_not_alias_norm_weight_must_fit_and_dtypes_must_match():
    w, x, r, g = torch.randn(8, 64), torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    with pytest.raises(ValueError, match="must not alias"):
        gr.gemv_rows(x, w, prologue="add_rms_norm", residual=r, norm_weight=g, residual_out=r, block_k=64)
    with pytest.raises(ValueError, match="norm_weight of 64 elements"):
        gr.gemv_rows(x, w, prologue="add_rms_norm", residual=r, norm_weight=g[:32], residual_out=r.clone(),
                     block_k=64)
    with pytest.raises(TypeError, match="dtype"):
        gr.gemv_rows(x.double(), w, block_k=64)
    with pytest.raises(ValueError, match=r"gemv_rows: FP8 weight codes need scales"):
        gr.gemv_rows(x, w.to(torch.float8_e4m3fn), block_k=64)


def test_pdl_refused_without_a_hopper_gpu():
    if gp.pdl_available():
        pytest.skip("PDL is available here")
    with pytest.raises(ValueError, match="pdl=True needs"):
        gr.gemv_rows(torch.randn(2, 64), torch.randn(8, 64), pdl=True, block_k=64)


def _compile_sm90(prologue: int, split_k: int, block_m: int, fp8: bool = False):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = gr.gemv_rows_kernel
    consts = dict(PROLOGUE=prologue, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=256, SPLIT_K=split_k, USE_GDC=True,
                  PRECISION="tf32", NORM_BLOCK=gr.NORM_BLOCK, SCALED=fp8)
    types = dict(ws_ptr="*fp32", cnt_ptr="*i32", s_ptr="*fp32", M="i32", N="i32", K="i32", stride_x="i32",
                 stride_wn="i32", eps="fp32", **({"w_ptr": "*fp8e4nv"} if fp8 else {}))
    sig = {n: "constexpr" if n in consts else types.get(n, "*bf16") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig[n].startswith("*") or n in ("K", "stride_x", "stride_wn")}
    return triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 3, "launch_pdl": True})


@pytest.mark.skipif(not gp.pdl_api(), reason="this Triton has no gdc_wait/launch_pdl")
@pytest.mark.parametrize("prologue, split_k, block_m, fp8", [(0, 1, 16, False), (1, 2, 16, False), (2, 1, 16, False),
                                                             (2, 4, 32, False), (1, 1, 32, False), (1, 1, 16, True),
                                                             (2, 2, 16, True)])
def test_sm90_code_loads_weights_before_waiting(prologue, split_k, block_m, fp8):
    compiled = _compile_sm90(prologue, split_k, block_m, fp8)
    ptx = compiled.asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
    trigger = next(i for i, line in enumerate(ptx) if "griddepcontrol.launch_dependents" in line)
    early = [line for line in ptx[:wait] if "ld.global" in line]
    # a 32 x 256 tile is 8 loads of 16 bytes per thread in 16-bit weights, 4 in FP8 codes
    assert trigger < wait and len(early) >= (4 if fp8 else 8) and all("evict_first" in line for line in early)
    assert compiled.metadata.launch_pdl
    assert any("cp.async" in line for line in ptx[wait:])  # Triton pipelines the weight stream of the loop


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("rows", [2, 7, 16, 29])
def test_cuda_chain_matches_float64_eager_and_in_a_graph(pdl, rows):
    if pdl and not gp.pdl_available():
        pytest.skip("no PDL on this GPU/Triton")
    torch.manual_seed(rows)
    dev, dt, k = "cuda", torch.bfloat16, 4096
    w1, w2 = torch.randn(2 * 1024, k, device=dev, dtype=dt) / 64, torch.randn(k, 1024, device=dev, dtype=dt) / 32
    x, r = torch.randn(rows, k, device=dev, dtype=dt), torch.randn(rows, k, device=dev, dtype=dt)
    g = torch.randn(k, device=dev, dtype=dt)
    r_out = torch.empty_like(r)

    def chain():
        a = gr.gemv_rows(x, w1, prologue="add_rms_norm", residual=r, norm_weight=g, residual_out=r_out, pdl=pdl,
                         split_k=2)
        return gr.gemv_rows(a, w2, prologue="silu_and_mul", pdl=pdl, split_k=4)

    xn, _ = _normed(x, r, g, dt, 1e-6)
    ref = _gated((xn @ w1.double().T).to(dt), dt) @ w2.double().T
    y = chain()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 3e-2
    assert torch.equal(r_out, (x.float() + r.float()).to(dt))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = chain()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y)
