"""The rank function of the disaggregated-cluster test (importable, so ``spawn`` can run it)."""

from __future__ import annotations

import torch

from ninefold import SamplingParams
from ninefold.comm import init
from ninefold.llm.disagg import start


def run_cluster(model_dir: str, prompts: list[list[int]], max_tokens: int, calls: list, device: str = "cpu"):
    """Every rank: join the cluster; rank 0 runs one generate per entry of ``calls`` (its num_prefill) and
    returns, per call, (tokens per prompt, plan, cached tokens per prompt, (prefill, decode) rank per prompt)."""
    torch.set_num_threads(1)
    comm = init(device="cpu" if device == "cpu" else None)
    try:
        # A fixed pool: other tests' processes may hold most of a shared test GPU's memory.
        router = start(comm, model_dir, dtype="float32", device=device, block_size=4, num_kv_blocks=256)
        if router is None:
            return None
        out = []
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for num_prefill in calls:
            results = router.generate(prompts, params, num_prefill=num_prefill)
            out.append(([r.token_ids for r in results], router.last_plan, [r.cached_tokens for r in results],
                        [(r.prefill_rank, r.decode_rank) for r in results], list(router.last_errors),
                        router.last_decode_costs))
        router.shutdown()
        return out
    finally:
        comm.close()


def start_only(model: str):
    """Every rank: join a cluster on ``model`` and stop it at once."""
    comm = init(device="cpu")
    try:
        router = start(comm, model, dtype="float32", device="cpu")
        if router is not None:
            router.shutdown()
    finally:
        comm.close()
