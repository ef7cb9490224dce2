"""The Triton ``argmax`` (chunked rows, last-arriving program reduces) against ``torch.argmax``.

Runs under Triton's interpreter (``test_triton_argmax_in_the_interpreter`` starts this file with
TRITON_INTERPRET=1 when neither the interpreter nor CUDA is on) and on CUDA.
"""

import os

import pytest
import torch

from .helpers import run_interpreted_tests

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_RUNS = INTERPRETED or torch.cuda.is_available()
triton_only = pytest.mark.skipif(not TRITON_RUNS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
DTYPES = [torch.float32] if INTERPRETED else [torch.float32, torch.float16, torch.bfloat16]


def _kernel():
    from ninefold.ops.triton import argmax

    return argmax


@triton_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", [(1, 5), (3, 2049), (2, 8192), (5, 20001), (1, 128256)])
def test_argmax_matches_torch(rows, cols, dtype):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)).to(DEVICE, dtype)
    assert torch.equal(_kernel().argmax(x).cpu(), x.cpu().float().argmax(-1))


@triton_only
def test_ties_go_to_the_first_index_across_chunks_and_lanes():
    argmax = _kernel()
    x = torch.zeros(4, 3 * argmax.CHUNK + 7, device=DEVICE)
    x[0, [5, argmax.CHUNK + 1, 2 * argmax.CHUNK]] = 3.0  # the same maximum in three chunks
    x[1, [argmax.BLOCK + 3, 3]] = 1.0  # two lanes of one chunk, the later column in the earlier step
    x[2] = float("-inf")  # all -inf: index 0, as torch
    x[3, -1] = 0.5  # the last column, in the partial last chunk
    assert argmax.argmax(x).tolist() == [5, 3, 0, x.shape[1] - 1]


@triton_only
def test_repeated_calls_reuse_the_counters_and_strided_rows_work():
    argmax = _kernel()
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 30000, generator=g).to(DEVICE)
    rows = wide[:, :25000]  # row stride wider than the row
    for _ in range(3):
        assert torch.equal(argmax.argmax(rows).cpu(), rows.cpu().argmax(-1))
        shuffled = rows[torch.randperm(6, generator=g).to(DEVICE)]
        assert torch.equal(argmax.argmax(shuffled).cpu(), shuffled.cpu().argmax(-1))


def test_supports_names_what_it_refuses():
    argmax = _kernel()
    assert argmax.supports(torch.zeros(2, 3), dim=0) is not None
    assert argmax.supports(torch.zeros(2, 3, 4)) is not None
    assert "contiguous" in argmax.supports(torch.zeros(4, 3).t())
    assert argmax.supports(torch.zeros(2, 100)) is None


@pytest.mark.skipif(torch.cuda.is_available() or INTERPRETED, reason="runs the file itself when Triton cannot")
def test_triton_argmax_in_the_interpreter():
    run_interpreted_tests(["test_argmax_triton.py"], at_least=8)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter replaces the kernels it would compile")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_argmax_kernel_compiles_for_sm90(dtype):
    from ninefold.ops import workloads
    from ninefold.ops.triton import aot

    target = aot.parse_target("cuda:90")
    variants = aot.variants("argmax", dtype, workloads.shapes("llama-8b"))
    assert [v.kernel.fn.__name__ for v in variants] == ["argmax_chunk_kernel"]
    compiled = aot.compile_variant(variants[0], dtype, target)
    assert compiled.asm.get("cubin")
