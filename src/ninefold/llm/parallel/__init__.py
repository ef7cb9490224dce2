"""Tensor parallelism: one engine over several ranks, each holding a slice of every layer.

``LLM(model, tensor_parallel_size=N)`` makes the calling process rank 0 (scheduler, sampler, output
layer) and starts N-1 worker processes; ``sharding`` says who holds what, ``protocol`` what rank 0
sends per model call, ``driver`` and ``worker`` the two sides.
"""

from ninefold.llm.parallel.driver import ParallelModel, WorkerGroup
from ninefold.llm.parallel.rank_model import TensorParallel, build_rank_model
from ninefold.llm.parallel.sharding import (
           ShardPlan,
           check_parallel_size,
           shard_lora,
           shard_plan,
           shard_tensors,
)

__all__ = ["ParallelModel", "ShardPlan", "TensorParallel", "WorkerGroup", "build_rank_model", "check_parallel_size",
           "shard_lora", "shard_plan", "shard_tensors"]
