"""Scratch (not committed): host and device time of the engine's sampler (candidates route), this tree or .ab_old."""
import cProfile
import pstats
import time

import torch

from ninefold.llm.sampler import Sampler
from ninefold.llm.sampling import SamplingParams
from ninefold.llm.sequence import Sequence

for b in (1, 64):
    logits = (torch.randn(b, 128256, device="cuda") * 3).bfloat16()
    sampler = Sampler(logits.device, logits.shape[1], ())
    seqs = [Sequence(f"r{i}", 0, [1], 1, SamplingParams(temperature=0.8, top_k=50, top_p=0.95)) for i in range(b)]
    for _ in range(5):
        sampler.sample(logits, seqs).read()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(100):
        sampler.sample(logits, seqs).read()
    wall = (time.perf_counter() - start) / 100 * 1e6
    start = time.perf_counter()
    for _ in range(100):
        sampler.sample(logits, seqs)
    enqueue = (time.perf_counter() - start) / 100 * 1e6
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        sampler.sample(logits, seqs).read()
    prof.disable()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
        for _ in range(20):
            sampler.sample(logits, seqs).read()
    print(f"B={b}: wall per call with read {wall:.1f} us, enqueue only {enqueue:.1f} us")
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=10))
