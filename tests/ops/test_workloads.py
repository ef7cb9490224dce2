"""The tuning/benchmark workloads: every operator's calls build, validate and agree across implementations."""

import pytest
import torch

import ninefold.ops as ops
from ninefold.bench.ops import bench_case, check
from ninefold.ops import dispatch, workloads


@pytest.mark.parametrize("op", workloads.OPS)
def test_tiny_workloads_run_every_cpu_implementation_and_agree(op):
    ceiling = {"copy_GBps": 10.0, "mm_TFLOPs": 1.0}
    cases = list(workloads.cases(op, workloads.shapes("tiny"), "cpu", torch.float32))
    assert cases
    for case in cases:
        row = bench_case(case, torch.device("cpu"), ceiling)
        assert row["choice"] == ops.choose(op, *case.args, **case.kwargs)
        for name, entry in row["impls"].items():
            assert "error" not in entry and "wrong" not in entry, (name, entry)
            assert entry["us"] > 0


@pytest.mark.parametrize("shape_set", ["llama-8b", "smollm2"])
def test_model_workloads_validate_at_full_size(shape_set):
    # Built on the meta device: full Llama-3-8B sizes without the memory; validation runs for real.
    for op in workloads.OPS:
        for case in workloads.cases(op, workloads.shapes(shape_set), "meta", torch.bfloat16):
            operator = dispatch.operator(op)
            key = operator.keyfn(*operator.bind(*case.args, **case.kwargs))
            assert key[0].type == "meta" and key[1] == torch.bfloat16
            assert case.bytes > 0 or case.flops > 0


def test_check_flags_a_wrong_result():
    x, w = torch.randn(4, 8), torch.ones(8)
    want = ops.rms_norm(x, w)
    assert check("rms_norm", lambda *a: want + 1, (x, w, 1e-6), want).startswith("max relative error")
    assert check("rms_norm", lambda *a: want, (x, w, 1e-6), want) is None


@pytest.mark.parametrize("op", workloads.CACHE_OPS)
def test_fp8_cache_workloads_run_every_cpu_implementation_and_agree(op):
    """The cache operators' calls over FP8 caches (what ``kv_cache_dtypes = ["fp8"]`` builds): caches of codes,
    half the KV bytes, labels that say so; every CPU implementation that takes them agrees."""
    ceiling = {"copy_GBps": 10.0, "mm_TFLOPs": 1.0}
    tiny = workloads.shapes("tiny")
    fp8 = list(workloads.cases(op, tiny, "cpu", torch.bfloat16, cache_dtype=torch.float8_e4m3fn))
    plain = list(workloads.cases(op, tiny, "cpu", torch.bfloat16))
    assert fp8 and all("float8_e4m3fn cache" in c.label for c in fp8)
    caches = [a for c in fp8 for a in (*c.args, *c.kwargs.values()) if torch.is_tensor(a) and a.dim() == 4]
    assert caches and all(t.dtype == torch.float8_e4m3fn for t in caches)
    if op == "attention_decode":
        assert [c.bytes * 2 for c in fp8] == [c.bytes for c in plain]
    for case in fp8:
        row = bench_case(case, torch.device("cpu"), ceiling)
        assert row["impls"] and all("error" not in e and "wrong" not in e for e in row["impls"].values()), row


def test_a_cache_dtype_for_an_operator_without_a_cache_is_refused():
    with pytest.raises(ValueError, match="cache_dtype: rms_norm reads no KV cache; only reshape_and_cache"):
        list(workloads.cases("rms_norm", workloads.shapes("tiny"), "cpu", torch.bfloat16,
                             cache_dtype=torch.float8_e4m3fn))


def test_prefill_workloads_cover_every_tile_class_packed_and_paged():
    """The Llama-3-8B prefill calls reach each of the Triton prefill attention's tile configurations (up to 64 new
    tokens per prompt, up to 1024 over at most 2048 keys, more), packed and over a paged cache (over FP8 codes: every
    class paged), so a trimmed build holds a binary for each chunk an engine runs."""
    pytest.importorskip("triton")
    from ninefold.ops.triton import aot, prefill

    shapes = workloads.shapes("llama-8b")
    configs = {(c["block_m"], c["block_n"], c["num_warps"], c["num_stages"])
               for c in (prefill.config(torch.bfloat16, 128, mean, keys) for mean, keys in ((16, 64), (512, 1024),
                                                                                           (4096, 4096)))}
    assert len(configs) == 3
    for cache_dtype, modes in ((None, {0, 1}), (torch.float8_e4m3fn, {1})):
        found, notes = aot.launches("attention_prefill", torch.bfloat16, shapes, 132, cache_dtype)
        assert not notes
        reached = {(spec_value(kernel, spec, "BLOCK_M"), spec_value(kernel, spec, "BLOCK_N"), warps, stages,
                    spec_value(kernel, spec, "PAGED")) for kernel, spec, warps, stages in found}
        assert reached == {(*c, mode) for c in configs for mode in modes}, cache_dtype


def spec_value(kernel, spec, name):
    return spec[kernel.arg_names.index(name)][1]


@pytest.mark.parametrize("shape_set", ["llama-8b", "smollm2", "tiny"])
def test_decode_positions_stay_inside_the_rotary_table(shape_set):
    """Each decode row's new token sits at position context - 1: the cos/sin table must hold it (the CUDA kernels
    do not check, so a short table would be read out of bounds)."""
    for case in workloads.cases("rope_cache_attention_decode", workloads.shapes(shape_set), "meta", torch.bfloat16):
        context = int(case.label.split("ctx=")[1].split()[0])
        assert case.args[4].shape[0] >= context, case.label
