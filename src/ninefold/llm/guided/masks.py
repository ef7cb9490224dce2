"""Which tokens may come next under a byte-level recognizer, computed per state and cached.

A recognizer (``json_machine.JSON_OBJECT``, a ``choice_machine.ChoiceMachine``) has ``step``,
``advance``, ``cache_key``, ``may_end`` and ``in_string``. Two indexes of the vocabulary's byte
strings, built once per tokenizer, keep a mask's cost to the tokens that could pass: tokens by first
byte (between JSON tokens only a few first bytes can follow, so only tokens starting with one of them
are run through the recognizer), and the tokens that are plain string content (no quote, backslash or
control byte: inside a JSON string every one of them stays inside it; only the rest are checked one
by one). Masks are cached by the recognizer's ``key`` (what it recognizes) and the state's
``cache_key`` (for JSON the state with its innermost containers only), so a handful of states covers
a whole generation; at most ``MAX_MASKS`` are kept, least recently used dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

MAX_MASKS = 512  # cached masks (a vocabulary's worth of booleans each), least recently used dropped first


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
        self._masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def allowed(self, machine, state) -> list[int]:
        """Token ids whose bytes can follow ``state`` of ``machine`` (sorted)."""
        vocab, advance = self.vocab, machine.advance
        if machine.in_string(state):
            out = self.plain + [i for i in self.other if advance(state, vocab[i]) is not None]
        else:
            out = []
            for first, ids in self.by_first_byte.items():
                after = machine.step(state, first)
                if after is not None:
                    out.extend(i for i in ids if advance(after, vocab[i][1:]) is not None)
        out.sort()
        return out

    def mask(self, machine, state, device: torch.device, end_ids: tuple[int, ...] = ()) -> torch.Tensor:
        """Boolean ``[size]`` on ``device``: the tokens allowed after ``state`` (not a complete one), and
        ``end_ids`` (end-of-sequence tokens) where the output may end there."""
        key = (machine.key, machine.cache_key(state), str(device), end_ids if machine.may_end(state) else (), end_ids)
        with self._lock:
            mask = self._masks.get(key)
            if mask is not None:
                self._masks.move_to_end(key)
                return mask
        ids = self.allowed(machine, key[1])
        # where the output may end, the end-of-sequence tokens; where no token can continue it (a choice this
        # vocabulary cannot spell), they are the only way out
        ids += list(end_ids) if key[3] or not ids else []
        mask = torch.zeros(self.size, dtype=torch.bool)
        mask[[i for i in ids if i < self.size]] = True
        mask = mask.to(device)
        with self._lock:
            self._masks[key] = mask
            while len(self._masks) > MAX_MASKS:  # least recently used first
                self._masks.popitem(last=False)
        return mask
