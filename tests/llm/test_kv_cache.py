"""BlockManager (prefix caching, LRU eviction) and Scheduler (budget, chunking, FCFS, preemption)."""

import pytest
import torch

from ninefold.llm.kv_cache import BlockManager
from ninefold.llm.sampling import SamplingParams
from ninefold.llm.scheduler import Scheduler
from ninefold.llm.sequence import Sequence, Status
from ninefold.runtime import KVCachePool


def pool(num_blocks=8, block_size=4):
    return KVCachePool(1, 1, 4, block_size, torch.float32, "cpu", num_blocks)


def seq(tokens, rid="r"):
    return Sequence(rid, 0, list(tokens), len(tokens), SamplingParams())


def run_prefill(bm, s):
    hits = bm.match_prefix(s)
    assert bm.can_admit(s, hits, s.num_tokens - len(hits) * bm.block_size)
    bm.admit(s, hits)
    assert bm.ensure(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)
    return len(hits)


def test_prefix_blocks_are_shared_and_survive_their_owner():
    bm = BlockManager(pool())
    a = seq(range(10))
    assert run_prefill(bm, a) == 0
    b = seq([*range(8), 99, 98, 97])  # shares two full blocks
    assert run_prefill(bm, b) == 2
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.pool.ref_count(a.block_table[0]) == 3  # a, b and the cache
    bm.free(a)
    bm.free(b)
    assert bm.num_available == 8 and bm.pool.num_free == 6  # the two cached full blocks stay, evictable
    c = seq(range(9))
    assert run_prefill(bm, c) == 2 and bm.hit_rate > 0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(pool())
    a = seq(range(8))
    run_prefill(bm, a)
    bm.free(a)
    b = seq(range(8))
    assert run_prefill(bm, b) == 1  # 8 tokens = 2 full blocks, but the last block is recomputed


def test_lru_eviction_takes_tail_blocks_of_the_oldest_first():
    bm = BlockManager(pool(num_blocks=6))
    a, b = seq(range(12), "a"), seq(range(100, 112), "b")
    run_prefill(bm, a)
    bm.free(a)
    run_prefill(bm, b)
    bm.free(b)
    assert bm.pool.num_free == 0 and bm.num_available == 6
    c = seq(range(200, 205), "c")
    run_prefill(bm, c)  # needs 2 blocks: a's last two blocks go first
    assert len(bm.match_prefix(seq(range(13)))) == 1
    assert len(bm.match_prefix(seq(range(100, 113)))) == 3


def test_prefix_caching_off_registers_nothing():
    bm = BlockManager(pool(), enable_prefix_caching=False)
    a = seq(range(10))
    run_prefill(bm, a)
    bm.free(a)
    assert bm.pool.num_free == 8 and run_prefill(bm, seq(range(10))) == 0


def test_scheduler_budget_chunks_and_mixes_decode_with_prefill():
    sched = Scheduler(BlockManager(pool(num_blocks=32)), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(range(6), "a"), seq(range(50, 63), "b")
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.samples) for s in step] == [("a", 6, True), ("b", 4, False)]
    for s in step:
        s.seq.num_computed_tokens += s.num_new_tokens
    a.token_ids.append(7)  # a sampled a token: next step decodes it beside b's next chunk
    step = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in step] == [("a", 1), ("b", 9)]


