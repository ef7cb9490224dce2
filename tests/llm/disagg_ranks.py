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
        out.append(_more_calls(router, prompts, max_tokens))
        router.shutdown()
        router.shutdown()  # twice is fine
        try:
            router.generate(prompts, params)
        except RuntimeError as e:
            out[-1]["after_shutdown"] = str(e)
        return out
    finally:
        comm.close()


def _more_calls(router, prompts, max_tokens) -> dict:
    """Per-prompt SamplingParams (one with n=2), a call a decode worker fails mid-way, and a call after it."""
    per_prompt = per_prompt_params(len(prompts), max_tokens)
    results = router.generate(prompts, per_prompt, num_prefill=1)
    found = {"per_prompt": [[list(o.token_ids) for o in r.outputs] for r in results]}
    # The longest prompt goes to the first decode worker (rank 2), which fails on its out-of-vocabulary token.
    bad = [[10**6] * (len(max(prompts, key=len)) + 1), prompts[1]]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        router.generate(bad, greedy, num_prefill=1)
    except RuntimeError as e:
        found["failed"] = str(e)
    found["after_failure"] = [r.token_ids for r in router.generate(prompts, greedy, num_prefill=1)]
    return found


def per_prompt_params(n: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens if k % 2 else 5, ignore_eos=True, n=2 if k == 0 else 1)
            for k in range(n)]


def start_only(model: str):
    """Every rank: join a cluster on ``model`` and stop it at once."""
    comm = init(device="cpu")
    try:
        router = start(comm, model, dtype="float32", device="cpu")
        if router is not None:
            router.shutdown()
    finally:
        comm.close()
