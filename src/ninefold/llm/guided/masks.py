"""Which tokens may come next under the JSON recognizer, computed per state and cached.

Two indexes of the vocabulary's byte strings, built once per tokenizer, keep a mask's cost to the
tokens that could pass: tokens by first byte (between JSON tokens only a few first bytes can follow,
so only tokens starting with one of them are run through the recognizer), and the tokens that are
plain string content (no quote, backslash or control byte: inside a string every one of them stays
inside it; only the rest are checked one by one). Masks are cached by ``json_machine.cache_key``
(the state with its innermost containers only), so a handful of states covers a whole generation and
each mask is built once per process and device.
"""

from __future__ import annotations

import threading

import torch

from ninefold.llm.guided import json_machine


def _plain_string(data: bytes) -> bool:
    return all(byte >= 0x20 and byte not in (0x22, 0x5C) for byte in data)


class TokenMasks:
    """Allowed-token masks of one vocabulary (``vocab[token_id]``: its bytes, None for special tokens)."""

    def __init__(self, vocab: list[bytes | None], size: int):
        self.vocab = vocab
        self.size = size  # the logits' width (may exceed the tokenizer's vocabulary)
        self.by_first_byte: dict[int, list[int]] = {}
        self.plain: list[int] = []  # tokens that are plain string content
        self.other: list[int] = []  # every other token with bytes
        for token_id, data in enumerate(vocab):
            if not data:
                continue
            self.by_first_byte.setdefault(data[0], []).append(token_id)
            (self.plain if _plain_string(data) else self.other).append(token_id)
        self._masks: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()

    def allowed(self, state: tuple) -> list[int]:
        """Token ids whose bytes can follow ``state`` (sorted)."""
        vocab, advance = self.vocab, json_machine.advance
        if state[0] == "string":
            out = self.plain + [i for i in self.other if advance(state, vocab[i]) is not None]
        else:
            out = []
            for first, ids in self.by_first_byte.items():
                after = json_machine.step(state, first)
                if after is not None:
                    out.extend(i for i in ids if advance(after, vocab[i][1:]) is not None)
        out.sort()
        return out

    def mask(self, state: tuple, device: torch.device) -> torch.Tensor:
        """Boolean ``[size]`` on ``device``: the tokens allowed after ``state`` (not a complete one)."""
        key = (json_machine.cache_key(state), str(device))
        mask = self._masks.get(key)
        if mask is None:
            mask = torch.zeros(self.size, dtype=torch.bool)
            mask[[i for i in self.allowed(key[0]) if i < self.size]] = True
            mask = mask.to(device)
            with self._lock:
                self._masks[key] = mask
        return mask
