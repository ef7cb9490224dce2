import pytest
import torch

from ninefold.ops import references as ref

from .helpers import DTYPE_IDS, DTYPES, call, impl_params

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("argmax"))
def test_argmax_matches_reference(device, impl, dtype):
    x = torch.randn(7, 1001, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    out = call("argmax", impl, x, -1)
    assert out.dtype == torch.int64
    # Compare values (rounding to dtype can create ties; the max value is what must match).
    assert torch.equal(x.cpu()[torch.arange(7), out.cpu()], x.cpu().max(-1).values)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("sample"))
def test_temperature_zero_is_greedy(device, impl, dtype):
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    temperature = torch.zeros(16, device=device)
    out = call("sample", impl, logits, temperature, top_p=torch.full((16,), 0.5, device=device))
    assert torch.equal(out.cpu(), logits.cpu().argmax(-1))


CASES = {
    "plain": dict(temperature=1.0),
    "hot": dict(temperature=2.0),
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "top_k_top_p": dict(temperature=0.7, top_k=5, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "all": dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.1),
}


def _row_args(case: dict, n: int, device):
    """Per-row tensors of ``case``; a filter the case does not use is None (as the engine's sampler passes it)."""
    temperature = torch.full((n,), case["temperature"], device=device)
    top_k = torch.full((n,), case["top_k"], dtype=torch.int32, device=device) if "top_k" in case else None
    top_p = torch.full((n,), case["top_p"], device=device) if "top_p" in case else None
    min_p = torch.full((n,), case["min_p"], device=device) if "min_p" in case else None
    return temperature, top_k, top_p, min_p


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("device,impl", impl_params("sample"))
def test_sample_frequencies_match_the_filtered_distribution(device, impl, case):
    n = 6000
    temperature, top_k, top_p, min_p = _row_args(CASES[case], n, device)
    logits = LOGITS.to(device).expand(n, -1)
    torch.manual_seed(1234)
    if device == "cuda":
        torch.cuda.manual_seed(1234)
    out = call("sample", impl, logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    freq = torch.bincount(out.cpu(), minlength=LOGITS.numel()).double() / n
    first = [None if t is None else t[:1].cpu() for t in (top_k, top_p, min_p)]
    want = ref.sample_distribution(LOGITS[None], temperature[:1].cpu(), *first)[0]
    assert torch.all(freq[want == 0] == 0), f"drew filtered tokens: {freq} vs {want}"
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-3), f"{freq} vs {want}"


def test_reference_top_p_keeps_smallest_set_reaching_p():
    want = ref.sample_distribution(LOGITS[None], torch.ones(1), None, torch.tensor([0.7]), None)[0]
    probs = torch.softmax(LOGITS.double(), -1)
    kept = (want > 0).sum().item()
    assert probs[:kept].sum() >= 0.7 > probs[:kept - 1].sum()


@pytest.mark.parametrize("device,impl", impl_params("sample"))
def test_seeded_rows_reproduce_and_unseeded_rows_vary(device, impl):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2)).to(device)
    temperature = torch.full((4,), 1.5, device=device)

    def draw(seed_offset):
        gens = [torch.Generator(device=device).manual_seed(10 + i) if i % 2 == 0 else None for i in range(4)]
        torch.manual_seed(seed_offset)
        if device == "cuda":
            torch.cuda.manual_seed(seed_offset)
        return call("sample", impl, logits, temperature, generators=gens)

    first, second = draw(0), draw(1)
    assert torch.equal(first[0::2], second[0::2])
    many = [draw(s)[1].item() for s in range(8)]
    assert len(set(many)) > 1


@pytest.mark.parametrize("device,impl", impl_params("sample"))
def test_top_k_compares_the_logits_not_the_logits_over_the_temperature(device, impl):
    # float32 logits one step apart: divided by 0.7 the second and third round to one value, which must not make
    # the third a tie of the k-th (review finding on torch's route)
    second = torch.tensor(0.9)
    third = torch.nextafter(second, torch.tensor(0.0))
    while float(second / 0.7) != float(third / 0.7):  # (a pair a few steps away at most)
        second, third = third, torch.nextafter(third, torch.tensor(0.0))
    rows = 300
    logits = torch.stack([torch.tensor(1.5), second, third, torch.tensor(-1.0)]).expand(rows, -1).contiguous()
    top_k = torch.full((rows,), 2, dtype=torch.int32, device=device)
    out = call("sample", impl, logits.to(device), torch.full((rows,), 0.7, device=device), top_k=top_k)
    assert set(out.tolist()) == {0, 1}


@pytest.mark.parametrize("min_p", [None, 0.1], ids=["plain", "min_p"])
@pytest.mark.parametrize("device,impl", impl_params("sample"))
def test_a_row_with_an_overflowed_logit_draws_that_token_and_never_a_banned_one(device, impl, min_p):
    # a float16 model's logit that overflowed to +inf, and a banned token (-inf) in the last column
    rows = 64
    logits = torch.tensor([0.5, float("inf"), 1.0, -float("inf")], dtype=torch.float16).expand(rows, -1)
    min_p = None if min_p is None else torch.full((rows,), min_p, device=device)
    out = call("sample", impl, logits.contiguous().to(device), torch.ones(rows, device=device), min_p=min_p)
    assert set(out.tolist()) == {1}


@pytest.mark.parametrize("device,impl", impl_params("sample"))
def test_a_row_with_nothing_allowed_takes_the_first_column_as_argmax_does(device, impl):
    logits = torch.full((3, 50), -float("inf"), device=device)
    assert call("sample", impl, logits, torch.ones(3, device=device)).tolist() == [0, 0, 0]


