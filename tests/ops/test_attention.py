import os

import pytest
import torch

from ninefold.ops import references as ref

from .helpers import DTYPE_IDS, DTYPES, assert_close, call, impl_params

# Attention sums many rounded products: looser than the elementwise tolerances.
ATTENTION_SCALE = 2.0


def paged_cache(lengths, hk, d, block_size, dtype, device, seed, spare_blocks=3):
    """Random caches with each sequence's blocks scattered at random; returns caches and tables."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq) + 1  # one padding column
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = torch.tensor(perm[start:start + n], dtype=torch.int32)
        tables[b, n:] = perm[-1]  # padding points at an unused block
        start += n
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(device, dtype)
    return k_cache, v_cache, tables.to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("attention_decode"))
@pytest.mark.parametrize("lengths,hq,hk,d,block_size", [([1], 1, 1, 8, 4), ([5, 17, 1, 32], 6, 2, 16, 8),
                                                        ([33, 70], 8, 1, 64, 16)])
def test_attention_decode_matches_reference(device, impl, dtype, lengths, hq, hk, d, block_size):
    k_cache, v_cache, tables = paged_cache(lengths, hk, d, block_size, dtype, device, seed=len(lengths))
    q = torch.randn(len(lengths), hq, d, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out = call("attention_decode", impl, q, k_cache, v_cache, tables, context_lens)
    assert out.shape == q.shape
    want = ref.attention_decode(q, k_cache, v_cache, tables, context_lens)
    assert_close(out, want, dtype, scale=ATTENTION_SCALE)


@pytest.mark.parametrize("device,impl", impl_params("attention_decode"))
def test_attention_decode_with_strided_query_and_scale(device, impl):
    k_cache, v_cache, tables = paged_cache([9, 3], 2, 32, 4, torch.float32, device, seed=4)
    q = torch.randn(2, 32, 4, generator=torch.Generator().manual_seed(1)).to(device).transpose(1, 2)
    lens = torch.tensor([9, 3], dtype=torch.int32, device=device)
    out = call("attention_decode", impl, q, k_cache, v_cache, tables, lens, scale=0.3)
    assert_close(out, ref.attention_decode(q, k_cache, v_cache, tables, lens, scale=0.3), torch.float32)


def packed(lengths, h, d, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lengths), h, d, generator=g).to(device, dtype)


def cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("attention_prefill"))
@pytest.mark.parametrize("q_lens,k_lens,hq,hk,d", [([1], [1], 1, 1, 8), ([7, 1, 20], [7, 1, 20], 4, 2, 16),
                                                   ([3, 5], [10, 5], 6, 3, 32)])
def test_attention_prefill_packed_matches_reference(device, impl, dtype, q_lens, k_lens, hq, hk, d):
    q = packed(q_lens, hq, d, dtype, device, 1)
    k, v = packed(k_lens, hk, d, dtype, device, 2), packed(k_lens, hk, d, dtype, device, 3)
    out = call("attention_prefill", impl, q, k, v, cu(q_lens, device), cu(k_lens, device))
    want = ref.attention_prefill(q, k, v, cu(q_lens, device), cu(k_lens, device))
    assert_close(out, want, dtype, scale=ATTENTION_SCALE)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("attention_prefill"))
def test_attention_prefill_reads_cached_prefix_from_paged_cache(device, impl, dtype):
    # Three sequences: a cached prefix of 0, 13 and 30 tokens plus 6, 4 and 1 new tokens.
    prefix, new = [0, 13, 30], [6, 4, 1]
    totals = [p + n for p, n in zip(prefix, new)]
    hq, hk, d, bs = 4, 2, 16, 8
    k_cache, v_cache, tables = paged_cache(totals, hk, d, bs, dtype, device, seed=7)
    q = packed(new, hq, d, dtype, device, 8)
    out = call("attention_prefill", impl, q, None, None, cu(new, device), cu(totals, device), scale=0.2,
               k_cache=k_cache, v_cache=v_cache, block_tables=tables)
    want = ref.attention_prefill(q, None, None, cu(new, device), cu(totals, device), scale=0.2,
                                 k_cache=k_cache, v_cache=v_cache, block_tables=tables)
    assert_close(out, want, dtype, scale=ATTENTION_SCALE)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("reshape_and_cache"))
def test_reshape_and_cache_writes_slots_and_skips_minus_one(device, impl, dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks, bs, hk, d = 5, 4, 2, 8
    k_cache = torch.randn(num_blocks, bs, hk, d, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, bs, hk, d, generator=g).to(device, dtype)
    slots = torch.tensor([0, 7, -1, 19, 2, -1, 11], dtype=torch.int64, device=device)
    key = torch.randn(7, hk, d, generator=g).to(device, dtype)
    value = torch.randn(7, hk, d, generator=g).to(device, dtype)
    want_k, want_v = ref.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert call("reshape_and_cache", impl, key, value, k_cache, v_cache, slots) is None
    assert torch.equal(k_cache.cpu().double(), want_k)
    assert torch.equal(v_cache.cpu().double(), want_v)


@pytest.mark.parametrize("device,impl", impl_params("reshape_and_cache"))
def test_reshape_and_cache_skipped_tokens_leave_slot_zero_alone(device, impl):
    k_cache = torch.zeros(2, 2, 1, 4, device=device)
    v_cache = torch.zeros(2, 2, 1, 4, device=device)
    key = torch.ones(3, 1, 4, device=device)
    slots = torch.tensor([-1, 3, -1], device=device)
    call("reshape_and_cache", impl, key, key * 2, k_cache, v_cache, slots)
    assert k_cache[0, 0].abs().sum() == 0 and k_cache[1, 1].sum() == 4 and v_cache[1, 1].sum() == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_attention_kernels_at_model_sizes_cuda(dtype):
    """Triton against the vendor implementation at Llama-3-8B head shapes and long ragged contexts."""
    import ninefold.ops as ops

    device, hq, hk, d, bs = "cuda", 32, 8, 128, 16
    lengths = [1, 17, 1000, 4097, 300]
    k_cache, v_cache, tables = paged_cache(lengths, hk, d, bs, dtype, device, seed=11)
    q = torch.randn(len(lengths), hq, d, device=device, dtype=dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    got = ops.run("attention_decode", "triton", q, k_cache, v_cache, tables, lens)
    want = ops.run("attention_decode", "vendor", q.float(), k_cache.float(), v_cache.float(), tables, lens)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    new = [1, 17, 1, 129, 64]  # new tokens per sequence (<= its length): the rest is a cached prefix
    qp = torch.randn(sum(new), hq, d, device=device, dtype=dtype)
    args = (qp, None, None, cu(new, device), cu(lengths, device))
    got = ops.run("attention_prefill", "triton", *args, k_cache=k_cache, v_cache=v_cache, block_tables=tables)
    want = ops.run("attention_prefill", "vendor", qp.float(), None, None, cu(new, device), cu(lengths, device),
                   k_cache=k_cache.float(), v_cache=v_cache.float(), block_tables=tables)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


TRITON_RUNS = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
triton_only = pytest.mark.skipif(not TRITON_RUNS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def _triton_device():
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@triton_only
@pytest.mark.parametrize("config", [dict(block_m=16, block_n=32), dict(block_m=32, block_n=16),
                                    dict(block_m=32, block_n=32)], ids=["cpu-triton-m16n32", "cpu-triton-m32n16",
                                                                        "cpu-triton-m32n32"])
def test_triton_prefill_launch_configs_cross_the_diagonal(config):
    # Long enough for tiles wholly below the diagonal (unmasked loop) and tiles crossing it (masked loop),
    # with a query block size different from the key block size, packed and through a paged prefix.
    from ninefold.ops.triton import prefill

    device, hq, hk, d = _triton_device(), 4, 2, 16
    config = {**config, "num_warps": 4, "num_stages": 1}
    q_lens, k_lens = [70, 1, 45, 33], [70, 1, 130, 33]
    q = packed(q_lens, hq, d, torch.float32, device, 11)
    k, v = packed(k_lens, hk, d, torch.float32, device, 12), packed(k_lens, hk, d, torch.float32, device, 13)
    args = (q, k, v, cu(q_lens, device), cu(k_lens, device), None, None, None, None)
    assert_close(prefill.launch(*args, config), ref.attention_prefill(*args[:5]), torch.float32, scale=ATTENTION_SCALE)
    k_cache, v_cache, tables = paged_cache(k_lens, hk, d, 8, torch.float32, device, seed=14)
    out = prefill.launch(q, None, None, cu(q_lens, device), cu(k_lens, device), 0.3, k_cache, v_cache, tables, config)
    want = ref.attention_prefill(q, None, None, cu(q_lens, device), cu(k_lens, device), scale=0.3, k_cache=k_cache,
                                 v_cache=v_cache, block_tables=tables)
    assert_close(out, want, torch.float32, scale=ATTENTION_SCALE)


@triton_only
@pytest.mark.parametrize("config", [dict(per_sm=1, heads_fastest=0), dict(per_sm=64, heads_fastest=1, min_tiles=1)],
                         ids=["cpu-triton-few-splits", "cpu-triton-many-splits-heads-fastest"])
def test_triton_decode_launch_configs(config):
    from ninefold.ops.triton import decode

    device, hq, hk, d = _triton_device(), 8, 2, 16
    lengths = [1, 50, 200, 17]
    k_cache, v_cache, tables = paged_cache(lengths, hk, d, 16, torch.float32, device, seed=21)
    q = torch.randn(len(lengths), hq, d, generator=torch.Generator().manual_seed(22)).to(device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    config = {"block_n": 32, "num_warps": 4, "num_stages": 1, **config}
    out = decode.launch(q, k_cache, v_cache, tables, lens, None, config)
    assert_close(out, ref.attention_decode(q, k_cache, v_cache, tables, lens), torch.float32, scale=ATTENTION_SCALE)


def test_prefill_rejects_bad_max_seqlen():
    import ninefold.ops as ops

    q = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="max_seqlen_q must be a positive int"):
        ops.attention_prefill(q, q, q, cu([3], "cpu"), cu([3], "cpu"), max_seqlen_q=0)
    with pytest.raises(ValueError, match="max_seqlen_k must be a positive int"):
        ops.attention_prefill(q, q, q, cu([3], "cpu"), cu([3], "cpu"), max_seqlen_k=2.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("attention_prefill"))
def test_attention_prefill_takes_max_seqlen_bounds(device, impl, dtype):
    q_lens, k_lens = [7, 1, 20], [9, 1, 20]
    q = packed(q_lens, 4, 16, dtype, device, 31)
    k, v = packed(k_lens, 2, 16, dtype, device, 32), packed(k_lens, 2, 16, dtype, device, 33)
    out = call("attention_prefill", impl, q, k, v, cu(q_lens, device), cu(k_lens, device), max_seqlen_q=20,
               max_seqlen_k=20)
    assert_close(out, ref.attention_prefill(q, k, v, cu(q_lens, device), cu(k_lens, device)), dtype,
                 scale=ATTENTION_SCALE)


def test_triton_prefill_config_follows_the_mean_query_length(monkeypatch):
    # Short, medium and long calls take different tiles (head size 128); head size 64 has no medium class.
    pytest.importorskip("triton")
    from ninefold.ops.triton import prefill

    monkeypatch.setattr(prefill, "_OVERRIDE", {})  # NINEFOLD_TRITON_PREFILL in the environment would apply to all

    picks = {mean: prefill.config(torch.bfloat16, 128, mean) for mean in (1, 64, 65, 1024, 1025, 4096)}
    assert picks[1] == picks[64] == prefill.SHORT_CONFIG
    assert picks[65] == picks[1024] == prefill.MEDIUM_CONFIG[128]
    assert picks[1025] == picks[4096] == prefill.CONFIG[128]
    assert prefill.config(torch.bfloat16, 128, 500, max_keys=2048) == prefill.MEDIUM_CONFIG[128]
    assert prefill.config(torch.bfloat16, 128, 500, max_keys=2049) == prefill.CONFIG[128]  # over a long cached prefix
    assert prefill.config(torch.bfloat16, 128, 32, max_keys=8192) == prefill.SHORT_CONFIG
    assert prefill.config(torch.bfloat16, 64, 500) == prefill.CONFIG[64]
    assert prefill.config(torch.float32, 128, 500)["block_m"] == 32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mean", [1, 500, 4096], ids=["short-tiles", "medium-tiles", "long-tiles"])
def test_triton_prefill_launch_configs_cuda(mean):
    """Llama-3-8B heads in bfloat16 under each default configuration, packed keys and paged keys."""
    from ninefold.ops.triton import prefill

    device, hq, hk, d = "cuda", 32, 8, 128
    q_lens, k_lens = [1, 300, 129, 700], [1, 300, 200, 700]
    q = packed(q_lens, hq, d, torch.bfloat16, device, 41)
    k, v = packed(k_lens, hk, d, torch.bfloat16, device, 42), packed(k_lens, hk, d, torch.bfloat16, device, 43)
    args = (q, k, v, cu(q_lens, device), cu(k_lens, device), None, None, None, None)
    config = prefill.config(torch.bfloat16, d, mean)
    want = ref.attention_prefill(*args[:5])
    assert_close(prefill.launch(*args, config), want, torch.bfloat16, scale=ATTENTION_SCALE)
    k_cache, v_cache, tables = paged_cache(k_lens, hk, d, 16, torch.bfloat16, device, seed=44)
    paged_args = (q, None, None, cu(q_lens, device), cu(k_lens, device), None, k_cache, v_cache, tables)
    want_paged = ref.attention_prefill(q, None, None, *args[3:5], k_cache=k_cache, v_cache=v_cache, block_tables=tables)
    assert_close(prefill.launch(*paged_args, config), want_paged, torch.bfloat16, scale=ATTENTION_SCALE)


@triton_only
@pytest.mark.parametrize("per_sm", [1, 16], ids=["cpu-triton-per-sm-1", "cpu-triton-per-sm-16"])
def test_triton_decode_block_table_much_wider_than_the_context(per_sm):
    # CUDA graphs size block tables for the longest sequence: splits divide each real length.
    from ninefold.ops.triton import decode

    device, hq, hk, d, bs = _triton_device(), 4, 2, 16, 16
    lengths = [3, 40, 1]
    k_cache, v_cache, tables = paged_cache(lengths, hk, d, bs, torch.float32, device, seed=51)
    wide = torch.cat([tables, tables[:, -1:].expand(-1, 30)], 1)  # padding columns point at a spare block
    q = torch.randn(len(lengths), hq, d, generator=torch.Generator().manual_seed(52)).to(device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out = decode.launch(q, k_cache, v_cache, wide, lens, None, dict(decode.CONFIG, per_sm=per_sm, min_tiles=1))
    assert_close(out, ref.attention_decode(q, k_cache, v_cache, wide, lens), torch.float32, scale=ATTENTION_SCALE)
