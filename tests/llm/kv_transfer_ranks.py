"""The rank function of the two-process KV-transfer test (importable, so ``spawn`` can run it)."""

from __future__ import annotations

import torch

from ninefold import LLM, SamplingParams
from ninefold.comm import init
from ninefold.llm.disagg import export_prefix, import_prefix, recv_prefix, send_prefix


def prefill_here_decode_there(model_dir: str, prompts: list[list[int]], max_tokens: int, block_size: int,
                              kv_cache_dtype: str = "auto"):
    """Rank 0 prefills ``prompts`` and sends their KV blocks; rank 1 imports them and decodes.

    Returns, on rank 1, (blocks imported per prompt, generated token ids per prompt, prompt tokens served
    from the prefix cache, prompt tokens computed); on rank 0, the token ids it generates itself afterwards
    from the same cached blocks."""
    torch.set_num_threads(1)
    comm = init(device="cpu")
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=block_size, kv_cache_dtype=kv_cache_dtype)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        if comm.rank == 0:
            llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1))
            for tag, ids in enumerate(prompts):
                send_prefix(comm, export_prefix(llm.engine, ids), dst=1, tag=tag)
            comm.barrier()
            return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]
        imported = [import_prefix(llm.engine, recv_prefix(comm, 0, like=llm.engine, tag=tag))
                    for tag in range(len(prompts))]
        comm.barrier()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
        blocks = llm.engine.blocks
        return imported, [o.outputs[0].token_ids for o in outs], blocks.hit_tokens, blocks.queried_tokens
    finally:
        comm.close()
