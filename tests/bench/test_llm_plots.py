"""``ninefold.bench.llm_plots``: per-step bounds and the offline step plot."""

import json

import pytest

from ninefold.bench import llm_plots
from ninefold.llm.config import NAMED_SHAPES, ModelConfig


def test_decode_step_bound_is_weights_plus_kv_at_copy_bandwidth():
    mc = ModelConfig.from_dict(NAMED_SHAPES["llama-3.1-8b"])
    step = {"ms": 10.0, "seqs": 64, "new_tokens": 64, "context_tokens": 64 * 1000}
    (bound,) = llm_plots.step_bounds([step], "llama-3.1-8b", copy_bps=4e12, flops_per_s=8e14)
    weights = 2 * 8_030_261_248  # bfloat16 Llama-3.1-8B, embedding and LM head included
    kv = 64 * 1000 * 2 * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim
    assert bound == pytest.approx((weights + kv) / 4e12 * 1e3)  # 64 rows: memory-bound


def test_prefill_step_bound_is_compute():
    step = {"ms": 400.0, "seqs": 10, "new_tokens": 16384, "context_tokens": 16384}
    (bound,) = llm_plots.step_bounds([step], "llama-3.1-8b", copy_bps=4e12, flops_per_s=8e14)
    assert 250 < bound < 320  # ~16 GFLOP per token at 800 TFLOP/s


def test_attended_pairs_set_the_attention_flops_and_a_config_stands_for_a_name():
    mc = ModelConfig.from_dict(NAMED_SHAPES["llama-3.1-8b"])
    # one 4096-token prompt from scratch: 4096 * 4097 / 2 query-key pairs
    step = {"seqs": 1, "new_tokens": 4096, "context_tokens": 4096, "attended": 4096 * 4097 // 2}
    (with_pairs,) = llm_plots.step_bounds([step], mc, copy_bps=4e12, flops_per_s=8e14)
    (old_log,) = llm_plots.step_bounds([{k: v for k, v in step.items() if k != "attended"}], "llama-3.1-8b",
                                       copy_bps=4e12, flops_per_s=8e14)
    extra = 4 * mc.num_layers * mc.num_heads * mc.head_dim * (4096 * 4097 // 2 - 4096)
    assert with_pairs - old_log == pytest.approx(extra / 8e14 * 1e3)


def test_plot_skips_profiled_steps_and_writes_the_image(tmp_path):
    steps = [{"ms": 380.0, "seqs": 20, "new_tokens": 16384, "context_tokens": 16384}]
    steps += [{"ms": 9.0 - i * 0.01, "seqs": 200 - i, "new_tokens": 200 - i, "context_tokens": (200 - i) * 700}
              for i in range(50)]
    profile = {"offline": {"steps": steps, "profiled": [{"step": 3}]}}
    (tmp_path / "p.json").write_text(json.dumps(profile))
    out = tmp_path / "steps.png"
    assert llm_plots.main([str(tmp_path / "p.json"), "--copy-gbps", "4000", "--tflops", "800", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    totals = llm_plots.plot_offline_steps(profile, "llama-3.1-8b", 4e12, 8e14, tmp_path / "again.png")
    assert totals["steps"] == 50 and totals["measured_s"] == pytest.approx((sum(s["ms"] for s in steps) - steps[3]["ms"]) / 1e3)


def test_gaps_plot_needs_no_ceilings_and_offline_plot_does(tmp_path):
    gaps = [{"batch": b, "context": 600, "wall_ms": 4.0 + b / 50, "busy_ms": 3.9 + b / 50, "idle_between_kernels_ms": 0.2}
            for b in (1, 64, 256)]
    (tmp_path / "g.json").write_text(json.dumps({"gaps": gaps}))
    out = tmp_path / "gaps.png"
    assert llm_plots.main([str(tmp_path / "g.json"), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert llm_plots.plot_decode_gaps(gaps, tmp_path / "again.png")["max_idle_share"] == pytest.approx(0.2 / 4.02)
    (tmp_path / "p.json").write_text(json.dumps({"offline": {"steps": [], "profiled": []}}))
    with pytest.raises(SystemExit):
        llm_plots.main([str(tmp_path / "p.json"), "--out", str(tmp_path / "x.png")])


def test_runs_side_by_side_give_ratios_to_the_first(tmp_path):
    def run(decode, offline):
        return {"model": "llama-3.1-8b", "device": "card",
                "decode_batch1": {"tok_per_s": decode, "roofline_tok_per_s": 2 * decode},
                "offline": {"total_tok_per_s": offline, "roofline_total_tok_per_s": 1.5 * offline}}

    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": {"bfloat16": run(200.0, 18000.0), "FP8 layers": run(230.0, 19800.0)}}))
    assert llm_plots.main([str(path), "--out", str(tmp_path / "runs.png")]) == 0
    assert (tmp_path / "runs.png").stat().st_size > 10_000
    ratios = llm_plots.plot_runs(json.loads(path.read_text())["runs"], tmp_path / "again.png")
    assert ratios["decode_batch1"] == pytest.approx([1.0, 1.15]) and ratios["offline"] == pytest.approx([1.0, 1.1])
