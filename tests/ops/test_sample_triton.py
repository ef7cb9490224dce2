"""The Triton ``sample`` (exponential race, rejection for top-p, no sort) against the exact filtered distribution.

Runs under Triton's interpreter (``test_triton_sample_in_the_interpreter`` starts this file with TRITON_INTERPRET=1
when neither the interpreter nor CUDA is on) and on CUDA.
"""

import math
import os

import pytest
import torch

from ninefold.ops import references as ref

from .helpers import run_interpreted_tests

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_RUNS = INTERPRETED or torch.cuda.is_available()
triton_only = pytest.mark.skipif(not TRITON_RUNS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
CUDA_ONLY = pytest.mark.skipif(INTERPRETED, reason="a case the interpreter's coarser run leaves to CUDA")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
DTYPES = [torch.float32] if INTERPRETED else [torch.float32, torch.bfloat16]
# rows of one frequency check (the interpreter runs one program at a time, a few ms each: its checks are coarse,
# CUDA's are the statistical ones)
DRAWS = 300 if INTERPRETED else 4000
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, -float("inf")])


def _kernel():
    from ninefold.ops.triton import sample

    return sample


def _rows(n: int, value: float | None) -> torch.Tensor | None:
    return None if value is None else torch.full((n,), value, device=DEVICE)


def _check_frequencies(out: torch.Tensor, want: torch.Tensor, n: int) -> None:
    freq = torch.bincount(out.cpu(), minlength=want.numel()).double() / n
    assert torch.all(freq[want == 0] == 0), f"drew filtered tokens: {freq} vs {want}"
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-3), f"{freq} vs {want}"


@triton_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, None, None, None), pytest.param(2.0, None, None, None, marks=CUDA_ONLY), (1.0, None, 0.7, None),
    pytest.param(0.7, None, 0.8, None, marks=CUDA_ONLY), (1.0, None, None, 0.2), (1.3, None, 0.9, 0.1),
    pytest.param(1.0, 3, None, None, marks=CUDA_ONLY), (0.7, 5, 0.8, None), pytest.param(1.3, 6, 0.9, 0.1, marks=CUDA_ONLY)])
def test_frequencies_match_the_filtered_distribution(temperature, top_k, top_p, min_p, dtype):
    n = DRAWS
    logits = LOGITS.to(DEVICE, dtype).expand(n, -1).contiguous()
    torch.manual_seed(1234)
    if DEVICE == "cuda":
        torch.cuda.manual_seed(1234)
    k = None if top_k is None else torch.full((n,), top_k, dtype=torch.int32, device=DEVICE)
    out = _kernel().sample(logits, _rows(n, temperature), k, _rows(n, top_p), _rows(n, min_p), None)
    first = [None if v is None else torch.tensor([v]) for v in (top_k, top_p, min_p)]
    want = ref.sample_distribution(LOGITS[None].to(dtype), torch.tensor([temperature]), *first)[0]
    _check_frequencies(out, want, n)


