"""Model runner: packs a scheduled step into tensors, runs the model, samples.

Inputs are built on the host in page-locked buffers and copied to the device without blocking;
the only host synchronisation of a step is reading the sampled tokens. On GPUs, pure decode
steps replay CUDA graphs captured for a set of batch sizes (padded up to the nearest one); on
CPUs, or with ``enforce_eager``, every step runs eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from ninefold.llm.models.llama import AttentionMetadata
from ninefold.llm.sampler import SampledTokens, Sampler
from ninefold.llm.scheduler import ScheduledSeq


class _HostBuffers:
    """Page-locked host staging buffers and their device twins, grown on demand."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._dev: dict[str, torch.Tensor] = {}

    def pinned_host(self, name: str, values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """``values`` in a reused page-locked host buffer (valid until the next step)."""
        self._fill(name, values, dtype)
        return self._host[name][: values.size].view(values.shape)

    def to_device(self, name: str, values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """``values`` on the device (a view of a reused buffer, valid until the next step)."""
        n = self._fill(name, values, dtype)
        host = self._host[name]
        if self.device.type == "cpu":
            return host[:n].clone().view(values.shape)
        dev = self._dev[name][:n]
        dev.copy_(host[:n], non_blocking=True)
        return dev.view(values.shape)

    def _fill(self, name: str, values: np.ndarray, dtype: torch.dtype) -> int:
        n = values.size
        host = self._host.get(name)
        if host is None or host.numel() < n or host.dtype != dtype:
            size = max(n, 2 * (host.numel() if host is not None else 0), 64)
            host = torch.empty(size, dtype=dtype, pin_memory=self.pinned)
            self._host[name] = host
            self._dev[name] = torch.empty(size, dtype=dtype, device=self.device)
        host.numpy()[:n] = values.reshape(-1)
        return n


class ModelRunner:
    """Runs one engine step on the model: inputs, forward, logits, sampling."""

    def __init__(self, model, pool, sampler: Sampler, *, max_model_len: int, enforce_eager: bool,
                 cuda_graph_max_batch: int = 256):
        self.model = model
        self.pool = pool
        self.sampler = sampler
        self.device = model.device
        self.block_size = pool.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.buffers = _HostBuffers(self.device)
        model.bind_kv_cache(pool)
        self.graphs = None
        if self.device.type == "cuda" and not enforce_eager:
            from ninefold.llm.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.max_blocks, cuda_graph_max_batch)

    @torch.inference_mode()
    def execute(self, step: list[ScheduledSeq]) -> SampledTokens:
        """Run ``step``; returns one sampled token per sequence that samples, in step order."""
        logits = self.forward_logits(step)
        return self.sampler(logits, [s.seq for s in step if s.samples])

    @torch.inference_mode()
    def forward_logits(self, step: list[ScheduledSeq]) -> torch.Tensor:
        """Float32 logits ``[S, V]`` at the last token of every sequence in ``step`` that samples."""
        if all(s.num_new_tokens == 1 for s in step):
            return self._decode(step)
        return self._prefill(step)

    def _block_table_array(self, step: list[ScheduledSeq], width: int) -> np.ndarray:
        table = np.zeros((len(step), width), dtype=np.int32)
        for row, s in enumerate(step):
            blocks = s.seq.block_table
            table[row, : len(blocks)] = blocks
        return table

    def _decode(self, step: list[ScheduledSeq]) -> torch.Tensor:
        bs = self.block_size
        B = len(step)
        ids = np.fromiter((s.seq.token_ids[s.start] for s in step), dtype=np.int64, count=B)
        positions = np.fromiter((s.start for s in step), dtype=np.int64, count=B)
        slots = np.fromiter((s.seq.block_table[s.start // bs] * bs + s.start % bs for s in step),
                            dtype=np.int64, count=B)
        graphs = self.graphs is not None and self.graphs.fits(B)
        width = self.max_blocks if graphs else max(len(s.seq.block_table) for s in step)
        put = self.buffers.to_device if not graphs else self.buffers.pinned_host
        args = (put("ids", ids, torch.int64), put("pos", positions, torch.int64), put("slots", slots, torch.int64),
                put("context", positions.astype(np.int32) + 1, torch.int32),
                put("tables", self._block_table_array(step, width), torch.int32))
        if graphs:
            return self.graphs.run(*args)
        meta = AttentionMetadata(slot_mapping=args[2], block_tables=args[4], context_lens=args[3])
        return self.model.compute_logits(self.model.forward(args[0], args[1], meta))

    def _prefill(self, step: list[ScheduledSeq]) -> torch.Tensor:
        bs = self.block_size
        ids, positions, slots = [], [], []
        cu_q, cu_k, last = [0], [0], []
        use_cache = False
        for s in step:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            pos = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            ids.append(np.asarray(seq.token_ids[start : start + n], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + start + n)
            use_cache |= start > 0
            if s.samples:
                last.append(cu_q[-1] - 1)
        put = self.buffers.to_device
        meta = AttentionMetadata(
            slot_mapping=put("slots", np.concatenate(slots), torch.int64),
            cu_seqlens_q=put("cu_q", np.asarray(cu_q, dtype=np.int32), torch.int32),
            cu_seqlens_k=put("cu_k", np.asarray(cu_k if use_cache else cu_q, dtype=np.int32), torch.int32),
            use_cache=use_cache,
        )
        if use_cache:
            width = max(len(s.seq.block_table) for s in step)
            meta.block_tables = put("tables", self._block_table_array(step, width), torch.int32)
        hidden = self.model.forward(
            put("ids", np.concatenate(ids), torch.int64), put("pos", np.concatenate(positions), torch.int64), meta
        )
        if not last:
            if self.device.type == "cuda":  # no token read back: keep the staging buffers safe to refill
                torch.cuda.current_stream().synchronize()
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        index = put("last", np.asarray(last, dtype=np.int64), torch.int64)
        return self.model.compute_logits(hidden.index_select(0, index))
