"""CUDA graphs for decode steps: one graph per batch size, inputs in static buffers.

A decode step of B sequences replays the graph of the smallest captured size >= B, with the
padding rows writing nowhere (slot -1) and reading one cached token. Block tables are copied
only up to the widest one of the step; the columns past a row's context are never read.
"""

from __future__ import annotations

import numpy as np
import torch

from ninefold.llm.models.llama import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to ``max_batch``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Captured decode graphs of ``model`` (forward + logits) for every size in ``capture_sizes``."""

    def __init__(self, model, max_blocks: int, max_batch: int):
        self.model = model
        self.sizes = capture_sizes(max_batch)
        M, dev = self.sizes[-1], model.device

        def pair(shape, dtype, fill=0):
            host = torch.full(shape, fill, dtype=dtype, pin_memory=True)
            return host, torch.full(shape, fill, dtype=dtype, device=dev)

        self.ids = pair((M,), torch.int64)
        self.positions = pair((M,), torch.int64)
        self.slots = pair((M,), torch.int64, -1)
        self.context = pair((M,), torch.int32, 1)
        self.tables = pair((M, max_blocks), torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture()

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up: kernels chosen and compiled outside capture
            torch.cuda.synchronize()
            for size in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[size] = self._forward(size)
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[1][:size],
            block_tables=self.tables[1][:size],
            context_lens=self.context[1][:size],
        )
        hidden = self.model.forward(self.ids[1][:size], self.positions[1][:size], meta)
        return self.model.compute_logits(hidden)

    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """Replay the graph for ``len(ids)`` sequences (``tables`` ``[B, width]``); returns logits ``[B, V]``."""
        B = len(ids)
        size = next(s for s in self.sizes if s >= B)
        width = tables.shape[1]
        for (host, dev), values, pad in (
            (self.ids, ids, 0), (self.positions, positions, 0), (self.slots, slots, -1),
            (self.context, positions + 1, 1),
        ):
            view = host.numpy()
            view[:B] = values
            view[B:size] = pad
            dev[:size].copy_(host[:size], non_blocking=True)
        host, dev = self.tables
        host.numpy()[:B, :width] = tables[:, :width]
        dev[:B, :width].copy_(host[:B, :width], non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:B]
