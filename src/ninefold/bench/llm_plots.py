"""Plot of the offline workload's steps against their roofline bound (matplotlib, no display needed).

``python -m ninefold.bench.llm_plots PROFILE_JSON --copy-gbps G --tflops T --out PNG`` reads the step
log that ``python -m ninefold.bench.llm_profile`` writes (``llm_profile.json``: wall time, sequences, new
and context tokens of every step of the offline run) and draws each step's time next to its bound,
``max(FLOPs / matmul rate, (weight bytes + KV bytes read) / copy bandwidth)``, over the run and as a
share of the bound against the batch size. Steps the profiler recorded kernel by kernel ran slower
and are left out, as is an empty step (no sequences). The ceilings are arguments: pass the ones measured on the same card.

Given ``llm_profile_gaps.json`` (``llm_profile --gaps``) instead, it draws each decode step's wall time
split into the time kernels run and the idle time between them, by batch size (no ceilings needed); given a
file with ``{"runs": {label: bench_llm.json, ...}}``, bars of their batch-1 decode and offline figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure


def step_bounds(steps: list[dict], model, copy_bps: float, flops_per_s: float, *, itemsize: int = 2,
                weight_bytes: int | None = None) -> list[float]:
    """Each step's bound in ms for ``model`` (a dummy shape's name or a ``ModelConfig``) with weights and
    KV of ``itemsize`` bytes (bfloat16 by default; ``weight_bytes`` replaces the weights' size computed
    from the shape): the larger of its FLOPs at ``flops_per_s`` and its bytes at ``copy_bps``.

    FLOPs: 2 x the linear layers' parameters per new token, the LM head per sequence, and attention
    as ``4 x layers x heads x head_dim`` per (query, key) pair: ``attended`` when the step log has it
    (a row of n new tokens after ``start`` cached ones attends ``n * start + n * (n + 1) / 2`` pairs),
    else one pair per context token (exact for decode rows, low for prefill chunks: logs written before
    ``attended`` existed). Bytes: the weights once, each sequence's keys and values once."""
    from ninefold.bench.llm import _linear_params, kv_bytes_per_token
    from ninefold.llm.config import NAMED_SHAPES, ModelConfig

    mc = ModelConfig.from_dict(NAMED_SHAPES[model]) if isinstance(model, str) else model
    linear = _linear_params(mc)
    embeddings = (1 if mc.tie_word_embeddings else 2) * mc.vocab_size * mc.hidden_size
    norms = (2 * mc.num_layers + 1) * mc.hidden_size  # (q/k/v biases and q/k norms, under 0.01%, left out)
    if weight_bytes is None:
        weight_bytes = itemsize * (linear + embeddings + norms)
    kv_per_token = kv_bytes_per_token(mc, itemsize)
    out = []
    for s in steps:
        flops = (2 * linear * s["new_tokens"] + 2 * mc.hidden_size * mc.vocab_size * s["seqs"]
                 + 4 * mc.num_layers * mc.num_heads * mc.head_dim * s.get("attended", s["context_tokens"]))
        memory = weight_bytes + kv_per_token * s["context_tokens"]
        out.append(max(flops / flops_per_s, memory / copy_bps) * 1e3)
    return out


def plot_offline_steps(profile: dict, model: str, copy_bps: float, flops_per_s: float, path: str | Path) -> dict:
    """Draw the offline step log of ``profile`` (``llm_profile.json``) against its bound; returns the totals."""
    log = profile["offline"]
    skipped = {p["step"] for p in log.get("profiled", [])}
    kept = [i for i, s in enumerate(log["steps"]) if i not in skipped and s["seqs"] > 0]  # (a last, empty step)
    steps, index = [log["steps"][i] for i in kept], kept
    bounds = step_bounds(steps, model, copy_bps, flops_per_s)
    measured = [s["ms"] for s in steps]
    decode = [j for j, s in enumerate(steps) if s["new_tokens"] == s["seqs"]]

    fig = Figure(figsize=(13, 4.8), layout="constrained")
    over_time, by_batch = fig.subplots(1, 2)
    over_time.plot(index, measured, lw=0.8, label="measured (wall)")
    over_time.plot(index, bounds, lw=0.8, label="bound")
    over_time.set(yscale="log", xlabel="step", ylabel="ms per step", title="offline steps (prefill steps on top)")
    over_time.legend()
    by_batch.scatter([steps[j]["seqs"] for j in decode], [bounds[j] / measured[j] for j in decode], s=4)
    by_batch.set(xlabel="sequences in the step", ylabel="bound / measured", ylim=(0, 1),
                 title="decode steps: share of the bound reached")
    total, bound = sum(measured), sum(bounds)
    fig.suptitle(f"{model}: {len(steps)} steps, {total / 1e3:.2f} s measured against {bound / 1e3:.2f} s of "
                 f"per-step bounds ({bound / total:.0%}); copy {copy_bps / 1e9:.0f} GB/s, "
                 f"matmul {flops_per_s / 1e12:.0f} TFLOP/s")
    fig.savefig(path, dpi=100)
    return {"steps": len(steps), "measured_s": total / 1e3, "bound_s": bound / 1e3}


