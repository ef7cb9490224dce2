"""``python -m ninefold.bench.fp8_gemv``: its candidates fit the layers it times, its "before" arm is what FP8
decode ran (the norm's kernel, then the few-rows FP8 GEMV), and without an FP8 GPU it measures nothing."""

import pytest
import torch

pytest.importorskip("triton")

from ninefold.bench import fp8_gemv as bench  # noqa: E402


@pytest.mark.parametrize("name, n, k, prologue", bench.LAYERS)
def test_candidates_fit_k(name, n, k, prologue):
    found = bench.candidates(k)
    assert len(found) >= 10, name
    for _bn, bk, sk, _nw, _ns, variant in found:
        assert k % (bk * sk) == 0 and variant in (0, 1, 2)
        assert variant != 2 or k // sk >= 2 * bk


def test_a_short_k_drops_the_candidates_it_cannot_hold():
    assert all(bk * sk <= 512 for _bn, bk, sk, *_ in bench.candidates(512))
    assert not any(c[5] == 2 and c[1] == 512 for c in bench.candidates(512))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9),
                    reason="checks the refusal without an FP8 GPU")
def test_without_an_fp8_gpu_it_refuses(capsys):
    assert bench.main([]) == 2
    assert "needs a CUDA device of compute capability 8.9 or later" in capsys.readouterr().err
