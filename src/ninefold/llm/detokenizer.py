"""Incremental detokenization and stop strings for one output sequence.

Each new token decodes a short window of recent ids twice (with and without the new ones) and
appends the difference, so the cost per token is constant. Text ending in an incomplete UTF-8
character (decoded as U+FFFD) is held back until the character completes, bounded by
``MAX_HELD_TOKENS`` so a model that emits invalid bytes cannot make the window grow. Stop
strings are searched only in the tail the new text can reach; while running, the last
``len(longest stop) - 1`` characters are held back so a stop string is never streamed out.

Without stop strings nothing needs the text until someone reads it, so new ids are only queued
and turned into text when ``text`` is read: a stream reads it every step (one id at a time, as
above), an offline request once at the end, where all its ids decode in one call.
"""

from __future__ import annotations

from ninefold.llm.tokenizer import Tokenizer

# Tokens of prompt context decoded before the first new token (leading-space rules of
# SentencePiece-style decoders depend on it).
PREFIX_WINDOW = 5
# A UTF-8 character spans at most 4 bytes, hence at most 4 byte-level tokens.
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns the token ids of one sequence into text as they arrive."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_ids[-PREFIX_WINDOW:])
        self._prefix = 0
        self._read = len(self._ids)
        self._text = ""
        self._queued: list[int] = []
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        """All text decoded so far (held-back incomplete characters excluded)."""
        if self._queued:
            self._catch_up()
        return self._text

    def add(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append new token ids; returns the stop string if one now ends the text, else None.

        With ``check_stop=False`` (before ``min_tokens``) stop strings are not looked for.
        """
        if not self.stop:
            self._queued.extend(token_ids)
            return None
        for token_id in token_ids:
            before = len(self._text)
            self._push(token_id)
            if check_stop:
                found = self._find_stop(before)
                if found is not None:
                    return found
        return None

    def visible_text(self, finished: bool) -> str:
        """The text to show: all of it once finished, else without a possible stop-string start."""
        text = self.text
        if finished or not self.hold:
            return text
        return text[: max(len(text) - self.hold, 0)]

    def _push(self, token_id: int) -> None:
        self._ids.append(token_id)
        self._text += self._delta()
        if self._prefix > 64:
            self._drop_unreachable_ids()

    def _catch_up(self) -> None:
        queued, self._queued = self._queued, []
        if len(queued) > 1 and self._decode_at_once(queued):
            return
        for token_id in queued:
            self._push(token_id)

    def _decode_at_once(self, queued: list[int]) -> bool:
        """Turn ``queued`` into text with one decode; False (nothing changed) if no cut point is clean."""
        decode = self.tokenizer.decode
        base = len(self._ids)
        self._ids.extend(queued)
        prefix_text = decode(self._ids[self._prefix : self._read], self.skip_special_tokens)
        # An incomplete character at the end spans at most 3 ids: cut before it, hold those ids.
        for end in range(len(self._ids), max(len(self._ids) - 4, self._read), -1):
            new_text = decode(self._ids[self._prefix : end], self.skip_special_tokens)
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                self._text += new_text[len(prefix_text) :]
                self._prefix, self._read = max(self._read, end - PREFIX_WINDOW), end
                self._drop_unreachable_ids()
                return True
        del self._ids[base:]
        return False

    def _drop_unreachable_ids(self) -> None:
        """Forget the ids before the decode window's start: no later window reaches them."""
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0

    def _delta(self) -> str:
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], self.skip_special_tokens)
        new_text = decode(self._ids[self._prefix :], self.skip_special_tokens)
        if new_text == prefix_text:  # no text (a skipped special token): nothing to hold it for
            self._prefix, self._read = self._read, len(self._ids)
            return ""
        end = len(self._ids)
        if new_text.endswith("\ufffd"):
            if end - self._read < MAX_HELD_TOKENS:
                return ""
            # Held too long (bytes that are no character): release them, but not the last three ids, which may
            # still begin one.
            for end in range(len(self._ids) - 1, len(self._ids) - 4, -1):
                new_text = decode(self._ids[self._prefix : end], self.skip_special_tokens)
                if not new_text.endswith("\ufffd"):
                    break
        self._prefix, self._read = self._read, end
        return new_text[len(prefix_text) :]

    def _find_stop(self, before: int) -> str | None:
        best = None
        for stop in self.stop:
            start = max(before - len(stop) + 1, 0)
            index = self._text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[: index + len(stop) if self.include_stop else index]
        self.stopped_by = stop
        return stop
