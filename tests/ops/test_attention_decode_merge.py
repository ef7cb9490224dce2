"""Triton decode attention merged in one launch: the last split of a (sequence, KV head) merges.

Runs under Triton's interpreter (TRITON_INTERPRET=1, tiny sizes) or on CUDA; skipped otherwise.
"""

import os

import pytest
import torch

from ninefold.ops import references as ref

from .helpers import assert_close
from .test_attention import ATTENTION_SCALE, paged_cache

TRITON_RUNS = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not TRITON_RUNS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def _device():
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _case(lengths, hq, hk, d, dtype, seed, extra_columns=0):
    device = _device()
    k_cache, v_cache, tables = paged_cache(lengths, hk, d, 16, dtype, device, seed=seed)
    if extra_columns:  # CUDA graphs' full-width tables: padding columns point at a spare block
        tables = torch.cat([tables, tables[:, -1:].expand(-1, extra_columns)], 1)
    q = torch.randn(len(lengths), hq, d, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, lens


def _config(**extra):
    from ninefold.ops.triton import decode

    return {**decode.CONFIG, "block_n": 32, "num_stages": 1, "per_sm": 16, "min_tiles": 1, "min_split": 0,
            "heads_per_program": 1, "heads_fastest": 0, "merge_rows": 64, "split_config": {}, **extra}


@pytest.mark.parametrize("heads_fastest", [0, 1], ids=["seqs-fastest", "heads-fastest"])
@pytest.mark.parametrize("hq,hk,merge_rows", [(8, 2, 32), (6, 2, 4), (4, 4, 1)],
                         ids=["group4-one-step", "group3-many-steps", "group1-split-per-step"])
def test_one_kernel_merge_matches_reference_and_two_kernel_path(heads_fastest, hq, hk, merge_rows):
    # merge_rows below the live splits: the merge combines them over several steps.
    from ninefold.ops.triton import decode

    args = _case([1, 50, 200, 17, 96], hq, hk, 16, torch.float32, seed=61, extra_columns=9)
    with decode_launches() as kernels:
        one = decode.launch(*args, None, _config(one_kernel=1, heads_fastest=heads_fastest, merge_rows=merge_rows))
    assert kernels == ["decode_split_kernel"]
    with decode_launches() as kernels:
        two = decode.launch(*args, None, _config(one_kernel=0, heads_fastest=heads_fastest))
    assert kernels == ["decode_split_kernel", "decode_merge_kernel"]
    want = ref.attention_decode(*args)
    assert_close(one, want, torch.float32, scale=ATTENTION_SCALE)
    torch.testing.assert_close(one, two, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("one_kernel", [1, 0], ids=["one-kernel", "two-kernels"])
def test_min_split_gives_fewer_longer_splits(one_kernel):
    from ninefold.ops.triton import decode

    args = _case([1, 50, 200, 17, 96], 8, 2, 16, torch.float32, seed=65, extra_columns=9)
    out = decode.launch(*args, None, _config(one_kernel=one_kernel, min_split=70))  # rounded up to 96 keys
    assert_close(out, ref.attention_decode(*args), torch.float32, scale=ATTENTION_SCALE)


@pytest.mark.parametrize("heads,hq,hk,one_kernel", [(2, 8, 2, 1), (4, 16, 4, 1), (2, 6, 2, 0), (4, 4, 4, 1), (3, 8, 2, 1)],
                         ids=["2-of-2-group4", "4-of-4-group4", "2-of-2-group3-two-kernels", "4-mha", "3-falls-back"])
@pytest.mark.parametrize("per_sm", [1, 16], ids=["unsplit", "split"])
def test_several_kv_heads_per_program(heads, hq, hk, one_kernel, per_sm):
    # One program reads a token's adjacent KV heads; each query row sees only its own head's keys.
    from ninefold.ops.triton import decode

    args = _case([1, 50, 200, 17], hq, hk, 16, torch.float32, seed=68, extra_columns=5)
    config = _config(heads_per_program=heads, one_kernel=one_kernel, per_sm=per_sm)
    out = decode.launch(*args, None, config)
    assert_close(out, ref.attention_decode(*args), torch.float32, scale=ATTENTION_SCALE)


def test_split_config_applies_only_when_the_context_is_split(monkeypatch):
    from ninefold.ops.triton import decode

    monkeypatch.setattr(decode, "_sm_count", lambda device: 4)  # the split sizing below assumes 4 SMs (H200: 132)
    config = _config(split_config={"one_kernel": 0, "min_split": 64})
    few = _case([50, 200], 8, 2, 16, torch.float32, seed=66, extra_columns=3)  # 4 programs: split
    with decode_launches() as kernels:
        out = decode.launch(*few, None, config)
    assert kernels == ["decode_split_kernel", "decode_merge_kernel"]
    assert_close(out, ref.attention_decode(*few), torch.float32, scale=ATTENTION_SCALE)
    many = _case([40] * 32, 8, 2, 16, torch.float32, seed=67)  # 64 programs = per_sm 16 x 4 "SMs": unsplit
    with decode_launches() as kernels:
        out = decode.launch(*many, None, config)
    assert kernels == ["decode_split_kernel"]
    assert_close(out, ref.attention_decode(*many), torch.float32, scale=ATTENTION_SCALE)


def test_counters_return_to_zero_so_launches_repeat():
    # What a CUDA-graph replay relies on: no memset between launches, the merging program resets its counter.
    from ninefold.ops.triton import decode

    args = _case([70, 33, 5], 4, 2, 16, torch.float32, seed=62, extra_columns=4)
    first = decode.launch(*args, None, _config())
    used = decode.counters(args[0].device, 3 * 2)
    assert int(used.abs().sum()) == 0
    again = decode.launch(*args, None, _config())
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    assert used is decode.counters(args[0].device, 6)  # persistent: the same buffer serves later launches


def test_counter_buffer_grows_and_keeps_old_buffers():
    from ninefold.ops.triton import decode

    device = torch.device(_device())
    small = decode.counters(device, 1)
    assert small.numel() >= decode.MIN_COUNTERS and small.dtype == torch.int32 and int(small.abs().sum()) == 0
    big = decode.counters(device, decode.MIN_COUNTERS + 1)
    assert big.numel() == decode.MIN_COUNTERS + 1 and int(big.abs().sum()) == 0
    assert any(t is small for t in decode._COUNTERS[device])  # a captured graph may still point at it


def test_context_of_zero_keys_gives_zeros_not_nan():
    # Padded rows of a CUDA graph batch carry context length 0: every split is empty.
    from ninefold.ops.triton import decode

    q, k_cache, v_cache, tables, lens = _case([40, 1], 4, 1, 16, torch.float32, seed=63, extra_columns=3)
    lens[1] = 0
    out = decode.launch(q, k_cache, v_cache, tables, lens, None, _config())
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[:1], ref.attention_decode(q[:1], k_cache, v_cache, tables[:1], lens[:1]), torch.float32,
                 scale=ATTENTION_SCALE)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter computes bfloat16 dots wrongly (both paths)"))],
    ids=["cpu-triton-f16", "cpu-triton-bf16"])
