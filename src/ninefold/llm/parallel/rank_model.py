"""One rank's share of a tensor-parallel model: its group handle and how its weights are built."""

from __future__ import annotations

import os
import warnings

import torch

from ninefold.llm.config import ModelConfig
from ninefold.llm.gguf_packed import QUANTIZED
from ninefold.llm.models import model_class
from ninefold.llm.parallel.sharding import shard_plan, shard_tensors


class TensorParallel:
    """What a rank's model needs of its group: the rank, the size and the all-reduce.

    Collective to create. CPU ranks of one host sum small tensors (a decode step's hidden states) through
    shared memory (``ninefold.comm.shm``: about 0.6 ms less per all-reduce than Gloo on two cores), unless
    ``NINEFOLD_TP_SHM=0``; everything else goes through ``comm``.
    """

    def __init__(self, comm, rank: int, size: int, *, peers_gone=None, timeout_s: float = 600.0):
        from ninefold.comm import CommError, shm

        self.comm, self.rank, self.size = comm, rank, size
        self.shm = None
        wanted = os.environ.get("NINEFOLD_TP_SHM", "1") not in ("0", "")
        if wanted and comm.device.type == "cpu" and shm.available(comm):
            try:
                self.shm = shm.SharedMemoryAllReduce(comm, timeout_s=timeout_s, peers_gone=peers_gone)
            except CommError as error:  # raised on every rank alike: all keep to the communicator
                warnings.warn(f"tensor parallelism: all-reduces go over {comm.routes['cpu'].backend} ({error})",
                              stacklevel=2)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group's ranks, in place."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        return self.comm.all_reduce(x)

    def close(self) -> None:
        """Release the shared-memory segment, if any (the communicator is the caller's)."""
        if self.shm is not None:
            self.shm.close()


def build_rank_model(config: ModelConfig, tensors: dict | None, parallel: TensorParallel, *, dtype: torch.dtype,
                     device: torch.device, max_positions: int, seed: int, sliced: bool = False):
    """The model of ``parallel.rank``: its slice of ``tensors`` (HF-named weights, full, or already this rank's
    slices with ``sliced``; None: random weights of the slice's shape), with only rank 0 keeping the output
    layer. Quantized GGUF matrices are dequantized to be split (a warning says so)."""
    plan = shard_plan(config, parallel.rank, parallel.size)
    if tensors is not None and sliced:
        tensors = {n: t for n, t in tensors.items() if n != "lm_head.weight" or parallel.rank == 0}
    elif tensors is not None:
        if parallel.rank == 0 and any(isinstance(t, QUANTIZED) for t in tensors.values()):
            warnings.warn("tensor parallelism: the checkpoint's quantized GGUF matrices are dequantized to be split "
                          "(each rank holds its slices in the model's dtype); quantization applies with "
                          "tensor_parallel_size=1 only", stacklevel=3)
        tensors = shard_tensors(tensors, config, plan, keep_lm_head=parallel.rank == 0)
    # dummy weights: one seed everywhere, so the replicated tensors (embedding, norms) agree across ranks
    return model_class(config.architecture)(plan.local_config(config), tensors, dtype=dtype, device=device,
                                            max_positions=max_positions, seed=seed, parallel=parallel)
