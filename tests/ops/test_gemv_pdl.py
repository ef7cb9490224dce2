"""The batch-1 PDL GEMV (``ninefold.ops.triton.gemv_pdl``): float64 references in the interpreter,
argument errors, the sm_90 code (weight loads before ``griddepcontrol.wait``), and PDL on CUDA."""


import pytest
import torch

triton = pytest.importorskip("triton")

from ninefold.ops.triton import gemv_pdl as gp  # noqa: E402

from .helpers import run_interpreted  # noqa: E402

# Runs in a child process with TRITON_INTERPRET=1 (set before Triton is imported).
CHECK = r"""
import torch
from ninefold.ops.triton.gemv_pdl import gemv_pdl, WORKSPACE
torch.manual_seed(0)

def rms(s, g, eps):
    return s / torch.sqrt((s * s).mean() + eps) * g

# The interpreter's bfloat16 tl.dot is wrong (Triton 3.9), so the dot loop is checked in float32 only.
for dtype, tol, dot in ((torch.float32, 1e-4, False), (torch.float32, 1e-4, True), (torch.bfloat16, 2e-2, False),
                        (torch.float32, 1e-4, 2)):
    for n, k, split_k, block_k in ((50, 256, 1, 64), (50, 256, 2, 64), (33, 512, 4, 128), (16, 128, 1, 128)):
        w = torch.randn(n, k).to(dtype)
        x, r, g = torch.randn(k).to(dtype), torch.randn(k).to(dtype), torch.randn(k).to(dtype)
        a = torch.randn(2 * k).to(dtype)
        kw = dict(dot=dot is True, depth=2 if dot == 2 and k // split_k >= 2 * block_k else 1)
        for rep in range(2):  # the second call checks that split-K counters were reset
            y = gemv_pdl(x, w, split_k=split_k, block_n=16, block_k=block_k, **kw)
            ref = w.double() @ x.double()
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            assert y.shape == (n,) and y.dtype == dtype and err < tol, ("none", dtype, n, k, split_k, err)
        r_out = torch.full_like(r, float("nan"))
        y = gemv_pdl(x, w, prologue="add_rms_norm", residual=r, norm_weight=g, residual_out=r_out, eps=1e-5,
                     split_k=split_k, block_n=16, block_k=block_k, **kw)
        s = (x.double() + r.double()).to(dtype).double()
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6
        assert ((r_out.double() - s).abs() <= ulp * s.abs() + 1e-30).all(), "residual_out"
        ref = w.double() @ rms(s, g.double(), 1e-5)
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, ("add_rms_norm", dtype, n, k, split_k, err)
        y = gemv_pdl(a, w, prologue="silu_and_mul", split_k=split_k, block_n=16, block_k=block_k, **kw)
        h = a.double()
        ref = w.double() @ (torch.nn.functional.silu(h[:k]) * h[k:])
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, ("silu_and_mul", dtype, n, k, split_k, err)
# FP8 codes with a scale per row (weight-only: x stays float32 here), every loop and prologue.
for dot in (False, True, 2):
    for n, k, split_k, block_k in ((50, 256, 1, 64), (33, 512, 4, 128)):
        scales = torch.rand(n) + 0.01
        codes = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = codes.double() * scales.double()[:, None]
        x, r, g, a = torch.randn(k), torch.randn(k), torch.randn(k), torch.randn(2 * k)
        kw = dict(dot=dot is True, depth=2 if dot == 2 and k // split_k >= 2 * block_k else 1, split_k=split_k,
                  block_n=16, block_k=block_k, scales=scales)
        r_out = torch.empty_like(r)
        for name, y, ref in (
                ("none", gemv_pdl(x, codes, **kw), w @ x.double()),
                ("add_rms_norm", gemv_pdl(x, codes, prologue="add_rms_norm", residual=r, norm_weight=g,
                                          residual_out=r_out, eps=1e-5, **kw),
                 w @ rms(x.double() + r.double(), g.double(), 1e-5)),
                ("silu_and_mul", gemv_pdl(a, codes, prologue="silu_and_mul", **kw),
                 w @ (torch.nn.functional.silu(a.double()[:k]) * a.double()[k:]))):
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            assert y.dtype == torch.float32 and err < 1e-4, ("fp8", name, dot, n, k, split_k, err)
# FP8 codes under a bfloat16 x on the tl.dot loop: both meet as float16 (x saturating at +-65504, NaN kept).
n, k = 40, 256
scales, codes = torch.rand(n) + 0.01, (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
w = codes.double() * scales.double()[:, None]
x, r, g = (torch.randn(k).to(torch.bfloat16) for _ in range(3))
r_out = torch.empty_like(r)
kw = dict(dot=True, block_n=16, block_k=64, scales=scales)
y = gemv_pdl(x, codes, prologue="add_rms_norm", residual=r, norm_weight=g, residual_out=r_out, eps=1e-5, **kw)
ref = w @ rms((x.double() + r.double()).to(torch.bfloat16).double(), g.double(), 1e-5)
err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
assert y.dtype == torch.bfloat16 and err < 2e-2, ("fp8 bf16 x dot", err)
x[5] = float("nan")
assert gemv_pdl(x, codes, **kw).isnan().all(), "a NaN in x must reach every output"
for ws, cnt in WORKSPACE._bufs.values():
    assert int(cnt.abs().sum()) == 0, "split-K counters left non-zero"
print("ok")
"""