def test_one_kernel_merge_half_precision(dtype):
    from ninefold.ops.triton import decode

    args = _case([90, 3, 64], 8, 2, 32, dtype, seed=64, extra_columns=2)
    out = decode.launch(*args, None, _config())
    assert_close(out, ref.attention_decode(*args), dtype, scale=ATTENTION_SCALE)


class decode_launches:
    """``with decode_launches() as names:`` the names of the kernels the decode launcher runs (they run too)."""

    def __enter__(self) -> list:
        from ninefold.ops.triton import decode

        self.names, self.real, self.real_pdl = [], decode.call, decode._SPLIT_PDL

        def recording_call(kernel, *args, **kwargs):
            self.names.append(kernel.fn.__name__)
            return self.real(kernel, *args, **kwargs)

        def recording_pdl(*args, **kwargs):  # the split kernel's PDL launches (CUDA, sm_90+)
            self.names.append(self.real_pdl.kernel.fn.__name__)
            return self.real_pdl(*args, **kwargs)

        decode.call, decode._SPLIT_PDL = recording_call, recording_pdl
        return self.names

    def __exit__(self, *exc) -> None:
        from ninefold.ops.triton import decode

        decode.call, decode._SPLIT_PDL = self.real, self.real_pdl


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_default_config_at_large_and_small_batch_cuda(dtype):
    # The shipped CONFIG at Llama-3-8B heads: unsplit (several KV heads per program) and split (merged in place).
    from ninefold.ops.triton import decode

    for lengths in ([1, 700, 33, 4097], [int(n) for n in torch.randint(1, 900, (200,))]):
        args = _case(lengths, 32, 8, 128, dtype, seed=len(lengths), extra_columns=40)
        out = decode.launch(*args, None, decode.CONFIG)
        assert_close(out, ref.attention_decode(*args), dtype, scale=ATTENTION_SCALE)


