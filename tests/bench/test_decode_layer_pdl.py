"""``python -m ninefold.bench.decode_layer_pdl``: its CPU paths (``--smoke``), arguments and PDL switches."""

import json
import os

import pytest
import torch

from .helpers import run_bench

pytest.importorskip("triton")


def _run(*args, out=None):
    return run_bench("decode_layer_pdl", *args, out=out)


def test_smoke_checks_the_step_and_skips_pdl_without_a_gpu(tmp_path):
    done = _run("--smoke", "--context", "33", out=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "decode_layer_pdl.json").read_text())
    assert result["shapes"]["context"] == 33 and result["cos_vs_unfused"] >= 0.995
    variants = result["variants"]
    assert set(variants) == {"no_pdl", "pdl_gemv", "pdl_rope", "pdl_attn", "pdl_all", "pdl_all_early"}
    assert variants["no_pdl"]["ok"] and variants["no_pdl"]["eager"]["bit_equal"]
    for name in ("pdl_gemv", "pdl_rope", "pdl_attn", "pdl_all", "pdl_all_early"):
        assert "PDL not available" in variants[name]["skipped"]
    assert "no_pdl step vs the unfused ops" in done.stdout


@pytest.mark.parametrize("args,message", [(["--iters", "0"], "--iters must be >= 1, got 0"),
                                          (["--context", "0"], "--context must be in 1..128, got 0"),
                                          (["--variants", "fast"], "invalid choice: 'fast'")])
def test_bad_arguments_are_named(args, message):
    done = _run("--smoke", *args)
    assert done.returncode == 2 and message in done.stderr


def test_switches_set_each_kernel_and_restore(monkeypatch):
    from ninefold.bench.decode_layer_pdl import switches
    from ninefold.ops.triton import decode, rope_cache

    monkeypatch.delenv("NINEFOLD_GEMV_PDL", raising=False)
    monkeypatch.delenv("NINEFOLD_DECODE_EARLY_KV", raising=False)
    before = decode.pdl_wanted, rope_cache.pdl_wanted
    with switches(True, False, True, early=True):
        assert os.environ["NINEFOLD_GEMV_PDL"] == "1" and decode.early_kv_wanted()
        assert rope_cache.pdl_wanted(torch.device("cpu")) is False
        assert decode.pdl_wanted(torch.device("cpu")) is False  # no PDL on a CPU whatever the switch
    assert (decode.pdl_wanted, rope_cache.pdl_wanted) == before and "NINEFOLD_GEMV_PDL" not in os.environ
    assert not decode.early_kv_wanted()