def test_matches_float64_in_the_interpreter():
    done = run_interpreted(["-c", CHECK])
    assert done.stdout.strip().endswith("ok"), done.stdout[-3000:]


@pytest.mark.parametrize("kwargs, match", [
    (dict(prologue="gelu"), "prologue must be one of"),
    (dict(split_k=0), "split_k must be a positive int"),
    (dict(split_k=3), "multiple of split_k"),
    (dict(prologue="add_rms_norm"), "needs a contiguous residual"),
    (dict(prologue="silu_and_mul"), "one contiguous row of 512"),
    (dict(depth=3), "depth must be 1, or 2"),
    (dict(depth=2, split_k=4), "depth must be 1, or 2"),
    (dict(depth=2, dot=True), "depth must be 1, or 2"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    w, x = torch.randn(8, 256), torch.randn(256)
    with pytest.raises(ValueError, match=match):
        gp.gemv_pdl(x, w, block_k=64, **kwargs)


def test_residual_out_must_not_alias_and_dtypes_must_match():
    w, x, r, g = torch.randn(8, 64), torch.randn(64), torch.randn(64), torch.randn(64)
    with pytest.raises(ValueError, match="must not alias"):
        gp.gemv_pdl(x, w, prologue="add_rms_norm", residual=r, norm_weight=g, residual_out=r, block_k=64)
    with pytest.raises(TypeError, match="dtype"):
        gp.gemv_pdl(x.double(), w, block_k=64)
    codes = w.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"FP8 weight codes need scales, a contiguous float32 \[8\] \(one per row\), "
                                         r"got None"):
        gp.gemv_pdl(x, codes, block_k=64)
    with pytest.raises(ValueError, match=r"got torch.float16 \(8,\)"):
        gp.gemv_pdl(x, codes, block_k=64, scales=torch.ones(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="scales are for float8_e4m3fn weight codes, got a torch.float32 weight"):
        gp.gemv_pdl(x, w, block_k=64, scales=torch.ones(8))


def test_pdl_refused_without_a_hopper_gpu():
    if gp.pdl_available():
        pytest.skip("PDL is available here")
    with pytest.raises(ValueError, match="pdl=True needs"):
        gp.gemv_pdl(torch.randn(64), torch.randn(8, 64), pdl=True, block_k=64)


def _compile_sm90(prologue: int, split_k: int, dot: bool, depth: int = 1, fp8: bool = False):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = gp.gemv_pdl_kernel
    consts = dict(PROLOGUE=prologue, BLOCK_N=32, BLOCK_K=256, SPLIT_K=split_k, USE_GDC=True, DOT=dot,
                  PRECISION="tf32", NORM_BLOCK=4096, DEPTH=depth, SCALED=fp8)
    types = dict(ws_ptr="*fp32", cnt_ptr="*i32", s_ptr="*fp32", N="i32", K="i32", stride_wn="i32", eps="fp32",
                 **({"w_ptr": "*fp8e4nv"} if fp8 else {}))
    sig = {n: "constexpr" if n in consts else types.get(n, "*bf16") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig[n].startswith("*") or n in ("K", "stride_wn")}
    return triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 3, "launch_pdl": True})


@pytest.mark.skipif(not gp.pdl_api(), reason="this Triton has no gdc_wait/launch_pdl")
@pytest.mark.parametrize("prologue, split_k, dot, depth, fp8", [
    (0, 1, False, 1, False), (1, 2, False, 1, False), (2, 4, False, 1, False), (0, 1, True, 1, False),
    (1, 2, True, 1, False), (1, 1, False, 2, False), (1, 1, False, 2, True), (2, 2, False, 1, True),
    (0, 1, True, 1, True)])
def test_sm90_code_loads_weights_before_waiting(prologue, split_k, dot, depth, fp8):
    compiled = _compile_sm90(prologue, split_k, dot, depth, fp8)
    ptx = compiled.asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
    trigger = next(i for i, line in enumerate(ptx) if "griddepcontrol.launch_dependents" in line)
    early = [line for line in ptx[:wait] if "ld.global" in line]
    # a 32 x 256 tile is 8 loads of 16 bytes per thread in 16-bit weights, 4 in FP8 codes
    assert trigger < wait and len(early) >= (4 if fp8 else 8) * depth and all("evict_first" in line for line in early)
    assert compiled.metadata.launch_pdl
    if dot:  # Triton pipelines the weight stream of the tl.dot loop (asynchronous copies)
        assert any("cp.async" in line for line in ptx[wait:])
        # FP8 codes multiply as float16 (one conversion per pair of codes, none to bfloat16), bfloat16 weights as such
        text = compiled.asm["ptx"]
        assert ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text) == fp8
        assert ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text) != fp8
        assert "cvt.bf16.f16" not in text and ("cvt.rn.f16x2.e4m3x2" in text) == fp8
        assert ("max.NaN.f32" in text) == fp8  # the float16 saturation keeps NaN


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_chain_matches_float64_eager_and_in_a_graph(pdl):
    if pdl and not gp.pdl_available():
        pytest.skip("no PDL on this GPU/Triton")
    torch.manual_seed(0)
    dev, dt, k = "cuda", torch.bfloat16, 4096
    w1, w2 = torch.randn(2 * 1024, k, device=dev, dtype=dt) / 64, torch.randn(k, 1024, device=dev, dtype=dt) / 32
    x, r, g = (torch.randn(k, device=dev, dtype=dt) for _ in range(3))
    r_out = torch.empty_like(r)

    def chain():
        a = gp.gemv_pdl(x, w1, prologue="add_rms_norm", residual=r, norm_weight=g, residual_out=r_out, pdl=pdl,
                        split_k=2)
        return gp.gemv_pdl(a, w2, prologue="silu_and_mul", pdl=pdl, split_k=4)

    s = (x.double() + r.double()).to(dt).double()
    xn = (s / torch.sqrt((s * s).mean() + 1e-6) * g.double()).to(dt).double()
    a = (w1.double() @ xn).to(dt).double()
    ref = w2.double() @ (torch.nn.functional.silu(a[:1024]) * a[1024:]).to(dt).double()
    y = chain()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 3e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = chain()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y)
