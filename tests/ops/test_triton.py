"""The Triton kernels: they compile for the H200 (sm_90) here, and run under Triton's interpreter."""


import pytest
import torch

triton = pytest.importorskip("triton")

from ninefold.ops import workloads  # noqa: E402

from .helpers import run_interpreted_tests  # noqa: E402

OPS = ["rms_norm", "add_rms_norm", "softmax", "silu_and_mul", "gelu_and_mul", "rope", "reshape_and_cache",
       "attention_decode", "attention_prefill"]


# Elementwise kernels compile the same code for every dtype: bfloat16 covers them; attention
# kernels also take float32 (full-precision dots).
@pytest.mark.parametrize("op,dtype", [(op, torch.bfloat16) for op in OPS] +
                         [(op, torch.float32) for op in OPS if op.startswith("attention")])
def test_kernels_compile_for_sm90(op, dtype):
    from ninefold.ops.triton import aot
    target = aot.parse_target("cuda:90")
    found = aot.variants(op, dtype, workloads.shapes("llama-8b"))
    assert found, f"no kernel variants for {op}"
    for variant in found:
        compiled = aot.compile_variant(variant, dtype, target)
        assert len(compiled.asm["cubin"]) > 1000
        assert ".target sm_90" in compiled.asm["ptx"]


def test_bad_target_is_named():
    from ninefold.ops.triton import aot

    with pytest.raises(ValueError, match="--target: expected cuda:<sm>"):
        aot.parse_target("sm90")


def test_triton_kernels_match_references_in_the_interpreter():
    # The same reference tests, run on the CPU through Triton's interpreter (float32, tiny sizes).
    run_interpreted_tests(["test_norm.py", "test_elementwise.py", "test_rope.py", "test_attention.py"],
                          "cpu-triton and not f16 and not bf16", at_least=15, timeout=None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_attention_launchers_list_variants_that_compile_for_sm90(dtype):
    # What the attention launchers say they run (both prefill tile shapes, packed and paged; decode split + merge).
    from ninefold.ops.triton import aot, decode, prefill

    target = aot.parse_target("cuda:90")
    shapes = workloads.shapes("llama-8b")
    found = [aot.Variant(op, **v) for op, module in (("attention_decode", decode), ("attention_prefill", prefill))
             for v in module.aot_variants(op, dtype, shapes)]
    assert {v.kernel for v in found} == {decode.decode_split_kernel, decode.decode_merge_kernel, prefill.prefill_kernel}
    assert {v.constexprs["PAGED"] for v in found if v.kernel is prefill.prefill_kernel} >= {1}
    for variant in found:
        assert ".target sm_90" in aot.compile_variant(variant, dtype, target).asm["ptx"]
