"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``). Running sequences go first, in
arrival order: one token each when decoding, the rest of their prompt (up to the budget) when
their prefill was chunked. Waiting sequences are then admitted first-come-first-served while
the budget, ``max_num_seqs`` and the KV cache allow (while others run, the pool's watermark of
blocks stays free for their growth); a prompt longer than what is left of the
budget is prefilled in chunks over several steps, so decode and prefill tokens share a step.
A sequence with a LoRA adapter is admitted only with a device slot for its adapter; while every slot
holds another adapter in use, it waits, and only sequences without an adapter may go before it (later
ones for the adapters in the slots would keep them busy for ever).
When a running sequence needs a block and none is left, the latest-arrived running sequence
is preempted: its blocks are freed and it is recomputed later from its tokens (not before the
token a step in flight is sampling for it has been read). With a ``propose`` function
(speculative decoding), a decoding sequence also gets the draft tokens it proposes, within the
budget, as extra query rows of its step.

Under the ``"priority"`` policy (vLLM's ``scheduling_policy``) both queues are kept in order of
``(priority, arrival)``, lower values first: the waiting sequence admitted next is the most urgent one,
running sequences get the budget in that order, and the one preempted for blocks is the least urgent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ninefold.llm.kv_cache import BlockManager
from ninefold.llm.sequence import Sequence, Status


class ScheduledSeq:
    """A sequence and the ``num_new_tokens`` of its tokens, from ``start``, computed in this step.

    ``samples``: this step computes the sequence's last token, so a new token is sampled.
    ``draft_ids``: speculative tokens after the last one, counted in ``num_new_tokens``; each row
    from the last token on samples one token.
    """

    __slots__ = ("seq", "num_new_tokens", "start", "samples", "draft_ids")

    def __init__(self, seq: Sequence, num_new_tokens: int, draft_ids: list[int] | None = None):
        self.seq = seq
        self.num_new_tokens = num_new_tokens
        self.start = start = seq.num_computed_tokens
        self.draft_ids = drafts = [] if draft_ids is None else draft_ids
        self.samples = start + num_new_tokens - len(drafts) == len(seq.token_ids)

    def __repr__(self) -> str:
        return (f"ScheduledSeq(seq={self.seq.request_id}/{self.seq.index}, num_new_tokens={self.num_new_tokens}, "
                f"start={self.start}, samples={self.samples}, draft_ids={self.draft_ids})")

    @classmethod
    def row_of(cls, s: ScheduledSeq, i: int) -> ScheduledSeq:
        """Row ``i`` of a speculative ``s`` as a one-token step: position ``s.start + i``, its token the
        sequence's next (``i == 0``) or draft ``i - 1`` (the last of its ``draft_ids``)."""
        row = cls.__new__(cls)
        row.seq, row.num_new_tokens, row.start, row.samples = s.seq, 1, s.start + i, True
        row.draft_ids = s.draft_ids[:i]
        return row

    @property
    def num_sampled_rows(self) -> int:
        """Tokens sampled for this sequence in the step: one per draft plus one, or none."""
        return len(self.draft_ids) + 1 if self.samples else 0


POLICIES = ("fcfs", "priority")


def urgency(seq: Sequence) -> tuple[int, int]:
    """The ``"priority"`` policy's order: the request's priority, then arrival (lower first)."""
    return seq.priority, seq.seq_id


class Scheduler:
    """Continuous-batching scheduler (first come first served, or by priority) with chunked prefill
    and preemption by recompute."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 propose: Callable[[Sequence, int], list[int]] | None = None, policy: str = "fcfs",
                 lora_slots=None):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy: got {policy!r}; supported: {', '.join(POLICIES)}")
        self.by_priority = policy == "priority"
        self._unsorted = False  # (priority policy) a queue changed since they were last put in order
        self.blocks = block_manager
        self.propose = propose  # (sequence, most drafts wanted) -> draft tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.lora_slots = lora_slots  # ``LoRASlots``: a sequence with an adapter runs only while it holds a slot

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self._unsorted = self.by_priority

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's sequences and token counts, allocating their blocks. The prompt blocks that the step
        fills are registered in the prefix cache at once (see ``kv_cache``); if the step is not launched after
        all, ``unlaunch`` takes them back."""
        self.blocks.begin_step()
        budget = self.max_num_batched_tokens
        bs = self.blocks.block_size
        if self._unsorted:
            self.waiting = deque(sorted(self.waiting, key=urgency))
            self.running.sort(key=urgency)  # the least urgent last: the first to be preempted
            self._unsorted = False
        scheduled: list[ScheduledSeq] = []
        preempted = False
        i = 0
        running, propose = self.running, self.propose
        while i < len(running) and budget > 0:  # (runs once per sequence and step: kept lean)
            seq = running[i]
            n = len(seq.token_ids) - seq.num_computed_tokens
            if n == 0:  # its next token is still being sampled by the step in flight
                i += 1
                continue
            if n > budget:
                n = budget
            drafts = None
            if propose is not None and n == 1 and budget > 1 and seq.pending_row < 0:
                drafts = propose(seq, budget - 1)
                if drafts and not self._room_for_drafts(seq, n, len(drafts), later=len(running) - i - 1):
                    drafts = None
            if drafts:
                n += len(drafts)
            end = seq.num_computed_tokens + n
            while end > len(seq.block_table) * bs and not self.blocks.ensure(seq, end):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, n, drafts or None))
                if seq.num_computed_tokens < seq.num_prompt_tokens:  # a prompt chunk (decodes register later)
                    self._register(seq, n)
                budget -= n
                i += 1
        skipped = 0  # waiting sequences passed over because every adapter slot is taken by other adapters
        slot_wanted = False  # a sequence ahead waits for a slot: later ones with adapters wait too (no overtaking)
        while len(self.waiting) > skipped and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[skipped]
            if seq.pending_row >= 0:  # preempted while its last token is in flight: wait for that token
                break
            hits = self.blocks.match_prefix(seq)
            n = min(seq.num_tokens - self.blocks.cached_tokens(seq, hits), budget)
            # The pool's watermark stays free while others run, so they grow without preempting the newcomer.
            keep_free = self.blocks.pool.watermark_blocks if self.running else 0
            if not self.blocks.can_admit(seq, hits, n, keep_free):
                break
            if seq.lora is not None:
                slot = None if slot_wanted else self.lora_slots.acquire(seq.lora.lora_int_id, seq.lora_adapter)
                if slot is None:  # (so the adapters in the slots see their sequences finish and free one)
                    slot_wanted = True
                    skipped += 1
                    continue
                seq.lora_slot = slot
            del self.waiting[skipped]
            self.blocks.admit(seq, hits)
            if not self.blocks.ensure(seq, seq.num_computed_tokens + n):
                raise RuntimeError("BlockManager.can_admit and ensure disagree")  # a bug, not bad input
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._unsorted = self.by_priority
            scheduled.append(ScheduledSeq(seq, n))
            self._register(seq, n)
            budget -= n
        return scheduled

    def _register(self, seq: Sequence, n: int) -> None:
        """Register the blocks that ``seq``'s ``n`` tokens of this step fill (not drafts, nor a token in flight),
        so that sequences admitted after it in this step reuse them."""
        known = seq.num_tokens - (seq.pending_row >= 0)
        self.blocks.commit(seq, min(seq.num_computed_tokens + n, known))

    def unlaunch(self) -> None:
        """The step just scheduled was never launched: forget the blocks registered for it, and make a sequence
        that reused one compute it itself (the sequence that was to compute it may not run again). A sequence that
        holds its own copy of such a block (computed earlier, while another copy was registered under its digest)
        keeps its computed tokens; only its digests from there on are derived again, when it next commits."""
        forgotten = self.blocks.forget_unlaunched()
        if not forgotten:
            return
        bs = self.blocks.block_size
        for seq in self.running:
            for b, h in enumerate(seq.block_hashes):
                if h in forgotten:
                    del seq.block_hashes[b:]
                    if seq.block_table[b] == forgotten[h]:
                        seq.num_computed_tokens = min(seq.num_computed_tokens, b * bs)
                    break

    def _room_for_drafts(self, seq: Sequence, n: int, drafts: int, later: int) -> bool:
        """Take the blocks ``drafts`` need beyond ``seq``'s ``n`` tokens, only if as many blocks stay free as the
        ``later`` running sequences may each need for their next token: drafts never cause a preemption."""
        extra = (self.blocks.blocks_for(seq.num_computed_tokens + n + drafts)
                 - max(self.blocks.blocks_for(seq.num_computed_tokens + n), len(seq.block_table)))
        if extra > 0 and self.blocks.num_available - extra < later:
            return False
        return self.blocks.ensure(seq, seq.num_computed_tokens + n + drafts)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self._release_slot(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self._unsorted = self.by_priority
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """End ``seq`` (wherever it is) and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if seq.status is not Status.FINISHED:
            self._release_slot(seq)
            self.blocks.free(seq, keep_partial=reason in ("stop", "length"))
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