@triton_only
@pytest.mark.parametrize("dtype", DTYPES + ([torch.float16] if not INTERPRETED else []), ids=str)
def test_top_k_finds_the_kth_largest_over_several_chunks_and_keeps_its_ties(dtype):
    """The radix select over chunks: rows of distinct random logits spread over three chunks, each row with its
    own k (1, a tie-free k, the whole row, off), and a row whose k-th largest ties with others."""
    sample = _kernel()
    v = 2 * sample.BLOCK + 77
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, v, generator=gen).to(dtype)
    logits[5] = torch.where(torch.arange(v) % 5 == 0, 3.0, -2.0).to(dtype)  # v // 5 + 1 tokens tie at the top
    ks = torch.tensor([1, 17, v, 0, v - 1, 2], dtype=torch.int32)
    draws = 12 if INTERPRETED else 100
    rows = logits.repeat(draws, 1).to(DEVICE)
    out = sample.sample(rows, _rows(6 * draws, 1.0), ks.repeat(draws).to(DEVICE), None, None, None).view(draws, 6).cpu()
    x = logits.float()
    for row, k in enumerate(ks.tolist()):
        kth = x[row].sort(descending=True).values[k - 1] if 0 < k < v else -float("inf")
        assert bool((x[row, out[:, row]] >= kth).all()), f"row {row} (k={k}) drew below the k-th largest"
    assert set(out[:, 0].tolist()) == {int(x[0].argmax())}
    assert len(set(out[:, 5].tolist())) > draws // 2  # the tied top tokens (v // 5 + 1 of them), all kept for k = 2


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_top_k_above_the_finite_logits_keeps_them_all(dtype):
    """The k-th largest is -inf (fewer finite logits than k, as a mask leaves them): rebuilt from its order key it
    must be -inf again, not a NaN that keeps nothing (review finding: bfloat16 and float16 rows drew column 0)."""
    sample = _kernel()
    v, rows = 2 * sample.BLOCK + 88, 6
    row = torch.full((v,), -float("inf"))
    finite = [3, sample.BLOCK + 34, 2 * sample.BLOCK + 80]
    row[finite] = torch.tensor([0.5, -2.0, 1.0])
    temperature = _rows(rows, 1.0)
    temperature[-1] = 0.0  # a greedy row too
    k = torch.tensor([5, 5, 5, 3, 4, 5], dtype=torch.int32, device=DEVICE)
    out = sample.sample(row.to(DEVICE, dtype).expand(rows, -1).contiguous(), temperature, k, None, None, None).cpu()
    assert set(out[:-1].tolist()) <= set(finite) and out[-1].item() == finite[2]


@triton_only
def test_a_top_k_beyond_int32_is_off():
    # int64 k of 2**32 + 1 means no filter; cast to int32 unclamped it wrapped to 1 (review finding)
    n = 60
    logits = (torch.arange(50.0) / 100).expand(n, -1).contiguous().to(DEVICE)  # distinct: k = 1 keeps one
    k = torch.full((n,), 2**32 + 1, dtype=torch.int64, device=DEVICE)
    assert len(set(_kernel().sample(logits, _rows(n, 1.0), k, None, None, None).tolist())) > 10


@triton_only
def test_top_p_over_several_blocks_rejects_until_inside_the_nucleus():
    # two of the kernel's blocks: two large tokens (mass ~0.46 and ~0.28) and a flat tail of ~0.26: with top_p 0.5
    # the nucleus is the two, and a draw from the whole row that lands in the tail is rejected (another round)
    sample = _kernel()
    v, n = sample.BLOCK + 404, DRAWS // 4
    row = torch.zeros(v)
    big, second = v - 7, 17
    row[big], row[second] = math.log(1.8 * (v - 2)), math.log(1.1 * (v - 2))
    torch.manual_seed(7)
    out = sample.sample(row.expand(n, -1).contiguous().to(DEVICE), _rows(n, 1.0), None, _rows(n, 0.5), None, None)
    want = ref.sample_distribution(row[None], torch.ones(1), None, torch.tensor([0.5]), None)[0]
    assert set(want.nonzero().flatten().tolist()) == {big, second}  # the nucleus: the two large tokens
    _check_frequencies(out, want, n)


@triton_only
def test_tokens_tied_at_the_top_p_edge_are_all_kept():
    # four equal tokens of 0.30 each: top-p 0.5 is reached after two of them, and the kernel keeps all four
    n = DRAWS
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, -float("inf")]).expand(n, -1).contiguous().to(DEVICE)
    torch.manual_seed(5)
    out = _kernel().sample(logits, _rows(n, 1.0), None, _rows(n, 0.5), None, None)
    _check_frequencies(out, torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0, 0.0], dtype=torch.float64), n)


@triton_only
def test_greedy_rows_take_the_first_largest_logit_whatever_the_filters():
    sample = _kernel()
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(1))
    logits[0, [10, 4200]] = 9.0  # a tie: the first column wins, as torch.argmax
    temperature = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0], device=DEVICE)
    out = sample.sample(logits.to(DEVICE), temperature, None, _rows(6, 0.3), _rows(6, 0.5), None).cpu()
    greedy = logits.argmax(-1)
    assert out[0].item() == 10
    assert torch.equal(out[[0, 1, 2, 4, 5]], greedy[[0, 1, 2, 4, 5]])


