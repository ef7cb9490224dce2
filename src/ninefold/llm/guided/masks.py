"""Which tokens may come next under a byte-level recognizer: a trie walk, cached per state.

The vocabulary's byte strings go into a trie once per tokenizer. For a recognizer state, the walk
follows every trie edge whose byte the recognizer accepts and collects the tokens that end on the
way, so it visits only what can still be valid. Masks are cached by ``json_machine.cache_key``
(the state with its innermost containers only): a handful of states covers a whole generation,
and each mask is built once per process and device.
"""

from __future__ import annotations

import threading

import torch

from ninefold.llm.guided import json_machine


class _Node:
    __slots__ = ("ids", "children")

    def __init__(self):
        self.ids: list[int] = []
        self.children: dict[int, _Node] = {}


class TokenMasks:
    """Allowed-token masks of one vocabulary (``vocab[token_id]``: its bytes, None for special tokens)."""

    def __init__(self, vocab: list[bytes | None], size: int):
        self.vocab = vocab
        self.size = size  # the logits' width (may exceed the tokenizer's vocabulary)
        self.root = _Node()
        for token_id, data in enumerate(vocab):
            if not data:
                continue
            node = self.root
            for byte in data:
                node = node.children.setdefault(byte, _Node())
            node.ids.append(token_id)
        self._masks: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()

    def allowed(self, state: tuple) -> list[int]:
        """Token ids whose bytes can follow ``state`` (sorted)."""
        out: list[int] = []
        pending = [(self.root, state)]
        step = json_machine.step
        while pending:
            node, current = pending.pop()
            for byte, child in node.children.items():
                nxt = step(current, byte)
                if nxt is None:
                    continue
                out.extend(child.ids)
                if child.children:
                    pending.append((child, nxt))
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