def plot_decode_gaps(gaps: list[dict], path: str | Path) -> dict:
    """Bars of ``llm_profile --gaps`` rows: busy, idle between kernels (under the profiler) and the wall
    time without it, per batch size; returns the largest idle share."""
    labels = [f"{g['batch']} x {g['context']}" for g in gaps]
    busy = [g["busy_ms"] for g in gaps]
    idle = [g["idle_between_kernels_ms"] for g in gaps]
    wall = [g["wall_ms"] for g in gaps]
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.subplots()
    x = range(len(gaps))
    ax.bar(x, busy, label="kernels running (profiled)")
    ax.bar(x, idle, bottom=busy, label="idle between kernels (profiled)")
    ax.scatter(x, wall, color="black", zorder=3, label="wall per step, no profiler")
    ax.set_xticks(list(x), labels)
    ax.set(xlabel="decode batch x context tokens", ylabel="ms per step",
           title="CUDA-graph decode steps: where the device is busy")
    ax.legend()
    worst = max((i / w for i, w in zip(idle, wall)), default=0.0)
    fig.suptitle(f"idle between kernels at most {worst:.1%} of a step")
    fig.savefig(path, dpi=100)
    return {"rows": len(gaps), "max_idle_share": worst}


def plot_runs(runs: dict[str, dict], path: str | Path) -> dict:
    """Bars of ``bench.llm`` results side by side (``{label: bench_llm.json}``, e.g. bfloat16 and FP8 weights on one
    card): batch-1 decode and offline total tok/s, each with its run's roofline as a tick; returns the ratios to the
    first run."""
    labels = list(runs)
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    decode_ax, offline_ax = fig.subplots(1, 2)
    ratios = {}
    for ax, part, key, bound_key, title in (
            (decode_ax, "decode_batch1", "tok_per_s", "roofline_tok_per_s", "batch-1 decode (tok/s)"),
            (offline_ax, "offline", "total_tok_per_s", "roofline_total_tok_per_s", "offline 256 requests (total tok/s)")):
        values = [runs[label][part][key] for label in labels]
        bounds = [runs[label][part].get(bound_key) for label in labels]
        bars = ax.bar(labels, values)
        ax.bar_label(bars, [f"{v:.0f}" for v in values])
        ax.scatter([i for i, b in enumerate(bounds) if b], [b for b in bounds if b], marker="_", s=900, color="black",
                   label="roofline of the run")
        ax.set(title=title)
        ax.legend(loc="lower right")
        ratios[part] = [v / values[0] for v in values]
    first = next(iter(runs.values()))
    fig.suptitle(f"{first.get('model', '')} on {first.get('device', '')}: "
                 + ", ".join(f"{label} {r:.2f}x / {o:.2f}x" for label, r, o in
                             zip(labels, ratios["decode_batch1"], ratios["offline"])) + " (decode / offline)")
    fig.savefig(path, dpi=100)
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.llm_plots", description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="llm_profile.json (or llm_profile_gaps.json) from python -m ninefold.bench.llm_profile")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--copy-gbps", type=float, help="measured copy bandwidth, GB/s (offline step logs)")
    parser.add_argument("--tflops", type=float, help="measured bf16 matmul rate, TFLOP/s (offline step logs)")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    profile = json.loads(Path(args.profile).read_text())
    if "runs" in profile:  # bench.llm results to compare (e.g. docs/perf/data/llm_fp8_h100.json)
        ratios = plot_runs(profile["runs"], args.out)
        print(f"{args.out}: {', '.join(profile['runs'])}; against the first: {ratios}")
        return 0
    if "gaps" in profile:
        totals = plot_decode_gaps(profile["gaps"], args.out)
        print(f"{args.out}: {totals['rows']} decode cases, idle between kernels at most {totals['max_idle_share']:.1%}")
        return 0
    if "offline" not in profile:
        parser.error(f"{args.profile}: no offline step log (run llm_profile without --whole-offline or --host)")
    if args.copy_gbps is None or args.tflops is None:
        parser.error("--copy-gbps and --tflops: both are needed for an offline step log (the card's measured ceilings)")
    totals = plot_offline_steps(profile, args.model, args.copy_gbps * 1e9, args.tflops * 1e12, args.out)
    print(f"{args.out}: {totals['steps']} steps, {totals['measured_s']:.2f} s measured, {totals['bound_s']:.2f} s of bounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
