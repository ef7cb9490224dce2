"""Admission control: how many sequences the server holds at once, and draining on shutdown."""

from __future__ import annotations

from ninefold.llm.server.errors import APIError


class Admission:
    """Counts admitted sequences; refuses new ones when full (429) or shutting down (503).

    ``capacity`` is what the engine runs at once plus the waiting queue (``max_num_seqs +
    max_queue``); None means no limit.
    """

    def __init__(self, capacity: int | None, retry_after_s: int = 1) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity: got {capacity}; expected an integer >= 1 or None")
        self.capacity = capacity
        self.retry_after_s = retry_after_s
        self.in_use = 0
        self.draining = False

    def acquire(self, count: int) -> None:
        """Admit ``count`` sequences or raise the APIError to send back."""
        headers = {"Retry-After": str(self.retry_after_s)}
        if self.draining:
            raise APIError(503, "the server is shutting down and accepts no new requests", headers=headers)
        if self.capacity is not None and self.in_use + count > self.capacity:
            raise APIError(
                429,
                f"the server is at capacity ({self.in_use} sequences admitted, at most {self.capacity}); "
                f"retry after {self.retry_after_s} s",
                code="queue_full",
                headers=headers,
            )
        self.in_use += count

    def release(self, count: int) -> None:
        """Return ``count`` admitted sequences."""
        self.in_use = max(self.in_use - count, 0)
