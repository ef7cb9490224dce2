"""``python -m ninefold.bench.decode_chain --smoke``: every CPU path of the decode-chain benchmark."""

import json

import pytest

from .helpers import run_bench

pytest.importorskip("triton")


def _run(*args, out=None):
    return run_bench("decode_chain", *args, out=out)


def test_smoke_checks_every_variant_against_cublas(tmp_path):
    done = _run("--smoke", out=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "decode_chain.json").read_text())
    variants = result["variants"]
    assert set(variants) == {"cublas", "gemv", "gemv_pdl", "fused", "fused_pdl", "mixed", "mixed_pdl", "ops",
                             "ops_pdl"}
    for name in ("cublas", "gemv", "fused", "mixed", "ops"):
        assert variants[name]["ok"] and variants[name]["cos_logits"] >= 0.995, (name, variants[name])
    assert variants["cublas"]["max_rel_logits"] == 0.0
    for name in ("gemv_pdl", "fused_pdl", "mixed_pdl", "ops_pdl"):
        assert "PDL not available" in variants[name]["skipped"]
    assert result["weight_bytes"] > 0 and "gemv " in done.stdout
    assert (tmp_path / "gemv_pdl.env").read_text() == "NINEFOLD_GEMV_PDL=0\n"
    table = json.loads((tmp_path / "gemv_table.json").read_text())
    assert {(e["n"], e["k"], e["prologue"]) for e in table} >= {(512, 256, "add_rms_norm"), (256, 512, "silu_and_mul")}


def test_bad_arguments_exit_with_usage():
    done = _run("--smoke", "--iters", "0")
    assert done.returncode == 2 and "--iters must be >= 1" in done.stderr


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_two_layers_agree_and_time(tmp_path):
    done = run_bench("decode_chain", "--layers", "2", "--iters", "5", "--no-tune", "--no-profile", out=tmp_path,
                     interpret=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "decode_chain.json").read_text())
    for name, entry in result["variants"].items():
        assert entry.get("skipped") or (entry["ok"] and entry["ms_per_token"] > 0), (name, entry)


def test_pdl_is_recommended_only_when_correct_and_faster():
    from ninefold.bench.decode_chain import recommend_pdl

    ok = dict(ok=True)
    assert recommend_pdl({"ops": dict(ok, ms_per_token=4.0), "ops_pdl": dict(ok, ms_per_token=3.9)}) == 1
    assert recommend_pdl({"ops": dict(ok, ms_per_token=4.0), "ops_pdl": dict(ok, ms_per_token=3.99)}) == 0
    assert recommend_pdl({"ops": dict(ok, ms_per_token=4.0), "ops_pdl": dict(ok=False, ms_per_token=3.0)}) == 0
    assert recommend_pdl({"fused": dict(ok, ms_per_token=4.0), "fused_pdl": dict(ok, ms_per_token=3.0),
                          "ops_pdl": {"skipped": "no PDL"}}) == 1
    assert recommend_pdl({"fused": dict(ok, ms_per_token=4.0), "fused_pdl": dict(ok, ms_per_token=float("nan"))}) == 0
