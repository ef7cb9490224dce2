"""``ninefold.bench.llm``: the smoke run on the CPU, and the gpt-fast peer's argument check."""

import json
import types

import pytest

from ninefold.bench import llm
from ninefold.bench.gpt_fast_peer import load_model_module


def test_smoke_run_measures_every_part(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    (tmp_path / "triton-cache").mkdir()  # this test's own: other workers may compile into the shared one
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    assert llm.main(["--smoke"]) == 0
    results = json.loads((tmp_path / "bench_llm.json").read_text())
    for part in ("decode_batch1", "ttft", "host_overhead", "offline"):
        assert "error" not in results[part], results[part]
    assert results["decode_batch1"]["tok_per_s"] > 0
    assert results["decode_batch1"]["gpt_fast_measured"] is False  # no checkout given: DESIGN.md's figure
    assert results["offline"]["complete"] and results["offline"]["output_tokens"] > 0
    assert results["offline"]["triton_kernels_compiled"] == 0  # the CPU run compiles no Triton kernel
    offline = results["offline"]
    # every launched step is in the schedule's bound, which the workload bound can only undercut
    assert offline["steps"] >= max(1, offline["output_tokens"] // 6)
    assert offline["step_bound_s"] >= offline["roofline_bound_s"] * 0.999
    assert offline["fraction_of_step_bound"] == pytest.approx(offline["step_bound_s"] / offline["elapsed_s"])


def test_the_reference_rounds_keys_and_values_as_an_fp8_cache_holds_them(tmp_path, monkeypatch):
    # On the CPU in float32 the engine and the reference differ only in summation order once the reference reads
    # FP8-rounded keys and values as the cache does (without that rounding they part by about 2% here).
    monkeypatch.setenv("OUT", str(tmp_path))
    (tmp_path / "triton-cache").mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    assert llm.main(["--smoke", "--parts", "decode_batch1", "--kv-cache-dtype", "fp8"]) == 0
    results = json.loads((tmp_path / "bench_llm.json").read_text())
    assert results["engine"]["kv_cache_dtype"] == "float8_e4m3fn"
    check = results["correctness"]
    assert check["prefill_rel_error"] < 1e-4 and check["decode_eager_rel_error_vs_fp32"] < 1e-4, check


def test_triton_cache_entries_name_the_kernels_of_each_entry(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from triton import knobs

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    assert llm.triton_cache_entries() == {}
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "decode_split_kernel.json").write_text("{}")
    (tmp_path / "abc" / "decode_split_kernel.cubin").write_bytes(b"")
    (tmp_path / "def").mkdir()
    (tmp_path / "def" / "__grp__argmax_kernel.json").write_text("{}")
    assert llm.triton_cache_entries() == {"abc": ["decode_split_kernel"], "def": []}
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path / "missing"))
    assert llm.triton_cache_entries() is None


def test_gpt_fast_peer_needs_a_checkout(tmp_path):
    with pytest.raises(ValueError, match="--gpt-fast: no model.py"):
        load_model_module(tmp_path)


