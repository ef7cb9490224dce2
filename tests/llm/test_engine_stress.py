"""Seeded randomized stress test of the engine's scheduling machinery on a tiny random-weight model.

The property: with greedy sampling (``temperature=0, ignore_eos=True``) every request's output equals the
output of the same prompt run alone in a roomy engine (a big KV pool, no prefix caching), however requests are
interleaved: added at different steps (some while others decode), aborted mid-flight, sharing long prefixes
(block-aligned ones and identical prompts), continuing an earlier output (partial-block reuse), ``n > 1``;
under prefix caching, a tiny pool that forces preemption by recompute, chunked prefill, few sequence slots,
overlapped ("async") scheduling, the priority policy and n-gram speculative decoding.

Every step the block accounting is checked (each block's ref-count is its holders plus the prefix cache's own
reference; a cached block nobody holds is evictable), every streamed output must be a prefix of the reference,
and after each workload every block must be free again.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from ninefold import SamplingParams
from ninefold.llm.engine import LLMEngine
from ninefold.llm.sequence import PLACEHOLDER

SEEDS = (11, 23, 37, 53)
MAX_PROMPT = 60
MAX_NEW = 24
MAX_STEPS = 3000  # a workload takes about 100 steps; more means the engine stopped making progress

# "tight": as many blocks as the workload's longest sequence needs (at most ceil((60 + 24) / 4) = 21 blocks
# of 4 tokens), so that a few sequences at once exhaust it
TIGHT = "tight"
TINY_POOL = dict(block_size=4, num_kv_blocks=TIGHT)
CONFIGS = {
    "prefix_cache_bs4": dict(block_size=4, num_kv_blocks=512),
    "prefix_cache_bs4_async": dict(block_size=4, num_kv_blocks=512, async_scheduling=True),
    "tiny_pool_preempt": dict(**TINY_POOL),
    "tiny_pool_preempt_no_prefix_cache": dict(**TINY_POOL, enable_prefix_caching=False),
    "tiny_pool_preempt_async": dict(**TINY_POOL, async_scheduling=True),
    "chunked_prefill_16": dict(block_size=4, num_kv_blocks=512, max_num_batched_tokens=16),
    "chunked_prefill_16_async": dict(block_size=4, num_kv_blocks=512, max_num_batched_tokens=16,
                                     async_scheduling=True),
    "max_num_seqs_2": dict(block_size=8, num_kv_blocks=256, max_num_seqs=2),
    "everything_tight": dict(**TINY_POOL, max_num_batched_tokens=16, max_num_seqs=3, async_scheduling=True),
    "priority_tiny_pool": dict(**TINY_POOL, max_num_batched_tokens=16, scheduling_policy="priority"),
    "tiny_pool_bs2_chunked_async": dict(block_size=2, num_kv_blocks=TIGHT, max_num_batched_tokens=6,
                                        max_num_seqs=4, async_scheduling=True),
    "ngram_speculative": dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32,
                              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3}),
    "ngram_speculative_tiny_pool": dict(block_size=4, num_kv_blocks=TIGHT, max_num_batched_tokens=8,
                                        speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                            "prompt_lookup_max": 2}),
}
PREEMPTING = {name for name, kwargs in CONFIGS.items() if kwargs.get("num_kv_blocks") == TIGHT}


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    n: int
    add_step: int  # the first step before which it is added
    after: str | None  # ... and not before this request has ended (finished or aborted)
    abort_delay: int | None  # aborted this many steps after it was added (None: runs to the end)
    priority: int = 0


# -- the solo reference --------------------------------------------------------------------------------------


class Solo:
    """Greedy ``MAX_NEW``-token continuations of prompts, each run alone in a roomy engine, computed once."""

    def __init__(self, model_dir):
        self.engine = LLMEngine(str(model_dir), device="cpu", block_size=16, num_kv_blocks=64,
                                enable_prefix_caching=False, async_scheduling=False)
        self.vocab = self.engine.vocab_size
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._cache:
            engine = self.engine
            params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
            engine.add_request(engine.build_request(list(prompt), params, "solo"))
            done = []
            while engine.has_unfinished_requests():
                done += [out for out in engine.step() if out.finished]
            (out,) = done
            ids = list(out.outputs[0].token_ids)
            assert len(ids) == MAX_NEW and engine.blocks.num_available == engine.pool.num_blocks
            self._cache[key] = ids
        return self._cache[key]


@pytest.fixture(scope="module")
def solo(llama_dir):
    return Solo(llama_dir)


# -- workloads -----------------------------------------------------------------------------------------------


def make_workload(seed: int, solo: Solo) -> list[Req]:
    """10-16 requests from ``random.Random(seed)``: fresh prompts, prompts sharing long prefixes
    (block-aligned stems of 8/16/24/32 tokens, alone or with a tail), repeats of earlier prompts, truncations
    of them, and prompts continuing an earlier request's whole output (added once that request ends: its last,
    partly filled block is in the prefix cache then), some of them forks with different last tokens;
    staggered arrivals; a few aborts; n = 2 or 3 for one or two requests."""
    rng = random.Random(seed)
    vocab = solo.vocab

    def tokens(k: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(k)]

    stems = [tokens(rng.choice((8, 16, 24, 32))), tokens(rng.randint(5, 40))]
    count = rng.randint(10, 16)
    multi = set(rng.sample(range(count), rng.randint(1, 2)))
    aborted = set(rng.sample(range(count), rng.randint(2, 3)))
    reqs: list[Req] = []
    turns: list[tuple[str, list[int]]] = []  # (request, its prompt and output)
    for i in range(count):
        max_tokens, after = rng.randint(1, MAX_NEW), None
        kinds = ("fresh", "stem", "stem", "repeat", "truncate", "continue", "continue", "fork")
        # the first two: the block-aligned stem alone, twice (identical prompts, admitted in the same step)
        kind = rng.choice(kinds) if i > 1 else ("aligned", "repeat")[i]
        # a chat's next turn: an earlier request's prompt and whole output, then none, one or two more tokens
        bases = [r for r in reqs if len(r.prompt) + r.max_tokens + 2 <= MAX_PROMPT]
        if kind == "fork" and not turns:
            kind = "continue"
        if kind == "continue" and not bases:
            kind = "fresh"
        if kind == "aligned":
            prompt = list(stems[0])
        elif kind == "fresh":
            prompt = tokens(rng.randint(1, MAX_PROMPT))
        elif kind == "stem":
            stem = rng.choice(stems)
            tail = 0 if rng.random() < 0.3 else rng.randint(1, MAX_PROMPT - len(stem))
            prompt = stem + tokens(tail)
        elif kind == "repeat":
            prompt = list(rng.choice(reqs).prompt if i > 1 else reqs[0].prompt)
        elif kind == "truncate":
            base = rng.choice(reqs).prompt
            prompt = base[: rng.randint(1, len(base))]
        elif kind == "continue":
            base = rng.choice(bases)
            turn = base.prompt + solo(base.prompt)[: base.max_tokens]
            turns.append((base.rid, turn))
            prompt, after = turn + tokens(rng.choice((0, 0, 1, 2))), base.rid
        else:  # another next turn of the same request, added with the first: they start from its partly
            after, turn = rng.choice(turns)  # filled block (a copy each), then write different tokens
            prompt = turn + tokens(1)
        assert 1 <= len(prompt) <= MAX_PROMPT
        reqs.append(Req(
            rid=f"r{i}", prompt=prompt, max_tokens=max_tokens, n=rng.choice((2, 3)) if i in multi else 1,
            add_step=0 if i < 4 else rng.randint(0, 25), after=after,
            abort_delay=rng.randint(0, 15) if i in aborted else None, priority=rng.randint(0, 2)))
    return reqs


# -- checks --------------------------------------------------------------------------------------------------


def check_block_accounting(engine: LLMEngine) -> None:
    """Each block's ref-count is the number of sequence block tables holding it plus one if the prefix cache
    keeps it; only running sequences hold blocks; a cached block that no sequence holds is evictable (else it
    could never be reclaimed) and an evictable one is held by the cache alone."""
    bm, pool, sched = engine.blocks, engine.pool, engine.scheduler
    holders = Counter()
    for seq in sched.running:
        assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.request_id}: a block listed twice"
        assert seq.num_computed_tokens <= len(seq.block_table) * bm.block_size
        holders.update(seq.block_table)
    for seq in sched.waiting:
        assert seq.block_table == [], f"waiting {seq.request_id}/{seq.index} holds blocks {seq.block_table}"
    for request in engine.requests.values():
        for seq in request.seqs:
            if seq.finished:
                assert seq.block_table == [], f"finished {seq.request_id}/{seq.index} holds {seq.block_table}"
    cached = set(bm._hash_of)
    for block in range(pool.num_blocks):
        want = holders[block] + (block in cached)
        assert pool.ref_count(block) == want, (
            f"block {block}: ref-count {pool.ref_count(block)}, but {holders[block]} sequence(s) hold it"
            f"{' and the prefix cache keeps it' if block in cached else ''}")
    assert set(bm._evictable) == {b for b in cached if holders[b] == 0}
    assert pool.num_free == sum(1 for b in range(pool.num_blocks) if pool.ref_count(b) == 0)
    assert len(sched.running) <= sched.max_num_seqs


def assert_prefix(got: list[int], reference: list[int], what: str) -> None:
    assert PLACEHOLDER not in got, f"{what}: a placeholder in the output {got}"
    assert got == reference[: len(got)], f"{what}: {got} is not a prefix of the solo output {reference}"


def drive(engine: LLMEngine, reqs: list[Req], solo: Solo):
    """Run the workload step by step; returns ({rid: finished output}, {rid: abort output})."""
    ranked = engine.config.scheduling_policy == "priority"
    pending = sorted(reqs, key=lambda r: r.add_step)
    by_id = {r.rid: r for r in reqs}
    finished, aborted = {}, {}
    abort_at: dict[int, list[Req]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        assert step < MAX_STEPS, f"no progress after {MAX_STEPS} steps: {engine.stats()}"
        for r in [r for r in pending if r.add_step <= step and (r.after is None or r.after in finished
                                                                   or r.after in aborted)]:
            pending.remove(r)
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens, n=r.n, ignore_eos=True)
            priority = r.priority if ranked else 0
            engine.add_request(engine.build_request(r.prompt, params, r.rid, priority=priority))
            if r.abort_delay is not None:
                abort_at.setdefault(step + r.abort_delay, []).append(r)
        for r in abort_at.pop(step, ()):
            out = engine.abort_request(r.rid)
            if out is None:  # finished already: compared with the rest
                assert r.rid in finished
                continue
            assert out.finished and {c.finish_reason for c in out.outputs} <= {"abort", "length"}
            for c in out.outputs:
                assert_prefix(list(c.token_ids), solo(r.prompt)[: r.max_tokens], f"aborted {r.rid}/{c.index}")
            aborted[r.rid] = out
        for out in engine.step():
            r = by_id[out.request_id]
            assert out.request_id not in finished and out.request_id not in aborted, f"{out.request_id} again"
            want = solo(r.prompt)[: r.max_tokens]
            for c in out.outputs:
                assert_prefix(list(c.token_ids), want, f"streamed {r.rid}/{c.index}")
            if out.finished:
                finished[out.request_id] = out
        check_block_accounting(engine)
        step += 1
    return finished, aborted


def engine_args(kwargs: dict, reqs: list[Req]) -> dict:
    """``kwargs`` with a ``"tight"`` pool sized for ``reqs``, and synchronous scheduling unless asked for."""
    args = {"async_scheduling": False, **kwargs}
    if args.get("num_kv_blocks") == TIGHT:
        bs = args["block_size"]
        args["num_kv_blocks"] = max(-(-(len(r.prompt) + r.max_tokens) // bs) for r in reqs)
    return args


def count_partial_block_hits(engine: LLMEngine) -> list[int]:
    """A one-item list counting the admissions that reuse (a copy of) a cached partly filled block."""
    count = [0]
    admit = engine.blocks.admit

    def counting(seq, hits):
        count[0] += seq.partial_hit is not None
        return admit(seq, hits)

    engine.blocks.admit = counting
    return count


def _cases():
    for name in CONFIGS:
        for seed in SEEDS:
            yield pytest.param(name, seed, id=f"{name}-seed{seed}")


@pytest.mark.parametrize(("config", "seed"), list(_cases()))
def test_interleaved_greedy_requests_match_their_solo_runs(llama_dir, solo, config, seed):
    kwargs = CONFIGS[config]
    reqs = make_workload(seed, solo)
    engine = LLMEngine(str(llama_dir), device="cpu", **engine_args(kwargs, reqs))
    partial_hits = count_partial_block_hits(engine)
    finished, aborted = drive(engine, reqs, solo)

    for r in reqs:
        want = solo(r.prompt)[: r.max_tokens]
        if r.rid in aborted:
            continue
        assert r.rid in finished, f"{r.rid} never finished"
        out = finished[r.rid]
        assert list(out.prompt_token_ids) == r.prompt
        assert [c.index for c in out.outputs] == list(range(r.n))
        for c in out.outputs:
            assert list(c.token_ids) == want, (
                f"{config} seed {seed}: {r.rid}/{c.index} (prompt of {len(r.prompt)} tokens, max_tokens "
                f"{r.max_tokens}, n {r.n}) gave {list(c.token_ids)}, alone {want}")
            assert c.finish_reason == "length"
    assert aborted, "the workload aborted nothing"  # (each seed aborts some request before it finishes)

    # every block comes back: free, or evictable in the prefix cache; and nothing else holds any
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    assert engine.blocks.num_available == engine.pool.num_blocks
    engine.blocks.reset_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.blocks._by_hash and not engine.blocks._hash_of

    if config in PREEMPTING:
        assert engine.scheduler.num_preemptions > 0, "the tiny pool was meant to force preemption"
    if kwargs.get("enable_prefix_caching", True):
        assert engine.blocks.hit_tokens > 0, "the shared prefixes were meant to hit the prefix cache"
        if config not in PREEMPTING:  # (a tight pool evicts them first)
            assert partial_hits[0] > 0, "next turns were meant to reuse a partly filled block"
    if kwargs.get("async_scheduling"):
        assert engine.num_steps_ahead > 0
    if "speculative_config" in kwargs:
        assert engine.num_draft_tokens > 0


def test_workloads_cover_what_they_are_meant_to(solo):
    """The generator produces the shapes the stress test relies on (so a change to it cannot quietly thin out
    the coverage): block-aligned shared prefixes, identical prompts, long prompts, n > 1 and aborts."""
    for seed in SEEDS:
        reqs = make_workload(seed, solo)
        prompts = [tuple(r.prompt) for r in reqs]
        assert 10 <= len(reqs) <= 16
        assert any(r.n > 1 for r in reqs) and any(r.abort_delay is not None for r in reqs)
        assert any(r.add_step > 0 for r in reqs) and any(r.after is not None for r in reqs)
        assert max(map(len, prompts)) > 16  # chunked at 16 tokens a step
    every = [r for seed in SEEDS for r in make_workload(seed, solo)]
    prompts = [tuple(r.prompt) for r in every]
    assert len(set(prompts)) < len(prompts)  # identical full prompts
    assert any(len(p) % 8 == 0 and prompts.count(p) > 1 for p in prompts)  # identical block-aligned prompts
    assert any(a != b and len(a) >= 8 and b[: len(a)] == a for a in prompts for b in prompts)  # shared prefix
