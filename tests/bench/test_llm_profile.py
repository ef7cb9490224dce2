"""``ninefold.bench.llm_profile``'s kernel classes (the profile itself needs a CUDA device)."""

import pytest

from ninefold.bench.llm_profile import device_timeline, kernel_kind


def test_kernels_of_a_decode_step_fall_into_their_kinds():
    names = {"decode_split_kernel": "attention", "prefill_kernel": "attention",
             "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm", "gemv_pdl_kernel": "gemm",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float>": "gemm",
             "application_fused_kernel": "norm", "rms_norm_kernel": "norm",
             "application_swiglu_kernel": "activation", "gated_kernel": "activation",
             "rope_and_cache_kernel": "rope+cache", "argmax_chunk_kernel": "sampling",
             "Memcpy HtoD (Pinned -> Device)": "copies", "some_new_kernel": "other"}
    assert {name: kernel_kind(name) for name in names} == names


def test_device_timeline_counts_the_union_and_charges_idle_to_the_kernels_around_it():
    kernels = [(30.0, 45.0, "application_fused_kernel"),  # given out of order: sorted by start
               (0.0, 10.0, "Memcpy HtoD (Pinned -> Device)"),
               (12.0, 25.0, "nvjet_sm90_tst_64x208_64x6_2x1_v_bz_TNT"),
               (20.0, 28.0, "decode_split_kernel"),  # a PDL launch: starts before the GEMM ends
               (22.0, 24.0, "rope_and_cache_kernel")]  # inside both: ends before the edge
    t = device_timeline(kernels)
    assert t["idle_us"] == pytest.approx(2.0 + 2.0)  # 10..12 and 28..30
    assert t["busy_us"] == pytest.approx(45.0 - 4.0)
    assert t["overlapping_starts"] == 2
    assert t["idle_by_pair"]["copies -> gemm"] == (pytest.approx(2.0), 1)
    assert t["idle_by_pair"]["attention -> norm"] == (pytest.approx(2.0), 1)  # the kernel that ended last
    assert t["idle_by_pair"]["gemm -> attention"] == (0.0, 1)
    assert t["idle_by_pair"]["attention -> rope+cache"] == (0.0, 1)
    assert device_timeline([]) == {"busy_us": 0.0, "idle_us": 0.0, "overlapping_starts": 0, "idle_by_pair": {}}