def test_parts_selects_what_runs_and_the_table_shows_only_those(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    (tmp_path / "triton-cache").mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    assert llm.main(["--smoke", "--parts", "ttft,offline"]) == 0
    results = json.loads((tmp_path / "bench_llm.json").read_text())
    assert "ttft" in results and "offline" in results
    assert "decode_batch1" not in results and "host_overhead" not in results
    table = capsys.readouterr().out
    assert "| TTFT 64 tokens (ms)" in table and "| offline total tok/s" in table and "batch-1 decode" not in table
    assert llm.main(["--smoke", "--parts", "offline"]) == 0  # the same workload without the parts before it
    alone = json.loads((tmp_path / "bench_llm.json").read_text())["offline"]
    assert (alone["output_tokens"], alone["prompt_tokens"], alone["roofline_bound_s"]) == (
        results["offline"]["output_tokens"], results["offline"]["prompt_tokens"], results["offline"]["roofline_bound_s"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        llm.main(["--smoke", "--parts", "ttft,warp"])
    assert "--parts: unknown part(s) warp; choose from decode_batch1, ttft, host_overhead, offline" in capsys.readouterr().err


def test_host_sampling_sets_the_host_parts_requests_and_bad_items_are_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    (tmp_path / "triton-cache").mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    assert llm.main(["--smoke", "--parts", "host_overhead", "--host-sampling", "temperature=0.8,top_p=0.95,seed=3"]) == 0
    rows = json.loads((tmp_path / "bench_llm.json").read_text())["host_overhead"]
    assert rows and all(r["sampling"] == {"temperature": 0.8, "top_p": 0.95, "seed": 3} for r in rows)
    assert llm.parse_sampling("") == {} and llm.parse_sampling("top_k=40, min_p=0.1") == {"top_k": 40, "min_p": 0.1}
    for bad, named in (("warmth=1", "warmth=1"), ("top_p=high", "top_p takes a number"), ("top_p=1.5", "top_p")):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            llm.main(["--smoke", "--host-sampling", bad])
        assert named in capsys.readouterr().err


def test_the_offline_bound_counts_what_any_schedule_must_do():
    mc = types.SimpleNamespace(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32,
                               intermediate_size=64, vocab_size=100)
    # one long request beside short ones: with two slots the short ones take turns in the second, so the
    # long one's 9 decode steps suffice (not 9 per "wave" of two requests)
    terms = llm.offline_bound_terms(mc, [5, 5, 5, 5], [10, 2, 2, 2], weight_bytes=1000, max_num_seqs=2, itemsize=2)
    assert terms["decode_steps"] == 9 and terms["weight_bytes"] == 9_000
    # many equal requests through few slots: their decode tokens over the slots
    assert llm.offline_bound_terms(mc, [5] * 6, [5] * 6, 1000, 2, 2)["decode_steps"] == 12
    # every request at once (the benchmark's 256 requests in 256 sequences): the longest request's decode steps
    assert llm.offline_bound_terms(mc, [5] * 6, [4, 9, 2, 2, 2, 2], 1000, 6, 2)["decode_steps"] == 8
    # a prompt of 3 and 3 outputs: the prefill gives the first; decode tokens 1 and 2 attend 4 and 5 positions
    one = llm.offline_bound_terms(mc, [3], [3], 1000, 1, 2)
    per_token = 2 * 2 * 2 * 8 * 2  # (k and v) x layers x KV heads x head size x bytes
    assert one["kv_bytes"] == per_token * (4 + 5)
    params = 2 * (32 * (4 + 2 * 2) * 8 + 4 * 8 * 32 + 3 * 32 * 64)  # two layers of q/k/v, o, gate/up/down
    logits = 2 * 32 * 100
    attention = 2 * 4 * 4 * 8 * (3 * 4 / 2 + 4 + 5)  # 4 FLOPs a (query, key) pair per layer and head
    assert one["flops"] == 2 * params * 3 + logits + 2 * (2 * params + logits) + attention
    assert one["flops"] == llm.prefill_flops(mc, 3) + 2 * (2 * params + logits) + 2 * 4 * 4 * 8 * 9


def test_the_table_says_when_kernels_compiled_during_the_timed_offline_run(capsys):
    offline = {"num_requests": 256, "complete": True, "total_tok_per_s": 15472.0, "roofline_total_tok_per_s": 26066.0,
               "fraction_of_roofline": 0.594, "output_tok_per_s": 7693.0, "roofline_output_tok_per_s": 12900.0}
    for compiled, shown in ((3, "| offline total tok/s (256 req, 3 kernels compiled while timed) | 15472 |"),
                            (0, "| offline total tok/s (256 req) | 15472 |")):
        llm.print_table({"model": "m", "dtype": "bfloat16", "device": "d", "total_s": 1.0,
                         "offline": {**offline, "triton_kernels_compiled": compiled}})
        assert shown in capsys.readouterr().out
