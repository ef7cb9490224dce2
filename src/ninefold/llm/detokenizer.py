"""Incremental detokenization and stop strings for one output sequence.

Each new token decodes a short window of recent ids twice (with and without the new ones) and
appends the difference, so the cost per token is constant. Text ending in an incomplete UTF-8
character (decoded as U+FFFD) is held back until the character completes; after ``MAX_HELD_TOKENS`` ids
(invalid bytes, or tokens that each end inside a character) the text up to the latest cut that splits no
character goes out, and ``MAX_WINDOW_TOKENS`` bounds how far the window grows while there is none. Stop
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
# Ids held while no cut between them is clean (byte-level tokens that each end inside a character) before the
# oldest are released anyway: bounds the window a model emitting such runs (or invalid bytes) makes us decode.
MAX_WINDOW_TOKENS = 32


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
        self._ids = list(prompt_ids[self._clean_start(prompt_ids, 0, len(prompt_ids) - PREFIX_WINDOW):])
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
                self._prefix = self._clean_start(self._ids, self._read, end - PREFIX_WINDOW)
                self._read = end
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
            # The window keeps its start: one starting at the special token would decode the next word alone,
            # and SentencePiece decoders strip a leading space there. A long run of such ids moves it anyway.
            self._read = len(self._ids)
            if self._read - self._prefix > PREFIX_WINDOW + MAX_HELD_TOKENS:
                self._prefix = self._read - PREFIX_WINDOW
            return ""
        end = len(self._ids)
        if new_text.endswith("\ufffd"):
            if end - self._read < MAX_HELD_TOKENS:
                return ""
            # Held long: release up to the latest cut that splits no character (invalid bytes are no character,
            # so a run of them has such cuts); with none, hold on, up to MAX_WINDOW_TOKENS, then cut before the
            # last three ids, which may still begin one.
            cut = self._clean_cut(new_text)
            if cut is None:
                if len(self._ids) - self._read < MAX_WINDOW_TOKENS:
                    return ""
                end = len(self._ids) - 3
                new_text = decode(self._ids[self._prefix : end], self.skip_special_tokens)
            else:
                end, new_text = cut
        self._prefix, self._read = self._read, end
        return new_text[len(prefix_text) :]

    def _clean_cut(self, window_text: str) -> tuple[int, str] | None:
        """``(end, text of the window up to end)`` for the latest id index ``end`` after ``_read`` where the
        window splits into two decodes that join to ``window_text`` (the whole window's), or None."""
        decode = self.tokenizer.decode
        for end in range(len(self._ids) - 1, self._read, -1):
            head = decode(self._ids[self._prefix : end], self.skip_special_tokens)
            if head + decode(self._ids[end:], self.skip_special_tokens) == window_text:
                return end, head
        return None

    def _clean_start(self, ids: list[int], lowest: int, start: int) -> int:
        """``start`` (at least ``lowest``), moved back over the ids that decode alone to U+FFFD first (at most
        ``MAX_WINDOW_TOKENS``): a decode window starting inside a character's bytes garbles it, and byte-fallback
        decoders turn a whole run of byte tokens with an invalid start into U+FFFD, so the window starts before
        such a run."""
        start = max(start, lowest)
        for _ in range(MAX_WINDOW_TOKENS):
            if start <= lowest or not self.tokenizer.decode(ids[start : start + 1], self.skip_special_tokens).startswith("\ufffd"):
                break
            start -= 1
        return start

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
