"""``python -m ninefold.bench.gemv_rows``: its candidate configurations fit the layers it times, its
inputs (``decode_chain._tuning_inputs`` with rows) match the prologues' float32 results, and without a GPU it measures nothing and says so."""

import pytest
import torch

pytest.importorskip("triton")

from ninefold.bench import gemv_rows as bench  # noqa: E402


@pytest.mark.parametrize("name, n, k, prologue", bench.LAYERS)
def test_candidates_divide_k_and_split_only_narrow_outputs(name, n, k, prologue):
    found = bench.candidates(n, k)
    assert found, name
    for bn, bk, sk, nw, ns in found:
        assert k % (bk * sk) == 0 and bn in (16, 32, 64) and nw == 4 and ns in (3, 4)
        assert sk == 1 or n < 8192


def test_inputs_give_the_prologue_results():
    import ninefold.ops as ops

    torch.manual_seed(0)
    kw, xin = bench._tuning_inputs(torch.empty(8, 64), "add_rms_norm", bench.EPS, rows=3)
    assert kw["x"].shape == (3, 64)
    normed, total = ops.add_rms_norm(kw["x"], kw["residual"], kw["norm_weight"], bench.EPS)
    torch.testing.assert_close(xin, normed)
    kw, xin = bench._tuning_inputs(torch.empty(8, 32), "silu_and_mul", bench.EPS, rows=2)
    torch.testing.assert_close(xin, ops.silu_and_mul(kw["x"]))
    w = torch.randn(8, 32)
    torch.testing.assert_close(bench._unfused(kw, w, "silu_and_mul"), xin @ w.T)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_without_a_gpu_it_refuses(capsys):
    assert bench.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_a_configuration_that_computes_the_wrong_product_is_reported_and_not_timed():
    want = torch.ones(2, 3)
    out = bench.time_configs([(1,), (2,)], lambda cfg: {"scale": cfg[0]}, lambda a, i: want * a["scale"], want, 4)
    assert [c["config"] for c in out["configs"]] == [[1], [2]]
    assert "relative error 1" in out["configs"][1]["error"] and "us" not in out["configs"][1]
    if not torch.cuda.is_available():  # the right one reaches the graph timing, which needs CUDA
        assert "error" in out["configs"][0] and "best" not in out
