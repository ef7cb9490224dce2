"""PDL launches of the row kernels of a batched decode step (RMS norm with and without the residual
add, SwiGLU): sm_90 code that waits for the kernel before, and on a CUDA card the same bits as plain
launches, alone and in a captured chain with the kernels around them."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ninefold.ops.triton import activation, aot, norm, pdl  # noqa: E402

from .helpers import decode_mlp_operands  # noqa: E402

POINTERS = {"x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"}


def _spec(kernel, constexprs):
    spec = []
    for name in kernel.arg_names:
        if name in constexprs:
            spec.append(("constexpr", constexprs[name]))
        elif name.endswith("_ptr"):
            spec.append(("*bf16", "D"))
        elif name == "eps":
            spec.append(("fp32", ""))
        else:
            spec.append(("i32", ""))
    return spec


@pytest.mark.parametrize("gdc", [False, True])
@pytest.mark.parametrize("which", ["rms_norm", "add_rms_norm_rows", "silu_and_mul"])
def test_row_kernels_wait_for_the_kernel_before_only_with_pdl(which, gdc):
    if which == "silu_and_mul":
        kernel = activation.gated_kernel
        consts = {"ACT": 0, "BLOCK": 1024, "FLAT": False, "STORE": "", "LOAD": "evict_first", "USE_GDC": gdc}
    elif which == "rms_norm":
        kernel = norm.rms_norm_kernel
        consts = {"HAS_RESIDUAL": False, "BLOCK_D": 4096, "STORE": "", "LOAD": "evict_first", "USE_GDC": gdc}
    else:
        kernel = norm.rms_norm_rows_kernel
        consts = {"HAS_RESIDUAL": True, "BLOCK_R": 4, "BLOCK_D": 1024, "STORE": "", "LOAD": "evict_first",
                  "USE_GDC": gdc}
    ptx = aot.compile_spec(kernel, _spec(kernel, consts), 4, 2, aot.parse_target("cuda:90")).asm["ptx"]
    assert ".target sm_90" in ptx
    assert ("griddepcontrol.wait" in ptx) == gdc
    assert ("griddepcontrol.launch_dependents" in ptx) == gdc


CUDA = torch.cuda.is_available()


def _step(x, residual, g, w_up, w_down):
    """The MLP half of a decode layer: add_rms_norm -> gate_up -> SwiGLU -> down -> add_rms_norm."""
    h, residual = norm.add_rms_norm(x, residual, g, 1e-5)
    a = activation.silu_and_mul(F.linear(h, w_up))
    out, residual = norm.add_rms_norm(F.linear(a, w_down), residual, g, 1e-5)
    return norm.rms_norm(out, g, 1e-5), residual


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 37, 192])
def test_pdl_and_plain_launches_agree_eagerly_and_in_a_cuda_graph(rows, monkeypatch):
    if not pdl.wanted(torch.device("cuda"), "NINEFOLD_ROWS_PDL"):
        pytest.skip("PDL is not available on this card or Triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    d, f = 4096, 14336
    x, residual, gain, w_up, w_down = decode_mlp_operands(rows, d, f, g)
    monkeypatch.setenv("NINEFOLD_ROWS_PDL", "0")
    want = _step(x, residual, gain, w_up, w_down)
    monkeypatch.setenv("NINEFOLD_ROWS_PDL", "1")
    got = _step(x, residual, gain, w_up, w_down)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(x, residual, gain, w_up, w_down)
    for _ in range(3):
        x.copy_(torch.randn(rows, d, device="cuda", generator=g).to(torch.bfloat16))
        graph.replay()
        monkeypatch.setenv("NINEFOLD_ROWS_PDL", "0")
        want = _step(x, residual, gain, w_up, w_down)
        monkeypatch.setenv("NINEFOLD_ROWS_PDL", "1")
        torch.cuda.synchronize()
        for a, b in zip(captured, want):
            assert torch.equal(a, b)