def _tied_logits(rows: int, device, dtype) -> torch.Tensor:
    """Every 7th of 300 tokens ties for the largest logit (43 tokens); the rest share a lower one."""
    logits = torch.zeros(rows, 300, dtype=dtype)
    logits[:, ::7] = 1.0
    return logits.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("device,impl", impl_params("sample"))
@pytest.mark.parametrize("top_p", [None, 0.3], ids=["top_k", "top_k_top_p"])
def test_a_top_k_or_top_p_edge_among_tied_logits_keeps_every_tied_token(device, impl, dtype, top_p):
    """Which of several equal logits a filter keeps must not be left to an order of ties (unspecified, and on
    CUDA not the same from one call to the next): all of them, as transformers and vLLM keep them."""
    rows = 600
    top_k = torch.full((rows,), 20, dtype=torch.int32, device=device)
    top_p = None if top_p is None else torch.full((rows,), top_p, device=device)
    torch.manual_seed(5)
    if device == "cuda":
        torch.cuda.manual_seed(5)
    out = call("sample", impl, _tied_logits(rows, device, dtype), torch.ones(rows, device=device), top_k=top_k,
               top_p=top_p)
    assert set(out.tolist()) == set(range(0, 300, 7))


@pytest.mark.parametrize("device,impl", impl_params("sample"))
def test_different_seeds_give_different_streams(device, impl):
    logits = torch.zeros(1, 50000, device=device)
    temperature = torch.ones(1, device=device)
    a = call("sample", impl, logits, temperature, generators=[torch.Generator(device=device).manual_seed(1)])
    b = call("sample", impl, logits, temperature, generators=[torch.Generator(device=device).manual_seed(2)])
    assert a.item() != b.item()


@pytest.mark.parametrize("case", ["all", "no_top_k"])  # (the Triton implementation refuses top_k)
@pytest.mark.parametrize("device,impl", [p for p in impl_params("sample") if p.values[0] == "cuda"])
def test_sample_does_not_synchronise_on_cuda(device, impl, case):
    n = 8
    logits = torch.randn(n, 5000, device=device)
    filters = CASES["all"] if case == "all" else dict(temperature=1.3, top_p=0.9, min_p=0.1)
    temperature, top_k, top_p, min_p = _row_args(filters, n, device)
    gens = [torch.Generator(device=device).manual_seed(i) for i in range(n)]
    call("sample", impl, logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p, generators=gens)  # warm
    torch.cuda.set_sync_debug_mode("error")
    try:
        call("sample", impl, logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p, generators=gens)
    finally:
        torch.cuda.set_sync_debug_mode("default")



VENDOR = [p for p in impl_params("sample") if p.values[1] == "vendor"]


@pytest.mark.parametrize("case", ["plain", "top_k", "top_p", "min_p"])
@pytest.mark.parametrize("device,impl", VENDOR)
def test_a_tiny_temperature_acts_greedy_instead_of_overflowing(device, impl, case):
    # 1e-40 is accepted (finite, > 0), and logits / 1e-40 overflow float32: every positive logit became +inf
    rows = 500
    logits = torch.tensor([2.0, 1.0, 1.5, 0.5, -1.0]).expand(rows, -1).contiguous().to(device)
    filters = {"plain": {}, "top_k": {"top_k": torch.full((rows,), 3, dtype=torch.int32, device=device)},
               "top_p": {"top_p": torch.full((rows,), 0.9, device=device)},
               "min_p": {"min_p": torch.full((rows,), 0.05, device=device)}}[case]
    out = call("sample", impl, logits, torch.full((rows,), 1e-40, device=device), **filters)
    assert set(out.tolist()) == {0}


@pytest.mark.parametrize("top_k,top_p", [(3, None), (100, None), (3, 0.9)], ids=["k3", "k100", "k3_p0.9"])
@pytest.mark.parametrize("device,impl", VENDOR)
def test_a_row_with_several_overflowed_logits_draws_among_them_under_top_k(device, impl, top_k, top_p):
    # a float16 model's logits overflowed to +inf in two columns: the draw is among those two, as without top-k
    rows = 400
    logits = torch.tensor([0.0, float("inf"), 1.0, float("inf")], dtype=torch.float16).expand(rows, -1)
    top_p = None if top_p is None else torch.full((rows,), top_p, device=device)
    out = call("sample", impl, logits.contiguous().to(device), torch.ones(rows, device=device),
               top_k=torch.full((rows,), top_k, dtype=torch.int32, device=device), top_p=top_p)
    assert set(out.tolist()) == {1, 3}


@pytest.mark.parametrize("device,impl", impl_params("sample"))
def test_a_seeded_rows_token_does_not_depend_on_the_rows_beside_it(device, impl):
    logits = (torch.randn(2, 1000, generator=torch.Generator().manual_seed(3)) * 3).to(device)
    temperature = torch.ones(2, device=device)

    def draw(rows, seed, top_k=None, top_p=None):
        gens = [torch.Generator(device=device).manual_seed(seed)] + [None] * (rows - 1)
        top_k = None if top_k is None else torch.tensor(top_k[:rows], dtype=torch.int32, device=device)
        top_p = None if top_p is None else torch.tensor(top_p[:rows], device=device)
        return call("sample", impl, logits[:rows], temperature[:rows], top_k=top_k, top_p=top_p,
                    generators=gens)[0].item()

    for seed in range(20):
        alone = draw(1, seed)
        assert draw(2, seed, top_k=[0, 50]) == alone  # the other row turns top-k on
        assert draw(2, seed, top_p=[1.0, 0.5]) == alone
        with_top_k = draw(1, seed, top_k=[50])
        assert draw(2, seed, top_k=[50, 0]) == with_top_k  # the other row has no top-k
