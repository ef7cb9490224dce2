"""Which tokens may come next under a byte-level recognizer, computed per state and cached.

A recognizer (``json_machine.JSON_OBJECT``, a ``choice_machine.ChoiceMachine``, a ``SchemaMachine``) has
``step``, ``advance``, ``cache_key``, ``may_end`` and ``in_string``. The vocabulary's byte strings, indexed
once per tokenizer, keep a mask's cost to the tokens that could pass. Sorted, they form an implicit trie:
tokens sharing a prefix are one run of the sorted list, so the recognizer steps once per prefix and a byte
it refuses drops the whole run (after whitespace between JSON tokens, the tens of thousands of tokens that
start with a space and go on with a letter cost one step per letter). Inside a JSON string, where almost
every token passes, the tokens that are plain string content (no quote, backslash or control byte) are
taken whole and only the rest are checked one by one; a run that reaches a string (after an escape, say)
takes its tokens whose remaining bytes are plain the same way. Masks are cached by the recognizer's ``key`` (what
it recognizes) and the state's ``cache_key`` (for JSON the state with its innermost containers only), so
a handful of states covers a whole generation; at most ``MAX_MASKS`` are kept, least recently used dropped
first.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import OrderedDict

import numpy as np
import torch

WALK_BUDGET = 3000  # runs of the walk before it gives way to a sweep of the whole vocabulary
MAX_MASKS = 512  # cached masks (a vocabulary's worth of booleans each), least recently used dropped first


def _plain_string(data: bytes) -> bool:
    return all(byte >= 0x20 and byte not in (0x22, 0x5C) for byte in data)


def _byte_columns(keys: list[bytes], ids: list[int]):
    """The tokens longest first: for each byte position the column of their bytes there, how many tokens reach
    that position (a prefix of the order), and the token ids in that order."""
    order = sorted(range(len(keys)), key=lambda k: -len(keys[k]))
    longest = len(keys[order[0]]) if keys else 0
    matrix = np.zeros((longest, len(keys)), dtype=np.uint8)
    for row, k in enumerate(order):
        matrix[: len(keys[k]), row] = np.frombuffer(keys[k], dtype=np.uint8)
    lengths = np.asarray([len(keys[k]) for k in order])
    ends = [int(np.count_nonzero(lengths > depth)) for depth in range(longest)]
    return list(matrix), ends, np.asarray([ids[k] for k in order], dtype=np.int64)


def _plain_tail(data: bytes) -> int:
    """The index from which ``data`` is plain string content to its end."""
    end = len(data)
    while end and data[end - 1] >= 0x20 and data[end - 1] not in (0x22, 0x5C):
        end -= 1
    return end


class TokenMasks:
    """Allowed-token masks of one vocabulary (``vocab[token_id]``: its bytes, None for special tokens)."""

    def __init__(self, vocab: list[bytes | None], size: int):
        self.vocab = vocab
        self.size = size  # the logits' width (may exceed the tokenizer's vocabulary)
        self.plain: list[int] = []  # tokens that are plain string content
        self.other: list[int] = []  # every other token with bytes
        for token_id, data in enumerate(vocab):
            if data:
                (self.plain if _plain_string(data) else self.other).append(token_id)
        ordered = sorted((data, token_id) for token_id, data in enumerate(vocab) if data)
        self._keys = [data for data, _ in ordered]  # the implicit trie: prefixes are runs of this list
        self._ids = [token_id for _, token_id in ordered]
        # where each token's plain-string tail starts: inside a string, the rest of a run needs no recognizer
        self._plain_from = [_plain_tail(data) for data in self._keys]
        self._columns = None  # the tokens' bytes by position, for sweeps (built on the first)
        self._holding: dict[int, list[int]] = {}  # tokens holding a byte (the end of a reasoning marker)
        self._masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def allowed(self, machine, state) -> list[int]:
        """Token ids whose bytes can follow ``state`` of ``machine`` (sorted)."""
        if getattr(machine, "free", None) is not None and machine.free(state):
            return self._free(machine, state)
        if machine.in_string(state):
            vocab, advance = self.vocab, machine.advance
            out = self.plain + [i for i in self.other if advance(state, vocab[i]) is not None]
        else:
            out = self._walk(machine, state, WALK_BUDGET)
            if out is None:  # most tokens pass (a regex's ".*"): run them all at once instead
                out = self._sweep(machine, state)
        out.sort()
        return out

    def _sweep(self, machine, state) -> list[int]:
        """Every token through the recognizer together, a byte position at a time: the recognizer steps once per
        distinct (state, byte) pair met, kept in a table the next positions look up."""
        if self._columns is None:
            self._columns, self._ends, self._token_ids = _byte_columns(self._keys, self._ids)
        states, index = [state], {state: 0}
        table = np.full((64, 256), -2, dtype=np.int32)  # -2: not met yet, -1: refused
        live = np.arange(len(self._token_ids), dtype=np.int64)  # longest tokens first
        current = np.zeros(len(live), dtype=np.int32)
        refused = np.zeros(len(live), dtype=bool)
        for column, end in zip(self._columns, self._ends):
            live = live[live < end]  # tokens shorter than this position are done (and passed)
            if not len(live):
                break
            byte = column[live]
            nxt = table[current[live], byte]
            unknown = nxt == -2
            if unknown.any():
                for pair in np.unique(current[live[unknown]].astype(np.int64) * 256 + byte[unknown]):
                    sid, value = divmod(int(pair), 256)
                    after = machine.step(states[sid], value)
                    if after is not None and after not in index:
                        index[after] = len(states)
                        states.append(after)
                        if len(states) > len(table):
                            table = np.vstack([table, np.full_like(table, -2)])
                    table[sid, value] = -1 if after is None else index[after]
                nxt = table[current[live], byte]
            out = nxt < 0
            refused[live[out]] = True
            live, current_live = live[~out], nxt[~out]
            current[live] = current_live
        return self._token_ids[~refused].tolist()

    def _free(self, machine, state) -> list[int]:
        """Free text (a reasoning model thinking): every token but those that end it into refused bytes, all
        of which hold the end marker's last byte."""
        byte = machine.end_byte
        if byte not in self._holding:
            self._holding[byte] = [i for i, data in enumerate(self.vocab) if data and byte in data]
        refused = {i for i in self._holding[byte] if machine.advance(state, self.vocab[i]) is None}
        return [i for i, data in enumerate(self.vocab) if data and i not in refused]

    def _walk(self, machine, state, budget: int) -> list[int] | None:
        """Depth-first over the sorted tokens: each run shares a prefix, which the recognizer read once. None
        when it would take more than ``budget`` runs."""
        keys, ids, step, plain_from = self._keys, self._ids, machine.step, self._plain_from
        out: list[int] = []
        stack = [(0, len(keys), 0, state)]  # a run [lo, hi) sharing ``depth`` bytes, the state after them
        while stack:
            budget -= 1
            if budget < 0:
                return None
            lo, hi, depth, after = stack.pop()
            if machine.in_string(after):  # after an escape, say: plain tails stay in the string
                out.extend(ids[k] for k in range(lo, hi)
                           if plain_from[k] <= depth or machine.advance(after, keys[k][depth:]) is not None)
                continue
            while lo < hi and len(keys[lo]) == depth:  # a token that is the whole prefix sorts first
                out.append(ids[lo])
                lo += 1
            while lo < hi:
                byte = keys[lo][depth]
                end = hi if byte == 255 else bisect_left(keys, keys[lo][:depth] + bytes((byte + 1,)), lo, hi)
                nxt = step(after, byte)
                if nxt is not None:
                    stack.append((lo, end, depth + 1, nxt))
                lo = end
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
