"""``python -m ninefold.bench.fp8_gemv``: its candidates fit the layers it times, its "before" arm is what FP8
decode ran (the norm's kernel, then the few-rows FP8 GEMV), and without an FP8 GPU it measures nothing."""

import pytest
import torch

pytest.importorskip("triton")

from ninefold.bench import fp8_gemv as bench  # noqa: E402


@pytest.mark.parametrize("name, n, k, prologue", bench.LAYERS)
def test_candidates_fit_k(name, n, k, prologue):
    found = bench.candidates(k)
    assert len(found) >= 8, name
    for _bn, bk, sk, _nw, _ns, variant in found:
        assert k % (bk * sk) == 0 and variant in (0, 1, 2)
        assert variant != 2 or k // sk >= 2 * bk


@pytest.mark.parametrize("rows", [4, 16])
def test_few_rows_candidates_fit_k_and_launch_as_gemv_rows_takes_them(rows):
    for _name, _n, k, _prologue in bench.LAYERS:
        found = bench.candidates(k, rows)
        assert len(found) >= 4 and all(len(c) == 5 and k % (c[1] * c[2]) == 0 for c in found)
    args = bench._launch_args((32, 256, 2, 4, 3), rows, pdl=False)
    assert args == dict(split_k=2, pdl=False, block_n=32, block_k=256, num_warps=4, num_stages=3)
    assert bench._launch_args((16, 512, 1, 4, 2, 2), 1, pdl=True)["depth"] == 2


def test_a_short_k_drops_the_candidates_it_cannot_hold():
    assert all(bk * sk <= 512 for _bn, bk, sk, *_ in bench.candidates(512))
    assert not any(c[5] == 2 and c[1] == 512 for c in bench.candidates(512))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9),
                    reason="checks the refusal without an FP8 GPU")
def test_without_an_fp8_gpu_it_refuses(capsys):
    assert bench.main([]) == 2
    assert "needs a CUDA device of compute capability 8.9 or later" in capsys.readouterr().err


def test_plot_from_an_earlier_run_draws_every_layer(tmp_path):
    import json

    rows = [{"layer": name, "rows": 1, "bound_us": 5.0 + i, "before_us": 10.0 + i, "best_us": 8.0 + i}
            for i, (name, *_shape) in enumerate(bench.LAYERS)]
    rows[0]["bf16_us"] = 12.0
    source = tmp_path / "fp8_gemv.json"
    source.write_text(json.dumps({"device": "a GPU", "copy_bandwidth": 3e12, "pdl": True, "results": rows}))
    assert bench.main(["--plot-from", str(source)]) == 0
    assert (tmp_path / "fp8_gemv.png").read_bytes()[:4] == b"\x89PNG"
