"""Turning an engine's cumulative text into safe streamed deltas.

The engine reports the whole text generated so far; a stream sends only what is new. Two kinds of
text must be held back until more tokens arrive: a trailing U+FFFD (an incomplete UTF-8 sequence
that the next token may complete, which would otherwise show up as a replacement character and
then as a duplicated character), and a tail that could be the start of a stop string (which must
never reach the client if the stop string then completes, because the engine drops it).
"""

from __future__ import annotations

from ninefold.llm.markers import partial_marker_length

REPLACEMENT = "\ufffd"


stop_prefix_overlap = partial_marker_length  # the tail that may become a stop string


class DeltaStream:
    """Tracks how much of one choice's cumulative text has been sent."""

    def __init__(self, stops: list[str] | None = None) -> None:
        self.stops = list(stops or [])
        self.sent = 0

    def delta(self, text: str, finished: bool) -> str:
        """The part of ``text`` that can be sent now (everything that is left once ``finished``)."""
        end = len(text)
        if not finished:
            while end > self.sent and text[end - 1] == REPLACEMENT:
                end -= 1
            if self.stops:
                end = min(end, len(text) - stop_prefix_overlap(text, self.stops))
        if end <= self.sent:
            return ""
        piece = text[self.sent : end]
        self.sent = end
        return piece
