"""Per-sequence and per-request state shared by the scheduler, the runner and the engine."""

from __future__ import annotations

import enum
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any

from ninefold.llm.sampling import SamplingParams

_ids = itertools.count()
PLACEHOLDER = -1  # a sampled token not read back from the device yet (see ``Sequence.pending_row``)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One output sequence: its tokens (prompt then output), KV blocks and decoding state."""

    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served at the first admission
    # while waiting: ``(cache_root, [(block's tokens, digest), ...])`` from the last prefix match, so a sequence
    # that waits many steps digests its prompt once (``BlockManager.match_prefix``)
    prefix_memo: tuple | None = None
    # while waiting: ``(block, tokens)`` of a cached partly filled block that continues the full blocks the last
    # prefix match found (``BlockManager.match_prefix``), copied at admission
    partial_hit: tuple[int, int] | None = None
    generator: Any = None  # seeded requests: reseeded for every token (``Sampler.generators``)
    seed: int | None = None
    detokenizer: Any = None
    logprobs: list[dict[int, float]] | None = None
    # ``prompt_logprobs`` requests: one entry per prompt token computed so far (None for the first)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    plain_greedy: bool = False  # params.plain_greedy, read once (the sampler checks it every step)
    penalized: bool = False  # params.has_penalties, read once (the engine checks it every step)
    guide: Any = None  # guided decoding: a ``ninefold.llm.guided`` guide advanced by every output token
    bad_words: list[tuple[int, ...]] | None = None  # token sequences never to complete (SamplingParams.bad_words)
    allowed_mask: Any = None  # additive logits mask of SamplingParams.allowed_token_ids, built on first use
    output_ids: list[int] = field(default_factory=list)  # the generated tokens (grows in place)
    # With overlapped scheduling, a token still on the device: its row in the step in flight, and
    # PLACEHOLDER stands at the end of ``token_ids``/``output_ids`` until the engine reads it.
    pending_row: int = -1
    priority: int = 0  # the request's (scheduling_policy "priority": lower runs first)
    lora: Any = None  # the request's ``LoRARequest`` (None: the base model)
    lora_adapter: Any = None  # its adapter as read and checked when the request was built
    lora_slot: int = -1  # the device slot holding it while the sequence runs (``LoRASlots``)
    # the length (prompt + output tokens) at which it ends: max_tokens or max_model_len, set by the engine
    max_num_tokens: int = sys.maxsize

    def __post_init__(self) -> None:
        self.plain_greedy = self.params.plain_greedy
        self.penalized = self.params.has_penalties

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cache_root(self) -> tuple[str, int, int] | None:
        """What the prefix cache chains this sequence's first block to: keys and values computed under an
        adapter serve only that adapter (its id, and which loading of it)."""
        if self.lora is None:
            return None
        return "lora", self.lora.lora_int_id, getattr(self.lora_adapter, "generation", 0)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    def append(self, token: int) -> None:
        """Add a generated token (in place of the placeholder when one is pending)."""
        if self.pending_row >= 0:
            self.token_ids[-1] = token
            self.output_ids[-1] = token
            self.pending_row = -1
        else:
            self.token_ids.append(token)
            self.output_ids.append(token)

    def add_placeholder(self, row: int) -> None:
        """Stand in for the token that row ``row`` of the step in flight is sampling."""
        self.token_ids.append(PLACEHOLDER)
        self.output_ids.append(PLACEHOLDER)
        self.pending_row = row

    def drop_placeholder(self) -> None:
        """Forget a pending token (the sequence ended before it was read)."""
        if self.pending_row >= 0:
            self.token_ids.pop()
            self.output_ids.pop()
            self.pending_row = -1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(eq=False)
class Request:
    """A submitted prompt and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival: float = 0.0
    priority: int = 0
    lora_request: Any = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
