"""``linear`` through cuBLASLt with a measured algorithm (``ninefold.ops.cublaslt``): every offered
algorithm against float64, the tuner's persisted choice, CUDA-graph capture, the fallbacks."""

import pytest
import torch
import torch.nn.functional as F

import ninefold.ops as ops
from ninefold.ops import cublaslt
from ninefold.ops.cublaslt import binding, tuning

from .helpers import fresh_choice_cache

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def test_supports_names_what_it_takes():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    assert cublaslt.supports(x, w) == "CUDA tensors only"
    if CUDA:
        xc, wc = x.cuda(), w.cuda()
        assert cublaslt.supports(xc, wc) == "dtype torch.float32: float16 or bfloat16 only"
        assert cublaslt.supports(xc.half(), wc.half()) is None


def test_not_registered_without_cuda():
    names = [i.name for i in ops.registry.all_implementations("linear")]
    assert ("cublaslt" in names) == CUDA, names


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    yield from fresh_choice_cache(tuning.forget, tmp_path, monkeypatch)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [16, 200])
def test_every_offered_algorithm_matches_float64(dtype, m):
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k = 1536, 1024
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
    ref = x.double() @ w.double().T
    offered = binding.candidates(binding.plan(m, n, k, dtype, x.device))
    assert offered, "cuBLASLt offered no algorithm"
    for cand in offered:
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        binding.matmul(x, w, out, cand.algo)
        err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-2, (cand.name(), err)


@needs_cuda
def test_tuning_persists_and_linear_uses_it(fresh_cache):
    m, n, k = 192, 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    assert tuning.choice(m, n, k, x.dtype, x.device) is None  # outside autotune: not tuned, F.linear
    result = tuning.tune(m, n, k, x.dtype, x.device, progress=False)
    times = result["times_us"]
    assert tuning.VENDOR in times and all(t > 0 for t in times.values()), times
    files = list((fresh_cache / "ops").glob("cublaslt-*.json"))
    assert len(files) == 1
    tuning.forget()
    algo = tuning.choice(m, n, k, x.dtype, x.device)  # read back from the file
    if result["choice"] == tuning.VENDOR:
        assert algo is None
    else:
        assert binding.algo_words(algo) == result["choice"]["algo"]
    got = cublaslt.linear(x, w)
    want = F.linear(x, w)
    assert got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() < 2e-2 * want.float().abs().max().item()
    with ops.use(linear="cublaslt"):
        assert ops.choose("linear", x, w) == "cublaslt"


def _operands_and_algorithms(m, n, k):
    """bf16 ``x [m, k]``, ``w [n, k]`` on the GPU and the algorithms cuBLASLt offers for their product."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
    return x, w, binding.candidates(binding.plan(m, n, k, x.dtype, x.device))


@needs_cuda
def test_tuned_algorithm_replays_in_a_cuda_graph(fresh_cache):
    m, n, k = 160, 2048, 1024
    x, w, offered = _operands_and_algorithms(m, n, k)
    algo = offered[-1].algo  # not the heuristic's favourite: the one F.linear would not run
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    binding.matmul(x, w, out, algo)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        binding.matmul(x, w, out, algo)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        want = (x.float() @ w.float().T)
        assert (out.float() - want).abs().max().item() < 2e-2 * want.abs().max().item()


@needs_cuda
def test_falls_back_to_f_linear_for_bias_and_untuned_shapes(fresh_cache):
    x = torch.randn(3, 5, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(cublaslt.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(cublaslt.linear(x, w), F.linear(x, w))  # untuned, outside autotune
    shifted = torch.randn(3 * 5 * 256 + 8, device="cuda", dtype=torch.bfloat16)[8:].view(3, 5, 256)
    assert shifted.data_ptr() % cublaslt.ALIGNMENT  # 16 bytes into a buffer: the algorithms may not take it
    assert torch.equal(cublaslt.linear(shifted, w), F.linear(shifted, w))
    with tuning.autotune():
        y = cublaslt.linear(x, w)  # tunes 15 x 384 x 256, then runs the choice on the 3-d input
    assert y.shape == (3, 5, 384)
    assert (y.float() - F.linear(x, w).float()).abs().max().item() < 2e-2 * F.linear(x, w).float().abs().max().item()


@needs_cuda
def test_linear_runs_the_persisted_algorithm(fresh_cache):
    from ninefold.ops.dispatch import device_model

    m, n, k = 64, 2048, 1024
    x, w, offered = _operands_and_algorithms(m, n, k)
    # not the heuristic's favourite (F.linear's), and without split-K, so two runs give the same bits
    picks = [c for c in offered[1:] if c.config["splitk"] in (0, 1)]
    if not picks:
        pytest.skip(f"cuBLASLt offered no second split-free algorithm: {[c.name() for c in offered]}")
    pick = picks[-1]
    tuning.CACHE.store(tuning.key(device_model(x.device), x.dtype, m, n, k),
                       {"algo": binding.algo_words(pick.algo), "name": pick.name()})
    tuning.forget()  # read back from the file, as a new process would
    want = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    binding.matmul(x, w, want, pick.algo)
    assert torch.equal(cublaslt.linear(x, w), want)


def test_search_mode_names_the_accepted_values(monkeypatch):
    monkeypatch.setenv("NINEFOLD_CUBLASLT_SEARCH", "everything")
    with pytest.raises(ValueError, match="NINEFOLD_CUBLASLT_SEARCH: got 'everything'; expected 'heuristic' or 'exhaustive'"):
        tuning.search_mode()
    monkeypatch.setenv("NINEFOLD_CUBLASLT_SEARCH", "exhaustive")
    assert tuning.search_mode() == "exhaustive"


@needs_cuda
def test_enumerated_configurations_are_accepted_and_match_float64():
    g = torch.Generator(device="cuda").manual_seed(1)
    m, n, k = 200, 1024, 2048
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    found = binding.enumerated(binding.plan(m, n, k, x.dtype, x.device), limit=600)
    heuristic = binding.candidates(binding.plan(m, n, k, x.dtype, x.device))
    assert len(found) > len(heuristic), (len(found), len(heuristic))
    assert any(c.config["splitk"] > 1 for c in found)  # K splits are part of the search
    for cand in found[:: max(1, len(found) // 40)]:  # a spread of 40 of them
        out = torch.empty(m, n, device="cuda", dtype=x.dtype)
        binding.matmul(x, w, out, cand.algo)
        err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-2, (cand.name(), err)
