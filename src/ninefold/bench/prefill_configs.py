"""Launch configurations of the Triton prefill attention on the batches an engine step gives it.

    OUT=DIR python -m ninefold.bench.prefill_configs          # one CUDA device, Llama-3-8B heads, bf16, < 1 min
    TRITON_INTERPRET=1 python -m ninefold.bench.prefill_configs --device cpu   # plumbing check (tiny, eager)

Cases: 29 prompts of 100-1024 tokens (seed 0; 17496 tokens, about the offline benchmark's first step of
16384), 32 prompts of 512, 4 of 1024, one of 4096; and, with keys from the paged cache, the 29 prompts
with the first half of each cached, one 4096-token prompt with 2048 cached, and chunks of 512 and 1024 new
tokens over 8192 and 16384 cached (chunked prefill of long prompts). Each configuration of ``CONFIGS``
(query rows, key rows, warps, stages) is checked against a float32 evaluation written here and timed in
a CUDA graph (microseconds per call, causal TFLOP/s). ``ninefold.ops.triton.prefill``'s
``CONFIG`` / ``MEDIUM_CONFIG`` / ``SHORT_CONFIG`` come from these tables. Prints one line per
configuration and writes ``$OUT/prefill_configs.json``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys

import torch

from ninefold.bench.decode_attention import paged_caches
from ninefold.bench.results import write_json

CONFIGS = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in (
    (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3),
    (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 4, 3), (128, 64, 4, 2), (128, 64, 4, 3), (64, 32, 4, 3),
    (128, 32, 8, 3), (64, 64, 8, 3))]


def offline_first_step(seed: int = 0, prompts: int = 29) -> list[int]:
    """Prompt lengths like those of the offline benchmark's first step: uniform in 100..1024."""
    rng = random.Random(seed)
    return [rng.randint(100, 1024) for _ in range(prompts)]


def cases(device: torch.device) -> list[tuple[str, list[int], list[int]]]:
    """(name, new tokens per sequence, keys per sequence): packed cases have as many keys as new tokens."""
    if device.type != "cuda":
        return [("3 packed", [5, 17, 9], [5, 17, 9]), ("2 paged", [4, 11], [9, 20])]
    step = offline_first_step()
    return [("29 prompts of 100-1024", step, step), ("32 x 512", [512] * 32, [512] * 32),
            ("4 x 1024", [1024] * 4, [1024] * 4), ("1 x 4096", [4096], [4096]),
            ("29 prompts, half cached (paged)", [max(1, n // 2) for n in step], step),
            ("1 x 4096, 2048 cached (paged)", [2048], [4096]),
            ("4 x 512 new over 8192 cached (paged)", [512] * 4, [8704] * 4),
            ("1 x 1024 new over 16384 cached (paged)", [1024], [17408])]


def _inputs(new, keys, heads, kv_heads, d, dtype, device, block=16):
    """q, packed k/v (None when paged), cu_seqlens, and paged caches + tables (None when packed)."""
    g = torch.Generator(device=device).manual_seed(1)
    cu_q = torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(keys)], dtype=torch.int32, device=device)
    q = torch.randn(sum(new), heads, d, generator=g, device=device).to(dtype)
    if new == keys:
        k = torch.randn(sum(keys), kv_heads, d, generator=g, device=device).to(dtype)
        return q, k, torch.randn_like(k), cu_q, cu_k, None, None, None
    k_cache, v_cache, tables = paged_caches(keys, max(keys), kv_heads, d, block, dtype, device, seed=2)
    return q, None, None, cu_q, cu_k, k_cache, v_cache, tables


def reference(inputs, scale: float) -> torch.Tensor:
    """Float32 causal attention of ``_inputs``'s call, one sequence at a time (the queries are each
    sequence's last tokens; GQA by repeating KV heads)."""
    q, k, v, cu_q, cu_k, k_cache, v_cache, tables = inputs
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if tables is None:
            keys, values = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        else:
            pages = tables[b, : -(-lk // k_cache.shape[1])].long()
            keys, values = k_cache[pages].flatten(0, 1)[:lk], v_cache[pages].flatten(0, 1)[:lk]
        group = q.shape[1] // keys.shape[1]
        keys, values = (t.float().repeat_interleave(group, 1).transpose(0, 1) for t in (keys, values))  # [H, Lk, D]
        scores = q[cq[b]:cq[b + 1]].float().transpose(0, 1) @ keys.transpose(1, 2) * scale  # [H, Lq, Lk]
        visible = torch.arange(lk, device=q.device)[None, :] <= (lk - lq + torch.arange(lq, device=q.device))[:, None]
        out[cq[b]:cq[b + 1]] = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values).transpose(0, 1)
    return out


def run(device: torch.device, configs: list[dict]) -> list[dict]:
    """Each configuration on each of :func:`cases`: checked against :func:`reference`, then timed
    (rows of the JSON output, one per case and configuration)."""
    import math

    from ninefold.bench.decode_attention import graph_time
    from ninefold.ops.triton import prefill

    cuda = device.type == "cuda"
    heads, kv_heads, d, dtype = (32, 8, 128, torch.bfloat16) if cuda else (4, 2, 16, torch.float32)
    rows = []
    for name, new, keys in cases(device):
        inputs = _inputs(new, keys, heads, kv_heads, d, dtype, device)
        want = reference(inputs, 1 / math.sqrt(d))
        flops = sum(4 * heads * d * n * (L - n + (n + 1) / 2) for n, L in zip(new, keys))

        def call(config, inputs=inputs):
            q, k, v, cu_q, cu_k, k_cache, v_cache, tables = inputs
            return prefill.launch(q, k, v, cu_q, cu_k, None, k_cache, v_cache, tables, config)

        print(f"{name}: {sum(new)} new tokens over {sum(keys)} keys, {flops / 1e9:.1f} GFLOP", flush=True)
        for config in configs:
            row = {"case": name, "config": config, "new_tokens": new, "keys": keys}
            diff = (call(config).float() - want).abs().max().item()
            row["max_abs_error"] = diff
            if not diff <= (2e-2 if cuda else 1e-4):
                row["error"] = f"differs from the float32 evaluation by {diff:.3g}"
                print(f"   {config}  FAILED: {row['error']}")
            else:
                row["us"] = round(graph_time([lambda c=config, f=call: f(c)], device, 20 if cuda else 1), 2)
                row["TFLOPs"] = round(flops / row["us"] / 1e6, 1)
                print(f"   {config}  {row['us']:9.1f} us  {row['TFLOPs']:6.0f} TFLOP/s", flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.prefill_configs", description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="cuda (default when present) or cpu (Triton through TRITON_INTERPRET=1)")
    parser.add_argument("--configs", type=int, default=len(CONFIGS), help="the first N of CONFIGS (default all)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("prefill_configs on the CPU needs TRITON_INTERPRET=1 (set before Triton is imported)", file=sys.stderr)
        return 2
    if args.configs < 1:
        parser.error(f"--configs: must be at least 1, got {args.configs}")
    rows = run(device, CONFIGS[: args.configs])
    write_json("prefill_configs.json", {"device": str(device), "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
