"""``ninefold.bench.llm_profile``'s kernel classes (the profile itself needs a CUDA device)."""

from ninefold.bench.llm_profile import kernel_kind


def test_kernels_of_a_decode_step_fall_into_their_kinds():
    names = {"decode_split_kernel": "attention", "prefill_kernel": "attention",
             "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm", "gemv_pdl_kernel": "gemm",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float>": "gemm",
             "application_fused_kernel": "norm", "rms_norm_kernel": "norm",
             "application_swiglu_kernel": "activation", "gated_kernel": "activation",
             "rope_and_cache_kernel": "rope+cache", "argmax_chunk_kernel": "sampling",
             "Memcpy HtoD (Pinned -> Device)": "copies", "some_new_kernel": "other"}
    assert {name: kernel_kind(name) for name in names} == names