def test_medium_batch_keeps_the_unsplit_config_with_one_head_per_program(monkeypatch):
    # CONFIG (2 KV heads per program) would split; split_config's 1 head per program leaves one split:
    # the launch then runs CONFIG's settings with one head per program, unsplit.
    from ninefold.ops.triton import decode

    config = _config(heads_per_program=2, heads_fastest=1, per_sm=4, min_tiles=2, block_n=32,
                     split_config={"block_n": 64, "heads_fastest": 0, "heads_per_program": 1, "merge_rows": 16})
    used, heads, block_n, _, splits = decode.plan(12, 2, 1024, 4, torch.float16, config)  # 12 programs / 4 "SMs"
    assert (heads, block_n, splits, used["heads_fastest"]) == (1, 32, 1, 1)
    used, heads, block_n, _, splits = decode.plan(2, 2, 1024, 4, torch.float16, config)  # few programs: split
    assert (heads, block_n, used["heads_fastest"]) == (1, 64, 0) and splits > 1
    used, heads, _, _, splits = decode.plan(40, 2, 1024, 4, torch.float16, config)  # many: unsplit, 2 heads
    assert (heads, splits) == (2, 1)
    monkeypatch.setattr(decode, "_sm_count", lambda device: 4)
    args = _case([40, 3, 90, 17, 64, 5, 33, 70, 1, 20, 48, 9], 8, 2, 16, torch.float32, seed=69, extra_columns=3)
    out = decode.launch(*args, None, {**config, "block_n": 16})
    assert_close(out, ref.attention_decode(*args), torch.float32, scale=ATTENTION_SCALE)


@pytest.mark.parametrize("per_sm,one_kernel", [(16, 1), (16, 0), (1, 1)], ids=["split", "split-two-kernels", "unsplit"])
def test_early_first_tile_gives_the_same_bits(per_sm, one_kernel):
    # EARLY_KV (the PDL launch's option): the first tile's older keys are loaded up front and the
    # newest key (position length - 1) after; nothing else changes.
    from ninefold.ops.triton import decode

    q, k_cache, v_cache, tables, lens = _case([1, 50, 200, 17, 96, 33], 8, 2, 16, torch.float32, seed=70,
                                              extra_columns=4)
    lens[3] = 0  # a padded CUDA-graph row
    config = _config(per_sm=per_sm, one_kernel=one_kernel)
    plain = decode.launch(q, k_cache, v_cache, tables, lens, None, config, early_kv=False)
    early = decode.launch(q, k_cache, v_cache, tables, lens, None, config, early_kv=True)
    rows = [0, 1, 2, 4, 5]  # the two-kernel path leaves a context-0 row undefined (NaN)
    assert torch.equal(plain[rows], early[rows])
    if one_kernel:
        assert torch.equal(early[3], torch.zeros_like(early[3]))
    assert_close(early[rows], ref.attention_decode(q[rows], k_cache, v_cache, tables[rows], lens[rows]), torch.float32,
                 scale=ATTENTION_SCALE)
