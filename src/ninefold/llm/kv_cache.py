"""``BlockManager``: which KV-cache blocks each sequence holds, with prefix caching.

Blocks come from a ``KVCachePool``. A block whose tokens are all computed is registered under
a digest chained over every token before it (BLAKE2b: equal digests mean equal prefixes, and no
client can craft a prompt whose blocks collide with another's, as it could with Python's
``hash`` of integers, which is not randomised); a later
sequence with the same prefix reuses it instead of recomputing. The cache keeps one reference
of its own on each registered block: when no sequence holds it any more (ref-count 1) it stays
cached and becomes *evictable*, and is evicted least-recently-used first when free blocks run
out. With ``enable_prefix_caching=False`` nothing is registered.

A finished sequence's last, partly filled block is registered too (under the digest of its computed tokens,
chained like a full block), when the pool's blocks can be copied: a later sequence whose tokens go on from
exactly those (a beam extended by one token, a prompt that continues an earlier output) gets a copy of it and
computes only what follows, instead of recomputing up to ``block_size - 1`` tokens. The copy is its own, so
the cached block stays as it was for the next such sequence.

The scheduler registers a block as soon as a step that computes all its tokens is scheduled, before the step
runs: a sequence admitted later in the same step (a sibling of an ``n > 1`` request, or another request with
the same system prompt) reuses it, since every layer writes the whole step's keys and values to the cache
before any row attends. When such a step then fails to launch, ``forget_unlaunched`` takes those blocks out
of the cache again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from ninefold.llm.sequence import PLACEHOLDER, Sequence


def block_digest(parent: bytes | tuple | None, tokens: tuple[int, ...]) -> bytes:
    """The 16-byte key of a block of ``tokens`` after the block keyed ``parent`` (None: the first block;
    a tuple: ``Sequence.cache_root``)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent if isinstance(parent, bytes) else repr(parent).encode())
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class BlockManager:
    """Allocates blocks for sequences over ``pool`` and keeps the prefix cache."""

    def __init__(self, pool, *, enable_prefix_caching: bool = True, reuse_partial_blocks: bool = True):
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        # (tensor-parallel engines turn it off: a copy here would not reach the other ranks' pools)
        self.reuse_partial_blocks = enable_prefix_caching and reuse_partial_blocks and hasattr(pool, "copy_blocks")
        self._by_hash: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # digest -> (block id, its tokens)
        self._hash_of: dict[int, bytes] = {}  # block id -> digest
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.queried_tokens = 0
        self.hit_tokens = 0
        self._unlaunched: list[bytes] = []  # digests registered for the step being scheduled

    @property
    def num_available(self) -> int:
        """Blocks that an allocation can get: free ones plus evictable cached ones."""
        return self.pool.num_free + len(self._evictable)

    @property
    def hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served from the prefix cache."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # -- admission --------------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[tuple[int, bytes]]:
        """``(block id, hash)`` of the cached blocks that start ``seq``.

        At least one token is always left to compute, so the last position has logits. A sequence
        collecting prompt logprobs reuses only blocks whose positions it has already scored (their
        hidden states are needed for the next token's logprob).
        """
        if not self.enable_prefix_caching:
            return []
        usable = seq.num_tokens - 1
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            usable = min(usable, len(seq.prompt_logprobs) - 1)
        root = seq.cache_root
        if seq.prefix_memo is None or seq.prefix_memo[0] != root:
            seq.prefix_memo = (root, [])
        full = max(usable, 0) // self.block_size
        hits = self._cached_chain(seq.token_ids, full, root, seq.prefix_memo[1])
        seq.partial_hit = None
        if self.reuse_partial_blocks and len(hits) == full and seq.prompt_logprobs is None:
            seq.partial_hit = self._partial_hit(seq.token_ids, full, usable, hits[-1][1] if hits else root)
        return hits

    def cached_tokens(self, seq: Sequence, hits: list[tuple[int, bytes]]) -> int:
        """Tokens of ``seq`` that an admission with ``hits`` (and the partial block ``match_prefix`` found) skips."""
        return len(hits) * self.block_size + (seq.partial_hit[1] if seq.partial_hit else 0)

    def _partial_hit(self, token_ids: list[int], full: int, usable: int, parent) -> tuple[int, int] | None:
        """``(block, tokens)`` of a cached partly filled block holding ``token_ids`` from block ``full`` on, the
        longest of at most two lengths: all ``usable`` tokens (a beam extended by one token) or one fewer (a prompt
        continuing an earlier output, whose last token was never computed)."""
        start = full * self.block_size
        for end in (usable, usable - 1):
            if end <= start:
                return None
            tokens = tuple(token_ids[start:end])
            entry = self._by_hash.get(block_digest(parent, tokens))
            if entry is not None and entry[1] == tokens:
                return entry[0], end - start
        return None

    def _chain(self, token_ids: list[int], num_blocks: int, root=None, memo: list | None = None):
        """``(tokens, hash)`` of the first ``num_blocks`` full blocks of ``token_ids``, each hash chained over
        every token before it, the first one to ``root`` (``Sequence.cache_root``). ``memo`` holds the
        ``(tokens, hash)`` pairs of an earlier call with the same root: a block whose tokens are unchanged
        reuses its hash (comparing 16 tokens costs a tenth of hashing them)."""
        parent, bs = root, self.block_size
        for b in range(num_blocks):
            tokens = tuple(token_ids[b * bs : (b + 1) * bs])
            if memo is not None and b < len(memo) and memo[b][0] == tokens:
                parent = memo[b][1]
            else:
                parent = block_digest(parent, tokens)
                if memo is not None:
                    del memo[b:]
                    memo.append((tokens, parent))
            yield tokens, parent

    def _cached_chain(self, token_ids: list[int], num_blocks: int, root=None,
                      memo: list | None = None) -> list[tuple[int, bytes]]:
        """``(block id, hash)`` of the cached blocks among the first ``num_blocks``, up to the first miss."""
        hits = []
        for tokens, h in self._chain(token_ids, num_blocks, root, memo):
            entry = self._by_hash.get(h)
            if entry is None or entry[1] != tokens:
                break
            hits.append((entry[0], h))
        return hits

    def can_admit(self, seq: Sequence, hits: list[tuple[int, bytes]], num_new_tokens: int,
                  keep_free: int = 0) -> bool:
        """Whether ``seq`` can start with ``hits`` reused and ``num_new_tokens`` more tokens, leaving at least
        ``keep_free`` blocks to be had (headroom for the running sequences' next tokens)."""
        reclaimed = sum(1 for block, _ in hits if block in self._evictable)
        if seq.partial_hit and seq.partial_hit[0] in self._evictable:  # held while it is copied
            reclaimed += 1
        needed = self.blocks_for(self.cached_tokens(seq, hits) + num_new_tokens) - len(hits)
        return needed + keep_free <= self.num_available - reclaimed

    def admit(self, seq: Sequence, hits: list[tuple[int, bytes]]) -> None:
        """Give ``seq`` the cached blocks ``hits``; its computation starts after them. The hit rate and
        ``seq.num_cached_tokens`` count prompt tokens at the first admission only (a sequence readmitted after
        a preemption finds its own output's blocks too)."""
        blocks = [block for block, _ in hits]
        self._take(blocks)
        seq.block_table = blocks
        seq.block_hashes = [h for _, h in hits]
        seq.prefix_memo = None
        seq.num_computed_tokens = len(blocks) * self.block_size
        if seq.partial_hit is not None:
            source, count = seq.partial_hit
            self._take([source])  # (so that the allocation below cannot evict it)
            self._evict(1 - self.pool.num_free)
            copy = self.pool.allocate(1)
            self.pool.copy_blocks([source], copy)
            self.release([source])
            seq.block_table.append(copy[0])
            seq.num_computed_tokens += count
            seq.partial_hit = None
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            self.queried_tokens += seq.num_prompt_tokens
            self.hit_tokens += seq.num_cached_tokens

    # -- growth -----------------------------------------------------------------------------------

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq`` hold blocks for its first ``num_tokens`` tokens; False if they can't be had."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_available:
            return False
        self._evict(needed - self.pool.num_free)
        seq.block_table.extend(self.pool.allocate(needed))
        return True

    def commit(self, seq: Sequence, upto: int | None = None) -> None:
        """Register the blocks of ``seq`` that are full of computed tokens, or (``upto``, at scheduling) of the
        first ``upto`` tokens, which the step being scheduled computes."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        scheduling = upto is not None
        upto = seq.num_computed_tokens if upto is None else upto
        while len(seq.block_hashes) < upto // bs:
            b = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_root
            tokens = tuple(seq.token_ids[b * bs : (b + 1) * bs])
            h = block_digest(parent, tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[b]
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = (block, tokens)
                self._hash_of[block] = h
                self.pool.incref([block])
                if scheduling:
                    self._unlaunched.append(h)

    def begin_step(self) -> None:
        """A new step is being scheduled: the blocks registered for the last one were launched."""
        self._unlaunched.clear()

    def forget_unlaunched(self) -> dict[bytes, int]:
        """Unregister the blocks registered for a step that was scheduled but never launched (their keys and
        values were never computed); returns ``{digest: block}``. The sequences holding them keep them as their
        own."""
        forgotten = {}
        for h in self._unlaunched:
            entry = self._by_hash.pop(h, None)
            if entry is None:
                continue
            block = entry[0]
            del self._hash_of[block]
            self._evictable.pop(block, None)
            self.pool.free([block])  # the cache's reference
            forgotten[h] = block
        self._unlaunched.clear()
        return forgotten

    # -- transfer between engines -------------------------------------------------------------------

    def cached_blocks(self, token_ids: list[int]) -> list[int]:
        """The cached blocks holding the full blocks of ``token_ids``, in order, up to the first one not cached."""
        return [block for block, _ in self._cached_chain(token_ids, len(token_ids) // self.block_size)]

    def insert_prefix(self, token_ids: list[int], data) -> int:
        """Register the first ``len(data)`` full blocks of ``token_ids`` in the prefix cache with the contents
        ``data`` (``[blocks, ...]`` as ``KVCachePool.read_blocks`` gives), so that a sequence starting with
        those tokens reuses them. Blocks already cached are kept; returns how many were written. They are
        evictable at once (no sequence holds them), the whole prefix after every older cached block and its
        tail first. Raises ValueError when the pool cannot hold them."""
        if not self.enable_prefix_caching:
            raise ValueError("insert_prefix: this engine runs with enable_prefix_caching=False, so blocks "
                             "received from another engine could never be reused")
        n = len(data)
        bs = self.block_size
        if n * bs > len(token_ids):
            raise ValueError(f"data: {n} blocks of {bs} tokens need {n * bs} token ids, got {len(token_ids)}")
        kept = self.cached_blocks(token_ids[: n * bs])
        needed = n - len(kept)
        # The kept blocks head the prefix: they must not be evicted to make room for its tail.
        kept_evictable = [block for block in kept if block in self._evictable]
        if needed > self.num_available - len(kept_evictable):
            raise ValueError(f"data: {needed} new blocks do not fit; {self.num_available - len(kept_evictable)} "
                             f"can be had (free or evictable) out of {self.pool.num_blocks}")
        for block in kept_evictable:
            del self._evictable[block]
        chain = list(self._chain(token_ids, n))
        hashes = [h for _, h in chain]
        for h in hashes[len(kept):]:  # a block left over from an evicted head: unreachable, drop it
            stale = self._by_hash.get(h)
            if stale is not None and stale[0] in self._evictable:
                del self._evictable[stale[0]], self._by_hash[h], self._hash_of[stale[0]]
                self.pool.free([stale[0]])
        self._evict(needed - self.pool.num_free)
        new = self.pool.allocate(needed) if needed > 0 else []
        if new:
            self.pool.write_blocks(new, data[len(kept):])
        for b, block in enumerate(new, start=len(kept)):
            if hashes[b] in self._by_hash:  # held by a running sequence already: the copy is not needed
                self.pool.free([block])
                continue
            self._by_hash[hashes[b]] = (block, chain[b][0])
            self._hash_of[block] = hashes[b]
        self._mark_evictable(kept + new)  # the allocation's reference is the cache's own; heads evicted last
        return max(needed, 0)

    def hold(self, token_ids: list[int]) -> list[int]:
        """Keep the cached full blocks of ``token_ids`` (up to the first one not cached) from eviction until
        :meth:`release`, as a sequence holding them would; returns them. An imported prefix is held so until the
        request that reuses it is admitted."""
        blocks = self.cached_blocks(token_ids)
        self._take(blocks)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Undo :meth:`hold`: blocks that nothing else holds become evictable again, tail blocks first in line."""
        if blocks:
            self.pool.free(blocks)
        self._mark_evictable(blocks)

    def _take(self, blocks: list[int]) -> None:
        """One more reference on each of ``blocks`` (cached ones among them are no longer evictable)."""
        for block in blocks:
            self._evictable.pop(block, None)
        if blocks:
            self.pool.incref(blocks)

    def _mark_evictable(self, blocks: list[int]) -> None:
        """The cached ones of ``blocks`` that only the cache holds become evictable, the last one first in line."""
        for block in reversed(blocks):
            if block in self._hash_of and self.pool.ref_count(block) == 1:
                self._evictable[block] = None

    # -- release ----------------------------------------------------------------------------------

    def free(self, seq: Sequence, keep_partial: bool = False) -> None:
        """Drop ``seq``'s blocks (at once); cached ones stay, evictable, tail blocks first in line. ``keep_partial``
        (a sequence that finished normally): its last, partly filled block of computed tokens is cached too."""
        if keep_partial and self.reuse_partial_blocks:
            self._register_partial(seq)
        self.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def _register_partial(self, seq: Sequence) -> None:
        computed = seq.num_computed_tokens
        b, count = divmod(computed, self.block_size)
        if not count or b >= len(seq.block_table) or len(seq.block_hashes) != b or computed > seq.num_tokens:
            return  # no partly filled block, or the full blocks before it are not all registered
        tokens = tuple(seq.token_ids[b * self.block_size:computed])
        block = seq.block_table[b]
        if PLACEHOLDER in tokens or block in self._hash_of or self.pool.ref_count(block) != 1:
            return
        h = block_digest(seq.block_hashes[-1] if b else seq.cache_root, tokens)
        if h in self._by_hash:
            return
        self._by_hash[h] = (block, tokens)
        self._hash_of[block] = h
        self.pool.incref([block])

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (blocks in use stay registered)."""
        self._evict(len(self._evictable))

    def _evict(self, n: int) -> None:
        """Free the ``n`` least recently used evictable blocks (none when ``n`` <= 0)."""
        for _ in range(max(n, 0)):
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            self.pool.free([block])