@triton_only
@pytest.mark.parametrize("top_p", [None, 0.9])
def test_a_tiny_temperature_draws_the_largest_logit(top_p):
    """1 / 1e-40 is +inf in float32: the kernel must not turn the logits into inf or NaN and draw among them."""
    sample = _kernel()
    logits = torch.tensor([[3.0, 0.0, -1.0, 2.5, 0.0, 1.0] * 50]).repeat(8, 1)
    logits[:, 201] = 4.0  # the one largest, after smaller positive ones (which +inf would tie with)
    temperature = torch.full((8,), 1e-40, device=DEVICE)
    out = sample.sample(logits.to(DEVICE), temperature, None, _rows(8, top_p), None, None).cpu()
    assert out.tolist() == [201] * 8


@triton_only
def test_a_seeded_draw_depends_on_the_seed_and_its_row_only():
    sample = _kernel()
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def gen(seed):
        return torch.Generator(device=DEVICE).manual_seed(seed)

    # (the row spans several of the kernels' chunks under the interpreter, whose blocks are 256 columns)
    alone = sample.sample(logits[2:3], _rows(1, 1.2), None, _rows(1, 0.9), None, [gen(5)])
    batched = sample.sample(logits, _rows(5, 1.2), None, _rows(5, 0.9), None, [None, gen(9), gen(5), None, gen(11)])
    assert alone.item() == batched[2].item()
    draws = {sample.sample(logits[2:3], _rows(1, 1.2), None, None, None, [gen(s)]).item() for s in range(12)}
    assert len(draws) > 1  # different seeds, different draws


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA: about 1.6M draws of 128k tokens")
def test_unlikely_tokens_are_drawn_as_often_as_their_probability():
    """The race's noise must resolve small exponentials: with E = -log(u) in float32 (u steps by 2^-24 near 1),
    tokens below about 1e-6 of the mass were drawn 10-20% too rarely (review of the twenty-fifth session)."""
    sample = _kernel()
    gen = torch.Generator().manual_seed(4)
    v, rows, calls = 128256, 8192, 200
    ranks = torch.randperm(v, generator=gen).double() + 1
    row = (-1.2 * ranks.log() + 0.2 * torch.randn(v, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    probs = torch.softmax(row.double(), 0)
    logits = row.to(DEVICE).expand(rows, -1).contiguous()
    counts = torch.zeros(v, dtype=torch.float64, device=DEVICE)
    for _ in range(calls):
        counts += torch.bincount(sample.sample(logits, _rows(rows, 1.0)), minlength=v).double()
    counts = counts.cpu()
    for low, high in ((1e-8, 1e-7), (1e-7, 1e-6), (1e-6, 1e-5)):
        band = (probs >= low) & (probs < high)
        expected, drawn = float(probs[band].sum()) * rows * calls, float(counts[band].sum())
        assert abs(drawn - expected) < 5 * expected**0.5 + 1, f"p in [{low}, {high}): {drawn:.0f} against {expected:.0f}"


def test_supports_names_what_it_refuses():
    sample = _kernel()
    t = torch.ones(2)
    assert "float64" in sample.supports(torch.zeros(2, 10, dtype=torch.float64), t)
    assert "contiguous" in sample.supports(torch.zeros(10, 2).t(), t)
    assert sample.supports(torch.zeros(2, 10), t, None, torch.ones(2), torch.zeros(2)) is None


@pytest.mark.skipif(torch.cuda.is_available() or INTERPRETED, reason="runs the file itself when Triton cannot")
def test_triton_sample_in_the_interpreter():
    run_interpreted_tests(["test_sample_triton.py"], at_least=10)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter replaces the kernels it would compile")
def test_sample_kernels_compile_for_sm90():
    from ninefold.ops import workloads
    from ninefold.ops.triton import aot

    target = aot.parse_target("cuda:90")
    variants = aot.variants("sample", torch.bfloat16, workloads.shapes("llama-8b"))
    names = [v.kernel.fn.__name__ for v in variants]
    assert sorted(set(names)) == ["sample_finish_kernel", "sample_mass_kernel", "sample_race_kernel",
                                  "sample_stats_kernel", "sample_topk_hist_kernel", "sample_topk_select_kernel"]
    assert names.count("sample_finish_kernel") == 8 and names.count("sample_topk_hist_kernel") == 4  # bf16: 4 digits
    for variant in variants:
        assert aot.compile_variant(variant, torch.bfloat16, target).asm.get("cubin")