def test_max_num_seqs_and_fcfs():
    sched = Scheduler(BlockManager(pool(num_blocks=32)), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq(range(i, i + 3), str(i)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    assert [s.seq.request_id for s in sched.schedule()] == ["0", "1"]
    sched.finish(seqs[0], "abort")
    assert [s.seq.request_id for s in sched.schedule()] == ["1", "2"]


def test_preemption_frees_the_latest_and_abort_frees_at_once():
    bm = BlockManager(pool(num_blocks=4), enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq(range(8), "a"), seq(range(20, 28), "b")
    sched.add(a)
    sched.add(b)
    for s in sched.schedule():
        s.seq.num_computed_tokens += s.num_new_tokens
    a.token_ids.append(1)
    b.token_ids.append(1)
    step = sched.schedule()  # a needs a third block: b (the later one) is preempted
    assert [s.seq.request_id for s in step] == ["a"] and sched.num_preemptions == 1
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and sched.waiting[0] is b
    sched.finish(a, "abort")
    assert bm.pool.num_free == 4 and a.block_table == []


def test_block_keys_are_digests_of_the_whole_prefix():
    from ninefold.llm.kv_cache import block_digest

    first = block_digest(None, (1, 2, 3, 4))
    assert isinstance(first, bytes) and len(first) == 16 and first == block_digest(None, (1, 2, 3, 4))
    assert block_digest(first, (5, 6, 7, 8)) != block_digest(block_digest(None, (1, 2, 3, 5)), (5, 6, 7, 8))
    assert block_digest(("lora", 1, 0), (1, 2, 3, 4)) not in (first, block_digest(("lora", 2, 0), (1, 2, 3, 4)))
    bm = BlockManager(pool())
    a = seq(range(10))
    run_prefill(bm, a)
    assert a.block_hashes == [first := block_digest(None, (0, 1, 2, 3)), block_digest(first, (4, 5, 6, 7))]


def test_cache_hits_count_prompt_tokens_at_the_first_admission_only(llama_dir):
    """b (5-token prompt, 12 new) is preempted when a needs its third block, then readmitted: its own output's
    full blocks are prefix hits then, but neither its num_cached_tokens nor the hit rate counts them."""
    from ninefold.llm.engine import LLMEngine

    engine = LLMEngine(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=5, async_scheduling=False)
    for rid, prompt, new in (("a", [5, 6, 7, 8], 8), ("b", [9, 10, 11, 12, 13], 12)):
        engine.add_request(engine.build_request(prompt, SamplingParams(temperature=0, max_tokens=new,
                                                                       ignore_eos=True), rid))
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    assert engine.scheduler.num_preemptions == 1 and len(done["b"].outputs[0].token_ids) == 12
    assert done["b"].num_cached_tokens == 0
    assert (engine.blocks.queried_tokens, engine.blocks.hit_tokens) == (9, 0)


def test_a_waiting_sequence_digests_its_prompt_once_and_sees_changed_tokens(monkeypatch):
    """A sequence waiting at the head of the queue is matched every step; its blocks' digests are remembered
    (the second match digests nothing), but a changed token or adapter root still changes the match."""
    import ninefold.llm.kv_cache as kv_cache

    bm = BlockManager(pool(num_blocks=8))
    run_prefill(bm, seq(range(12), "a"))
    calls = []
    real = kv_cache.block_digest
    monkeypatch.setattr(kv_cache, "block_digest", lambda *args: calls.append(args) or real(*args))
    b = seq([*range(12), 50], "b")
    assert len(bm.match_prefix(b)) == 3 and len(calls) == 3
    assert len(bm.match_prefix(b)) == 3 and len(calls) == 3  # remembered
    b.token_ids[5] = 99  # the second block differs now: its digest and the third's are recomputed
    assert len(bm.match_prefix(b)) == 1 and len(calls) == 4  # (the walk stops at the first miss)
    b.token_ids[5] = 5
    assert len(bm.match_prefix(b)) == 3 and len(calls) == 6
    b.lora = type("LoRARequest", (), {"lora_int_id": 1})()  # another root: nothing of the base model's cache
    assert bm.match_prefix(b) == [] and len(calls) == 7
    b.lora = None
    hits = bm.match_prefix(b)
    assert hits == bm.match_prefix(seq([*range(12), 50], "c"))
    bm.admit(b, hits)
    assert b.prefix_memo is None and b.block_hashes == [h for _, h in hits]


def test_admission_keeps_the_watermark_free_while_others_run():
    """8 blocks of 4 tokens, watermark 25% = 2 blocks. a (12 tokens, 3 blocks) runs; b needs 4 blocks, which
    would leave 1 free: it waits. Alone, b is admitted into the watermark (nothing else needs the headroom)."""
    p = KVCachePool(1, 1, 4, 4, torch.float32, "cpu", 8, watermark=0.25)
    sched = Scheduler(BlockManager(p, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq(range(12), "a"), seq(range(100, 116), "b")
    sched.add(a)
    assert [s.seq.request_id for s in sched.schedule()] == ["a"]
    a.num_computed_tokens = 12
    a.token_ids.append(1)
    sched.add(b)
    assert [s.seq.request_id for s in sched.schedule()] == ["a"] and sched.waiting[0] is b
    sched.finish(a, "stop")
    assert [s.seq.request_id for s in sched.schedule()] == ["b"] and p.num_free == 4


def _greedy(engine, prompt, rid, n=1, new=6):
    engine.add_request(engine.build_request(prompt, SamplingParams(temperature=0, max_tokens=new, n=n,
                                                                   ignore_eos=True), rid))


def _fail_next_launch(engine, monkeypatch):
    """The engine's next launch raises (as a CUDA out-of-memory error would); the one after runs."""
    launch = engine.runner.launch

    def fail_once(*args):
        monkeypatch.setattr(engine.runner, "launch", launch)
        raise RuntimeError("injected launch failure")

    monkeypatch.setattr(engine.runner, "launch", fail_once)


def _run(engine):
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return {rid: [list(c.token_ids) for c in out.outputs] for rid, out in done.items()}


def test_siblings_and_same_step_requests_reuse_the_prompt_blocks_being_computed(llama_dir):
    """n=3 and a second request with the same 12-token prompt, all admitted in one step: only the first sequence
    computes the two full prompt blocks; the other three read them in the same step (3 x 8 of the 48 prompt
    tokens are hits) and produce the tokens a lone request gets."""
    from ninefold.llm.engine import LLMEngine

    prompt = [5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 10]
    alone = LLMEngine(str(llama_dir), device="cpu", block_size=4, enable_prefix_caching=False)
    _greedy(alone, prompt, "x")
    expected = _run(alone)["x"][0]
    engine = LLMEngine(str(llama_dir), device="cpu", block_size=4, async_scheduling=False)
    _greedy(engine, prompt, "a", n=3)
    _greedy(engine, prompt, "b")
    engine.step()  # one step prefills all four
    assert [len(s.output_ids) for r in engine.requests.values() for s in r.seqs] == [1, 1, 1, 1]
    assert (engine.blocks.queried_tokens, engine.blocks.hit_tokens) == (48, 3 * 8)
    assert _run(engine) == {"a": [expected] * 3, "b": [expected]}


def test_a_step_that_fails_to_launch_takes_back_the_blocks_registered_for_it(llama_dir, monkeypatch):
    """a computes the shared blocks that b reuses in the same step; the launch fails and a is aborted. b then
    computes them itself (nothing of a's never-written blocks stays in the cache) and gets the right tokens."""
    from ninefold.llm.engine import LLMEngine

    prompt = [5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 10]
    alone = LLMEngine(str(llama_dir), device="cpu", block_size=4, enable_prefix_caching=False)
    _greedy(alone, prompt, "x")
    expected = _run(alone)["x"][0]
    engine = LLMEngine(str(llama_dir), device="cpu", block_size=4, async_scheduling=False)
    _greedy(engine, prompt, "a")
    _greedy(engine, [*prompt, 1], "b")
    _fail_next_launch(engine, monkeypatch)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    b = engine.requests["b"].seqs[0]
    assert b.num_computed_tokens == 0 and b.block_hashes == [] and engine.blocks._by_hash == {}
    engine.abort_request("a")
    _greedy(engine, prompt, "c")  # admitted after b: b's blocks are real now
    out = _run(engine)
    assert out["c"] == [expected] and len(out["b"][0]) == 6


def test_a_failed_launch_leaves_a_sequence_holding_its_own_copy_of_a_taken_back_block_as_it_was(llama_dir,
                                                                                                monkeypatch):
    """D (prompt logprobs: no prefix hits) computes its own copies of P's blocks while R1's copies are registered.
    R1's are evicted; A registers P's blocks again in a step that fails to launch. D, decoding with a token in
    flight (async scheduling), must not be rewound: it would recompute a chunk ending in that token's placeholder."""
    from ninefold.llm.engine import LLMEngine

    prompt, filler = [11, 12, 13, 14, 15, 16, 17, 18, 19], list(range(100, 140))

    def run(fail: bool) -> dict:
        engine = LLMEngine(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=16, async_scheduling=True)
        done = {}

        def step():
            done.update({o.request_id: o for o in engine.step() if o.finished})

        def add(rid, ids, new, **extra):
            engine.add_request(engine.build_request(ids, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True,
                                                                        **extra), rid))
        add("R1", prompt, 1)
        add("D", prompt, 12, prompt_logprobs=1)
        while "R1" not in done:
            step()
        add("F", filler, 2)  # its blocks push R1's out of the cache
        while "F" not in done:
            step()
        add("A", prompt, 3)
        if fail:
            _fail_next_launch(engine, monkeypatch)
            with pytest.raises(RuntimeError, match="injected"):
                step()
        while engine.has_unfinished_requests():
            step()
        done.update({o.request_id: o for o in engine.sync() if o.finished})
        return {rid: list(out.outputs[0].token_ids) for rid, out in done.items()}

    assert run(fail=True) == run(fail=False)
