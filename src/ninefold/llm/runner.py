"""Model runner: packs a scheduled step into tensors, runs the model, samples.

Inputs are built on the host in page-locked buffers and copied to the device without blocking;
the only host synchronisation of a step is reading the sampled tokens. On GPUs, pure decode
steps replay CUDA graphs captured for a set of batch sizes (padded up to the nearest one); on
CPUs, or with ``enforce_eager``, every step runs eagerly.

``launch`` returns before the step's tokens are back, so the engine can prepare the next step
while the device runs this one. A sequence whose last token is still on the device (a
``PLACEHOLDER``, see ``Sequence.pending_row``) gets it from the previous step's token tensor on
the device. The staging buffers alternate between two sets, so filling one step's inputs never
overwrites those of a step whose copies may still be queued.
"""

from __future__ import annotations

import numpy as np
import torch

from ninefold.llm.models.llama import AttentionMetadata
from ninefold.llm.prompt_logprobs import positions_to_score, score
from ninefold.llm.sampler import PendingTokens, SampledTokens, Sampler
from ninefold.llm.scheduler import ScheduledSeq
from ninefold.llm.sequence import Sequence
from ninefold.llm.speculative import DraftRow


class _HostBuffers:
    """Page-locked host staging buffers and their device twins, grown on demand."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._dev: dict[str, torch.Tensor] = {}
        # what the "tables" buffer holds: its layout (address, width) and per row (block list, entries written)
        self.table_layout: tuple[int, int] | None = None
        self.table_rows: list[tuple[list, int]] = []

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

    def host_array(self, name: str, shape: tuple[int, ...], np_dtype, dtype: torch.dtype):
        """A ``shape`` view of the reused host buffer ``name``: (numpy array to fill, tensor); not cleared."""
        n = int(np.prod(shape))
        host = self._grow(name, n, dtype)[:n].view(shape)
        return host.numpy(), host

    def upload(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """Copy a ``host_array`` tensor into buffer ``name``'s device twin (non-blocking)."""
        if self.device.type == "cpu":
            return host.clone()
        dev = self._dev[name][: host.numel()].view(host.shape)
        dev.copy_(host, non_blocking=True)
        return dev

    def _grow(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        host = self._host.get(name)
        if host is None or host.numel() < n or host.dtype != dtype:
            size = max(n, 2 * (host.numel() if host is not None else 0), 64)
            host = torch.zeros(size, dtype=dtype, pin_memory=self.pinned)
            self._host[name] = host
            self._dev[name] = torch.empty(size, dtype=dtype, device=self.device)
        return host

    def _fill(self, name: str, values: np.ndarray, dtype: torch.dtype) -> int:
        n = values.size
        self._grow(name, n, dtype).numpy()[:n] = values.reshape(-1)
        return n


class LaunchedStep:
    """A step handed to the device: its sequences, the ones that sample (row order), their tokens."""

    def __init__(self, step: list[ScheduledSeq], samplers: list[Sequence], tokens: PendingTokens | None):
        self.step = step
        self.samplers = samplers
        self.tokens = tokens

    def read(self) -> SampledTokens:
        """The sampled tokens on the host (waits for this step's device work)."""
        if self.tokens is None:
            return SampledTokens([], [])
        return self.tokens.read()


def sampled_rows(step: list[ScheduledSeq]) -> list:
    """What the sampler draws for, row by row: each sequence that samples, and after it one
    ``DraftRow`` per draft token (the sequence as it stands after that many drafts)."""
    rows = []
    for s in step:
        if s.samples:
            rows.append(s.seq)
            if s.draft_ids:
                rows.extend(DraftRow(s.seq, s.draft_ids[: i + 1]) for i in range(len(s.draft_ids)))
    return rows


def longest_context_first(step: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """``step`` reordered by context length after the step, longest first (stable).

    Attention launches one program per row and head in row order, so the longest rows start
    first and the short ones fill the last wave instead of a long one starting last. On an H200,
    decode attention over 200 contexts of 400..1900 tokens took 212 us instead of 254 us in
    arrival order (``python -m ninefold.bench.decode_attention --ragged-only``).
    """
    return sorted(step, key=lambda s: s.start + s.num_new_tokens, reverse=True)


class ModelRunner:
    """Runs one engine step on the model: inputs, forward, logits, sampling."""

    def __init__(self, model, pool, sampler: Sampler, *, max_model_len: int, enforce_eager: bool,
                 cuda_graph_max_batch: int = 256, lora_slots=None):
        self.model = model
        self.lora_slots = lora_slots
        self.pool = pool
        self.sampler = sampler
        self.device = model.device
        self.block_size = pool.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self._buffer_sets = [_HostBuffers(self.device), _HostBuffers(self.device)]
        self._set_free: list = [None, None]  # per set: an event after the last step that used it
        self._forwards = 0
        self.buffers = self._buffer_sets[0]
        model.bind_kv_cache(pool)
        self.graphs = None
        if self.device.type == "cuda" and not enforce_eager:
            from ninefold.llm.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.max_blocks, cuda_graph_max_batch, lora_slots)

    @torch.inference_mode()
    def launch(self, step: list[ScheduledSeq], previous: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue ``step`` (forward and sampling) and return without waiting for its tokens.

        The rows run longest context first (``longest_context_first``); the returned step and its
        samplers are in that order.

        ``previous``: the step in flight whose tokens some of ``step``'s sequences still hold as
        placeholders (they are taken from its token tensor on the device).
        """
        prev_tokens = previous.tokens.tokens if previous is not None and previous.tokens is not None else None
        step = longest_context_first(step)
        logits = self.forward_logits(step, prev_tokens)
        samplers = sampled_rows(step)
        tokens = self.sampler.sample(logits, samplers) if samplers else None
        return LaunchedStep(list(step), samplers, tokens)  # its own list: callers may reuse theirs

    def _switch_buffers(self) -> None:
        self._forwards += 1
        index = self._forwards % 2
        event = self._set_free[index]
        if event is not None:  # its last step's input copies must have left the host buffers
            event.synchronize()
        self.buffers = self._buffer_sets[index]

    @torch.inference_mode()
    def forward_logits(self, step: list[ScheduledSeq], prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[S, V]`` (``compute_logits``'s dtype) at the last token of every sequence in ``step`` that
        samples, and at each of its draft tokens (``sampled_rows``'s order).

        ``prev_tokens``: the device tokens of the step in flight, for sequences holding a placeholder.
        """
        self._switch_buffers()
        # one new token per sequence, and its drafts: each draft is a decode row of its own (below)
        decode_shaped, all_sample = True, True
        for s in step:
            if s.num_new_tokens - len(s.draft_ids) != 1:
                decode_shaped = False
                break
            all_sample = all_sample and s.samples
        if decode_shaped and not all_sample:
            # a one-token prompt chunk whose hidden state scores a prompt token runs as a prefill
            decode_shaped = not any(positions_to_score(s.seq, s.start, 1) for s in step)
        if decode_shaped:
            logits = self._decode(step, prev_tokens)
            if not all_sample:  # a one-token prompt chunk: no token to sample yet
                first = np.cumsum([0] + [len(s.draft_ids) + 1 for s in step])
                rows = np.array([r for i, s in enumerate(step) if s.samples for r in range(first[i], first[i + 1])],
                                dtype=np.int64)
                logits = logits.index_select(0, self.buffers.to_device("sampling_rows", rows, torch.int64))
        else:
            logits = self._prefill(step, prev_tokens)
        if self.device.type == "cuda":  # the copies out of this buffer set are queued before this point
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._set_free[self._forwards % 2] = event
        return logits

    def _device_ids(self, ids: np.ndarray, rows: list[int], sources: list[int], prev_tokens) -> torch.Tensor:
        """Token ids on the device, rows ``rows`` replaced by ``prev_tokens[sources]``."""
        if rows and prev_tokens is None:
            raise RuntimeError("a sequence waits for a token of a step that is not in flight")  # an engine bug
        src = self.buffers.to_device("src_index", np.asarray(sources, dtype=np.int64), torch.int64) if rows else None
        if rows and len(rows) == len(ids):  # every row's token is in flight (steady decoding): one gather
            return prev_tokens.index_select(0, src)
        dev = self.buffers.to_device("ids", ids, torch.int64)
        if rows:
            where = self.buffers.to_device("src_rows", np.asarray(rows, dtype=np.int64), torch.int64)
            dev.index_copy_(0, where, prev_tokens.index_select(0, src))
        return dev

    def _block_tables(self, step: list[ScheduledSeq], width: int, *, pinned: bool) -> torch.Tensor:
        """``[B, width]`` int32 block tables on the device, or in pinned host memory with ``pinned``.

        Entries past a row's own blocks are left as they are: attention never reads past a
        row's context (and they are valid block ids from earlier steps). A row that held the same
        block list when this buffer set was last filled gets only the blocks added since: a
        sequence's list only grows (``BlockManager`` gives a new list when it frees or readmits one).
        """
        buffers = self.buffers
        table, host = buffers.host_array("tables", (len(step), width), np.int32, torch.int32)
        layout = (host.data_ptr(), width)
        before = buffers.table_rows if buffers.table_layout == layout else []
        rows = []
        for row, s in enumerate(step):
            blocks = s.seq.block_table
            n = len(blocks)
            if row < len(before) and before[row][0] is blocks:
                done = before[row][1]
                if n > done:
                    table[row, done:n] = blocks[done:]
            else:
                table[row, :n] = blocks
            rows.append((blocks, n))
        buffers.table_layout, buffers.table_rows = layout, rows
        return host if pinned else buffers.upload("tables", host)

    def _decode(self, step: list[ScheduledSeq], prev_tokens=None) -> torch.Tensor:
        """One decode row per sequence, plus one per draft token: a draft's row sits at the next position
        and attends to the context up to itself, which holds the keys and values the rows before it write
        in the same layer (every row is cached before any row attends), so it computes what a decode step
        after the accepted drafts would."""
        bs = self.block_size
        ids, positions, slots = [], [], []
        rows, sources = [], []
        drafts = any(s.draft_ids for s in step)
        if drafts:
            step = [ScheduledSeq.row_of(s, i) for s in step for i in range(len(s.draft_ids) + 1)]
        for row, s in enumerate(step):
            seq, start = s.seq, s.start
            ids.append(s.draft_ids[-1] if s.draft_ids else seq.token_ids[start])
            positions.append(start)
            slots.append(seq.block_table[start // bs] * bs + start % bs)
            if seq.pending_row >= 0:
                rows.append(row)
                sources.append(seq.pending_row)
        row_slots = self._lora_rows([1] * len(step), step)
        graphs = self.graphs is not None and self.graphs.fits(len(step))
        width = self.max_blocks if graphs else max(len(s.seq.block_table) for s in step)
        put = self.buffers.to_device if not graphs else self.buffers.pinned_host
        pos = np.array(positions, dtype=np.int64)
        ids = np.array(ids, dtype=np.int64)
        token_ids = self._device_ids(ids, rows, sources, prev_tokens) if rows else put("ids", ids, torch.int64)
        args = (token_ids, put("pos", pos, torch.int64),
                put("slots", np.array(slots, dtype=np.int64), torch.int64),
                put("context", (pos + 1).astype(np.int32), torch.int32),
                self._block_tables(step, width, pinned=graphs))
        if graphs:
            return self.graphs.run(*args, None if row_slots is None else put("lora_slots", row_slots, torch.int64))
        meta = AttentionMetadata(slot_mapping=args[2], block_tables=args[4], context_lens=args[3], drafts=drafts)
        lora = None if row_slots is None else self.lora_slots.step(put("lora_slots", row_slots, torch.int64))
        return self.model.compute_logits(self._forward(args[0], args[1], meta, lora))

    def _forward(self, token_ids, positions, meta, lora):
        # (models without adapter support take no ``lora`` argument)
        if lora is None:
            return self.model.forward(token_ids, positions, meta)
        return self.model.forward(token_ids, positions, meta, lora=lora)

    def _lora_rows(self, rows_per_seq: list[int], step: list[ScheduledSeq]) -> np.ndarray | None:
        """Each row's adapter slot (-1: none) for a step whose sequences take ``rows_per_seq`` rows each, in
        ``step``'s order; None when no row uses an adapter."""
        if self.lora_slots is None or all(s.seq.lora_slot < 0 for s in step):
            return None
        return np.repeat(np.array([s.seq.lora_slot for s in step], dtype=np.int64), rows_per_seq)

    def _lora_step(self, rows_per_seq: list[int], step: list[ScheduledSeq]):
        """The adapters' deltas for such a step (``_lora_rows`` on the device), or None."""
        rows = self._lora_rows(rows_per_seq, step)
        return None if rows is None else self.lora_slots.step(self.buffers.to_device("lora_slots", rows, torch.int64))

    def _prefill(self, step: list[ScheduledSeq], prev_tokens=None) -> torch.Tensor:
        bs = self.block_size
        # One-token rows go first and through decode attention (a prefill kernel would spend a
        # whole query block on each); the others follow as packed variable-length sequences.
        decodes = [s for s in step if s.num_new_tokens == 1]
        rest = [s for s in step if s.num_new_tokens != 1]
        ordered = decodes + rest
        ids, positions, slots = [], [], []
        cu_q, cu_k, row_end = [0], [0], {}
        # An FP8 cache: every chunk attends its own keys as codes too, read back from the cache (as vLLM's V1
        # does), so a request's result does not depend on which other sequences share the step.
        use_cache = self.pool.dtype == torch.float8_e4m3fn
        max_q = max_k = 1
        row = 0
        for index, s in enumerate(ordered):
            seq, start, n = s.seq, s.start, s.num_new_tokens
            pos = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            known = n - len(s.draft_ids)
            ids.append(np.asarray(seq.token_ids[start : start + known] + s.draft_ids, dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            row += n
            row_end[id(s)] = row
            if index >= len(decodes):
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + start + n)
                use_cache |= start > 0
                max_q, max_k = max(max_q, n), max(max_k, start + n)
        last = [row for s in step for row in range(row_end[id(s)] - s.num_sampled_rows, row_end[id(s)])]
        waiting = [(row, s.seq.pending_row) for row, s in enumerate(decodes) if s.seq.pending_row >= 0]
        put = self.buffers.to_device
        meta = AttentionMetadata(
            slot_mapping=put("slots", np.concatenate(slots), torch.int64),
            cu_seqlens_q=put("cu_q", np.asarray(cu_q, dtype=np.int32), torch.int32),
            cu_seqlens_k=put("cu_k", np.asarray(cu_k if use_cache else cu_q, dtype=np.int32), torch.int32),
            use_cache=use_cache, num_decodes=len(decodes), max_seqlen_q=max_q,
            max_seqlen_k=max_k if use_cache else max_q,
        )
        if decodes:
            meta.decode_context_lens = put("context", np.array([s.start + 1 for s in decodes], dtype=np.int32),
                                           torch.int32)
        if use_cache or decodes:
            # With decode rows, the CUDA graphs' full width: the decode kernels compiled for them serve as they are.
            wide = decodes and self.graphs is not None
            width = self.max_blocks if wide else max(len(s.seq.block_table) for s in ordered)
            meta.block_tables = self._block_tables(ordered, width, pinned=False)
        token_ids = self._device_ids(np.concatenate(ids), [r for r, _ in waiting], [j for _, j in waiting], prev_tokens)
        lora = self._lora_step([s.num_new_tokens for s in ordered], ordered)
        hidden = self._forward(token_ids, put("pos", np.concatenate(positions), torch.int64), meta, lora)
        self._score_prompts(ordered, row_end, hidden)
        if not last:  # (the staging buffers stay safe: ``forward_logits`` alternates them behind events)
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        index = put("last", np.asarray(last, dtype=np.int64), torch.int64)
        return self.model.compute_logits(hidden.index_select(0, index))

    def _score_prompts(self, ordered: list[ScheduledSeq], row_end: dict, hidden: torch.Tensor) -> None:
        """Append the prompt logprobs this prefill's hidden states give (``ninefold.llm.prompt_logprobs``)."""
        rows, targets, tops, owners = [], [], [], []
        for s in ordered:
            seq = s.seq
            if seq.prompt_logprobs is None:
                continue
            positions = positions_to_score(seq, s.start, s.num_new_tokens)
            first_row = row_end[id(s)] - s.num_new_tokens - s.start
            for p in positions:
                rows.append(first_row + p)
                targets.append(seq.token_ids[p + 1])
                tops.append(seq.params.prompt_logprobs)
                owners.append(seq)
        if not rows:
            return
        for seq, entry in zip(owners, score(self.model, hidden, rows, targets, tops, self.sampler.vocab_size)):
            seq.prompt_logprobs.append(entry)
