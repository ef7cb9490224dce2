"""CUDA graphs for decode steps, through the runtime's ``CudaGraphRunner``.

The captured function is the model's decode forward plus the logits, taking five batch-first
inputs: token ids, positions, cache slots, context lengths and block tables (full width,
``max_blocks`` columns). An engine with adapters also captures a second set taking each row's
adapter slot as a sixth input, which adds every projection's ``((x @ A) * mask) @ B`` whatever
the slots hold (slot weights live in fixed buffers, so loading an adapter needs no new capture). Rows past the batch are padded to write nowhere (slot -1) and read one
cached token. Every batch size is run once eagerly before capture (with and without adapters), so kernels
are chosen and compiled outside the capture, and where ``linear`` runs a self-tuning implementation (``cublaslt``,
``cutlass``, ``triton_gemm``: pinned or chosen by a table) its choice is measured for each size (once per card,
then read from the cache).
"""

from __future__ import annotations

import torch

from ninefold.llm.models.llama import AttentionMetadata
from ninefold.ops.cublaslt import tuning as cublaslt_tuning
from ninefold.ops.cutlass import tuning as cutlass_tuning
from ninefold.ops.triton import gemm_tuning
from ninefold.runtime.cuda_graph import CudaGraphRunner


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to ``max_batch`` (and ``max_batch``).

    Every 8 rows was measured too (docs/perf/llm.md, seventh session): less padding, but cuBLAS runs
    some row counts that are not multiples of 16 slower than the next multiple, and offline
    throughput did not improve."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Captured decode graphs of ``model`` (forward + logits) for every size in ``capture_sizes``."""

    def __init__(self, model, max_blocks: int, max_batch: int, lora_slots=None):
        self.model = model
        self.lora_slots = lora_slots
        self.sizes = capture_sizes(max_batch)
        M, dev = self.sizes[-1], model.device
        examples = (
            torch.zeros(M, dtype=torch.int64, device=dev),  # token ids
            torch.zeros(M, dtype=torch.int64, device=dev),  # positions
            torch.full((M,), -1, dtype=torch.int64, device=dev),  # cache slots
            torch.ones(M, dtype=torch.int32, device=dev),  # context lengths
            torch.zeros((M, max_blocks), dtype=torch.int32, device=dev),  # block tables
        )
        pads = (0, 0, -1, 1, 0)
        self.runner = CudaGraphRunner(self._forward, self.sizes, examples, pad_values=pads)
        self.lora_runner = None
        if lora_slots is not None:
            no_adapter = torch.full((M,), -1, dtype=torch.int64, device=dev)  # each row's slot, -1: none
            self.lora_runner = CudaGraphRunner(self._forward_lora, self.sizes, (*examples, no_adapter),
                                               pad_values=(*pads, -1))
        with (torch.inference_mode(), cublaslt_tuning.autotune(), cutlass_tuning.autotune(),
              gemm_tuning.autotune()):
            for size in reversed(self.sizes):
                self._forward(*(x[:size] for x in examples))
                if getattr(model, "rope_in_attention", False):
                    self._forward_unfolded(*(x[:size] for x in examples))
                if self.lora_runner is not None:  # (steps with adapters run unfused layers: other kernels, shapes)
                    self._forward_lora(*(x[:size] for x in (*examples, no_adapter)))
            torch.cuda.synchronize()
            pool = torch.cuda.graph_pool_handle()  # one pool: only one graph replays at a time
            self.runner.capture(pool)
            if self.lora_runner is not None:
                self.lora_runner.capture(pool)

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def _forward(self, ids, positions, slots, context_lens, block_tables) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=slots, block_tables=block_tables, context_lens=context_lens)
        return self.model.compute_logits(self.model.forward(ids, positions, meta))

    def _forward_unfolded(self, *inputs) -> torch.Tensor:
        """``_forward`` with rope and the cache write apart from the attention, as steps that mix decode rows
        with prefill chunks run them (eagerly): its decode-attention launches compile here, not mid-run."""
        self.model.rope_in_attention = False
        try:
            return self._forward(*inputs)
        finally:
            self.model.rope_in_attention = True

    def _forward_lora(self, ids, positions, slots, context_lens, block_tables, row_slots) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=slots, block_tables=block_tables, context_lens=context_lens)
        # fixed work, whichever adapters fill the slots; Triton's launches where enabled (only graphs make them cheap)
        lora = self.lora_slots.step(row_slots, every_matrix=True, kernels=True)
        return self.model.compute_logits(self.model.forward(ids, positions, meta, lora=lora))

    def run(self, ids, positions, slots, context_lens, block_tables, row_slots=None) -> torch.Tensor:
        """Logits ``[B, V]`` of one decode step (inputs batch-first; host tensors should be pinned);
        ``row_slots``: each row's adapter slot (-1: none), for engines with adapters (``lora_slots``)."""
        if row_slots is None:
            return self.runner(ids, positions, slots, context_lens, block_tables)
        if self.lora_runner is None:
            raise ValueError("row_slots: these graphs were captured without adapters (lora_slots=None)")
        return self.lora_runner(ids, positions, slots, context_lens, block_tables, row_slots)
