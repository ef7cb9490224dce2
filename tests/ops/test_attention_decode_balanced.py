"""Triton decode attention with the batch's key tiles divided evenly among the programs.

Runs under Triton's interpreter (TRITON_INTERPRET=1, tiny sizes) or on CUDA; skipped otherwise.
"""

import os

import pytest
import torch

from ninefold.ops import references as ref

from .helpers import assert_close
from .test_attention import ATTENTION_SCALE
from .test_attention_decode_merge import TRITON_RUNS, _case

needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _config(**extra):
    from ninefold.ops.triton import decode_balanced

    return {**decode_balanced.CONFIG, "block_n": 16, "num_stages": 1, **extra}


def _live_reference(args):
    """The float64 reference on the rows with keys (it takes no empty context)."""
    q, k_cache, v_cache, tables, lens = args
    live = (lens > 0).nonzero().flatten()
    return live, ref.attention_decode(q[live], k_cache, v_cache, tables[live], lens[live])


@needs_triton
@pytest.mark.parametrize("per_sm", [1, 3, 64], ids=["few-programs", "cut-items", "more-programs-than-tiles"])
@pytest.mark.parametrize("hq,hk,heads", [(8, 2, 2), (8, 2, 1), (6, 2, 1), (4, 4, 2)],
                         ids=["group4-2heads", "group4-1head", "group3", "mha-2heads"])
def test_matches_reference_on_ragged_batches(per_sm, hq, hk, heads):
    # Items cut by program boundaries (merged by the last program to arrive), whole items, a long
    # context spread over many programs, and more programs than tiles (the spare ones do nothing).
    from ninefold.ops.triton import decode_balanced

    args = _case([1, 50, 200, 17, 96, 300, 2], hq, hk, 16, torch.float32, seed=71, extra_columns=9)
    out = decode_balanced.launch(*args, None, _config(per_sm=per_sm, heads_per_program=heads))
    assert_close(out, ref.attention_decode(*args), torch.float32, scale=ATTENTION_SCALE)


@needs_triton
def test_one_long_sequence_is_shared_by_every_program():
    from ninefold.ops.triton import decode, decode_balanced

    args = _case([700], 8, 2, 16, torch.float32, seed=72)
    config = _config(per_sm=8)
    assert decode_balanced.programs(args[0].device, config) == 8 * decode._sm_count(args[0].device)
    out = decode_balanced.launch(*args, None, config)
    assert_close(out, ref.attention_decode(*args), torch.float32, scale=ATTENTION_SCALE)


@needs_triton
def test_rows_without_keys_give_zeros():
    # Padded CUDA-graph rows carry context length 0: each owns one empty tile, its output zeros.
    from ninefold.ops.triton import decode_balanced

    args = _case([40, 1, 33, 5], 8, 2, 16, torch.float32, seed=73, extra_columns=3)
    args[4][1] = 0
    args[4][3] = 0
    out = decode_balanced.launch(*args, None, _config(per_sm=2))
    assert not out.isnan().any()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))
    live, want = _live_reference(args)
    assert_close(out[live], want, torch.float32, scale=ATTENTION_SCALE)


@needs_triton
def test_counters_return_to_zero_so_launches_repeat():
    from ninefold.ops.triton import decode, decode_balanced

    args = _case([70, 33, 5, 129], 8, 2, 16, torch.float32, seed=74, extra_columns=4)
    first = decode_balanced.launch(*args, None, _config(per_sm=3))
    assert int(decode.counters(args[0].device, 1).abs().sum()) == 0
    again = decode_balanced.launch(*args, None, _config(per_sm=3))
    torch.testing.assert_close(first, again, atol=0, rtol=0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not CUDA, reason="the interpreter computes bfloat16 dots wrongly"))], ids=["f16", "bf16"])
def test_half_precision(dtype):
    from ninefold.ops.triton import decode_balanced

    args = _case([90, 3, 64, 250], 8, 2, 32, dtype, seed=75, extra_columns=2)
    out = decode_balanced.launch(*args, None, _config(per_sm=2))
    assert_close(out, ref.attention_decode(*args), dtype, scale=ATTENTION_SCALE)


@needs_triton
def test_the_split_launcher_hands_batches_in_the_balanced_range_over(monkeypatch):
    from ninefold.ops.triton import decode, decode_balanced

    handed = []
    real = decode_balanced.launch

    def recording(*args, **kwargs):
        handed.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_balanced, "launch", recording)
    config = {**decode.CONFIG, "balanced_min": 3, "balanced_max": 4, "balanced_config": _config(per_sm=2)}
    for lengths in ([20, 7], [20, 7, 64], [20, 7, 64, 1], [20, 7, 64, 1, 9]):
        args = _case(lengths, 8, 2, 16, torch.float32, seed=76, extra_columns=2)
        assert_close(decode.launch(*args, None, config), ref.attention_decode(*args), torch.float32,
                     scale=ATTENTION_SCALE)
    assert handed == [3, 4]
    assert not decode.balanced(5, config) and decode.balanced(3, config)
    assert not decode.balanced(1, {"balanced_min": 0, "balanced_max": 0})  # the off switch


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_replays_and_pdl_give_the_same_bits():
    from ninefold.ops.triton import decode, decode_balanced

    lengths = [int(n) for n in torch.randint(1, 2000, (88,), generator=torch.Generator().manual_seed(77))]
    args = _case(lengths, 32, 8, 128, torch.bfloat16, seed=77, extra_columns=40)
    config = decode.CONFIG["balanced_config"]
    eager = decode_balanced.launch(*args, None, config, pdl=False)
    assert_close(eager, ref.attention_decode(*args), torch.bfloat16, scale=ATTENTION_SCALE)
    pdl = decode.pdl_wanted(args[0].device)
    if pdl:
        torch.testing.assert_close(decode_balanced.launch(*args, None, config, pdl=True), eager, atol=0, rtol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_balanced.launch(*args, None, config, pdl=pdl)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, eager, atol=0, rtol=0)


@pytest.mark.skipif(TRITON_RUNS, reason="already under the interpreter or on CUDA")
def test_in_the_interpreter():
    # This file's cases through Triton's interpreter (set before Triton is imported: a child process).
    from .helpers import run_interpreted_tests

    run_interpreted_tests(["test_attention_decode_balanced.py"], "not cuda and not sm90", at_least=15)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles, does not interpret")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_compiles_for_sm90(dtype):
    # The kernel at Llama-3-8B heads for the batch sizes the engine captures, compiled here for the H200.
    from ninefold.ops import workloads
    from ninefold.ops.triton import aot, decode_balanced

    target = aot.parse_target("cuda:90")
    for v in decode_balanced.aot_variants(dtype, workloads.shapes("llama-8b"), [16, 128]):
        compiled = aot.compile_variant(aot.Variant("attention_decode", **v), dtype, target)
        assert ".target sm_90" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 1000
