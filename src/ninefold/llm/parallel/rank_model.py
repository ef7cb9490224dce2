"""One rank's share of a tensor-parallel model: its group handle and how its weights are built."""

from __future__ import annotations

import torch

from ninefold.llm.config import ModelConfig
from ninefold.llm.models import model_class
from ninefold.llm.parallel.sharding import shard_plan, shard_tensors


class TensorParallel:
    """What a rank's model needs of its group: the rank, the size and the all-reduce."""

    def __init__(self, comm, rank: int, size: int):
        self.comm, self.rank, self.size = comm, rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group's ranks, in place."""
        return self.comm.all_reduce(x)


def build_rank_model(config: ModelConfig, tensors: dict | None, parallel: TensorParallel, *, dtype: torch.dtype,
                     device: torch.device, max_positions: int, seed: int, sliced: bool = False):
    """The model of ``parallel.rank``: its slice of ``tensors`` (HF-named weights, full, or already this rank's
    slices with ``sliced``; None: random weights of the slice's shape, seeded per rank), with only rank 0
    keeping the output layer."""
    plan = shard_plan(config, parallel.rank, parallel.size)
    if tensors is not None and sliced:
        tensors = {n: t for n, t in tensors.items() if n != "lm_head.weight" or parallel.rank == 0}
    elif tensors is not None:
        tensors = shard_tensors(tensors, config, plan, keep_lm_head=parallel.rank == 0)
    return model_class(config.architecture)(plan.local_config(config), tensors, dtype=dtype, device=device,
                                            max_positions=max_positions, seed=seed + parallel.rank,
                                            parallel=parallel)
