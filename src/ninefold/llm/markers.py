"""Text that may still become a marker: what a stream holds back (stop strings, tool-call and reasoning tags)."""

from __future__ import annotations


def partial_marker_length(text: str, markers) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best
