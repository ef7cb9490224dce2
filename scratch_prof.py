"""Scratch (not committed): where the engine's candidate route spends its time with the split sampler."""
import time

import torch
import triton.testing

from ninefold import ops
from ninefold.ops.triton import sample as S

torch.manual_seed(0)
for b, n, kill in ((1, 256, 50), (64, 256, 50), (1, 128256, 0)):
    logits = (torch.randn(b, n, device="cuda") * 3).bfloat16()
    if kill:
        logits = logits.sort(dim=-1, descending=True).values
        logits[:, kill:] = float("-inf")
    t = torch.full((b,), 0.8, device="cuda")
    p = torch.full((b,), 0.95, device="cuda")
    f = lambda: S.sample(logits, t, None, p, None, None)  # noqa: E731
    f()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        f()
    host = (time.perf_counter() - start) / 200 * 1e6
    torch.cuda.synchronize()
    dev = triton.testing.do_bench(f, return_mode="median") * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            f()
        torch.cuda.synchronize()
    print(f"b={b} n={n}: host enqueue {host:.1f} us/call, do_bench {dev:.1f} us")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    out = torch.stack([f() for _ in range(200)])
    print("argmax share", (out == logits.argmax(-1)).float().mean().item())
