"""Overlapped ("async") scheduling against the synchronous engine on its edge paths, where a step is
launched before the previous step's tokens are read: aborts while a step is in flight,
preemption in tiny KV pools, stops reached while the next step is already launched, n > 1, and
prefix-cache commits of blocks whose last token was a placeholder when they were scheduled.

Every test drives ``LLMEngine.step`` directly and checks the engine's bookkeeping after each step
(``_check_invariants``), then compares the outputs with ``async_scheduling=False``.
"""

from collections import Counter

import pytest
import torch

from ninefold import SamplingParams
from ninefold.llm.engine import LLMEngine
from ninefold.llm.kv_cache import block_digest
from ninefold.llm.sequence import PLACEHOLDER, Status

from .test_parity import prompts_for


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def device(request):
    """Each test on the CPU and, where there is one, on a CUDA device (CUDA graphs, a real overlap)."""
    return request.param


def _engines(path, device, **kwargs):
    """The same engine settings without and with overlapped scheduling."""
    return (LLMEngine(str(path), device=device, async_scheduling=False, **kwargs),
            LLMEngine(str(path), device=device, async_scheduling=True, **kwargs))


def _check_invariants(engine):
    """Placeholders never reach the prefix cache; every block's reference count is its holders."""
    blocks = engine.blocks
    for h, (block, tokens) in blocks._by_hash.items():
        assert PLACEHOLDER not in tokens, f"block {block} was registered with a placeholder: {tokens}"
        assert blocks._hash_of[block] == h
    holders = Counter()
    for request in engine.requests.values():
        for seq in request.seqs:
            if seq.finished:
                assert not seq.block_table
            holders.update(seq.block_table)
    for block in range(engine.pool.num_blocks):
        assert engine.pool.ref_count(block) == holders[block] + (block in blocks._hash_of), block
    assert all(s.status is Status.RUNNING for s in engine.scheduler.running)
    assert all(s.status is Status.WAITING for s in engine.scheduler.waiting)


def _assert_no_leak(engine):
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_available == engine.pool.num_blocks


def _summary(out):
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in out.outputs]


def _drive(engine, requests, *, before_step=None):
    """Add ``requests`` ({id: (prompt, params)}) and step until done; {id: final output summary}.

    ``before_step(engine, index)`` runs before each step (it may abort; an abort's output is kept).
    Streamed outputs are checked to hold no placeholder and to only grow.
    """
    for rid, (prompt, params) in requests.items():
        engine.add_request(engine.build_request(prompt, params, rid))
    done, seen = {}, {}
    for index in range(2000):
        if not engine.has_unfinished_requests():
            break
        if before_step is not None:
            for out in before_step(engine, index) or []:
                done[out.request_id] = _summary(out)
        for out in engine.step():
            ids = [c.token_ids for c in out.outputs]
            assert all(PLACEHOLDER not in i for i in ids)
            for old, new in zip(seen.get(out.request_id, []), ids):
                assert new[: len(old)] == old
            seen[out.request_id] = ids
            if out.finished:
                done[out.request_id] = _summary(out)
        _check_invariants(engine)
    _assert_no_leak(engine)
    return done


def _reference_kv(path, tokens, device):
    """Per layer (keys, values) ``[len(tokens), Hk, Dh]`` of ``tokens`` prefilled on a fresh engine."""
    engine = LLMEngine(str(path), device=device, async_scheduling=False, block_size=4, num_kv_blocks=32,
                       enable_prefix_caching=False)
    engine.add_request(engine.build_request(list(tokens) + [2], SamplingParams(temperature=0, max_tokens=1), "ref"))
    step = engine.scheduler.schedule()
    engine.runner.forward_logits(step)
    return _cached_kv(engine, step[0].seq.block_table, len(tokens))


def _cached_kv(engine, block_table, num_tokens):
    bs = engine.blocks.block_size
    slots = [block_table[p // bs] * bs + p % bs for p in range(num_tokens)]
    out = []
    for layer in range(engine.model_config.num_layers):
        k, v = engine.pool.k_cache(layer), engine.pool.v_cache(layer)
        out.append((k.reshape(-1, *k.shape[2:])[slots].clone(), v.reshape(-1, *v.shape[2:])[slots].clone()))
    return out


# -- (a) abort while a step is in flight, (d) n > 1 ------------------------------------------------


def test_abort_of_an_n2_request_in_flight_then_resubmitted_from_the_prefix_cache(llama_dir, device):
    kwargs = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    sync, overlapped = _engines(llama_dir, device, **kwargs)
    base = prompts_for(sync.model_config.vocab_size, (12,), seed=3)[0]
    requests = {
        "keep": (base + [7], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)),
        "cut": (base + [8, 9], SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=14, ignore_eos=True)),
        "also": (base[:5] + [10, 11, 12], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
    }
    want = _drive(sync, requests)
    state = {}

    def abort_mid_flight(engine, index):
        in_flight = engine._in_flight
        if state or in_flight is None:
            return None
        cut = [s for s in in_flight.samplers if s.request_id == "cut"]
        if len(cut) == 2 and all(len(s.output_ids) >= 3 for s in cut):
            state["index"] = index
            return [engine.abort_request("cut")]
        return None

    got = _drive(overlapped, requests, before_step=abort_mid_flight)
    assert "index" in state  # the abort landed while the request's next tokens were in flight
    assert got["keep"] == want["keep"] and got["also"] == want["also"]
    for (ids, reason, _, _), (full, _, _, _) in zip(got["cut"], want["cut"]):
        assert reason == "abort" and 3 <= len(ids) < 14 and ids == full[: len(ids)]
    # the same prompt again: served partly from the cache the overlapped run filled, same tokens
    hits_before = overlapped.blocks.hit_tokens
    again = _drive(overlapped, {"cut": requests["cut"]})
    assert again["cut"] == want["cut"]
    assert overlapped.blocks.hit_tokens - hits_before >= 2 * 12  # both sequences reuse the 3 base blocks


# -- (b) preemption in a tiny pool, (d) n > 1 ------------------------------------------------------


def test_preempting_sequences_that_hold_a_placeholder_matches_the_synchronous_engine(llama_dir, device):
    # 14 blocks of 2 tokens for 6 sequences: the latest-arrived one is preempted over and over,
    # often while its next token is still a placeholder of the step in flight.
    kwargs = dict(block_size=2, num_kv_blocks=14, max_num_batched_tokens=9)
    sync, overlapped = _engines(llama_dir, device, **kwargs)
    prompts = prompts_for(sync.model_config.vocab_size, (5, 13, 3, 9), seed=11)
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=9, n=2, max_tokens=9, ignore_eos=True)]
    requests = {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}
    victims = []
    preempt = overlapped.scheduler._preempt

    def recording_preempt(seq):
        victims.append(seq.pending_row >= 0)
        preempt(seq)

    overlapped.scheduler._preempt = recording_preempt
    want = _drive(sync, requests)
    got = _drive(overlapped, requests)
    assert got == want
    assert sum(victims) >= 3  # preempted while holding a placeholder: the case under test
    assert [len(c[0]) for c in got["r1"]] == [12, 12]


@pytest.mark.parametrize("abort_between", [False, True], ids=["retry", "abort-then-retry"])
def test_retry_after_a_failed_launch_that_preempted_a_sequence_with_a_pending_token(llama_dir, abort_between, device):
    # Three sequences fill a 9-block pool; the last one then needs a fifth block for its pending
    # token, preempts itself, and the launch of that step fails (a transient error). On the retry,
    # its own freed blocks would let the scheduler readmit it at once, without the token in flight:
    # the victim keeps its placeholder and waits until that token is read.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = {"a": ([5, 6, 7], params), "r": ([8, 9, 10, 11, 12], params), "x": ([13, 14, 15, 16, 17, 18], params)}
    clean = LLMEngine(str(llama_dir), device=device, block_size=4, num_kv_blocks=64, async_scheduling=False)
    for rid, (prompt, sp) in requests.items():
        clean.add_request(clean.build_request(prompt, sp, rid))
    want = {}
    while clean.has_unfinished_requests():
        want.update({o.request_id: o.outputs[0].token_ids for o in clean.step() if o.finished})
    results = {}
    for overlap in (False, True):
        engine = LLMEngine(str(llama_dir), device=device, block_size=4, num_kv_blocks=9,
                           enable_prefix_caching=False, async_scheduling=overlap)
        scheduler, launch = engine.scheduler, engine.runner.launch
        failures = []

        def flaky(step, previous=None, engine=engine, scheduler=scheduler, launch=launch, failures=failures):
            if not failures and scheduler.waiting and scheduler.num_preemptions:
                failures.append([s.pending_row >= 0 for s in scheduler.waiting])
                raise RuntimeError("a transient failure at launch")
            return launch(step, previous)

        engine.runner.launch = flaky
        for rid, (prompt, sp) in requests.items():
            engine.add_request(engine.build_request(prompt, sp, rid))
        done = {}
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            try:
                done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            except RuntimeError as error:
                if "transient" not in str(error):
                    raise
                if abort_between:  # frees blocks before the retry: the victim could fit as a two-token chunk
                    engine.abort_request("a")
        if len(failures) != 1 or (overlap and failures[0] != [True]):  # not the scenario: an error, not an xfail
            raise RuntimeError(f"the launch failure did not follow a preemption as planned: {failures}")
        results[overlap] = done
    if abort_between:
        want = {rid: ids for rid, ids in want.items() if rid != "a"}
        results = {overlap: {rid: ids for rid, ids in done.items() if rid != "a"} for overlap, done in results.items()}
    if results[False] != want:  # the synchronous engine retries fine (the reference, not the subject)
        raise RuntimeError(f"synchronous retry: {results[False]} != {want}")
    assert results[True] == want


# -- (c) stops reached while the next step is already launched ------------------------------------


def test_stops_found_while_the_next_step_is_in_flight_stream_like_the_synchronous_engine(llama_dir, device):
    kwargs = dict(block_size=4, num_kv_blocks=48, max_num_batched_tokens=24)
    sync, overlapped = _engines(llama_dir, device, **kwargs)
    vocab, eos = sync.model_config.vocab_size, sync.eos_token_ids[0]
    prompts = prompts_for(vocab, (6, 11, 4, 9, 7), seed=21)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = _drive(sync, {"p": (prompts[0], free)})["p"][0][0]
    # a token whose first occurrence is well inside the output
    stop_at = next(j for j in range(3, 20) if first[j] not in first[:j])
    text = _drive(sync, {"s": ("The quick brown fox", free)})["s"][0][3]
    requests = {
        "token": (prompts[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first[stop_at]],
                                             ignore_eos=True)),
        "string": ("The quick brown fox", SamplingParams(temperature=0, max_tokens=20, stop=[text[6:8]],
                                                         ignore_eos=True)),
        "eos": (prompts[1], SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100.0})),
        "one": (prompts[2], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
        # a fifth of the vocabulary stops: 40 sampled tokens without one are ~1e-4 likely, whatever the device's RNG
        "pair": (prompts[3], SamplingParams(temperature=0.9, seed=2, n=2, max_tokens=40, ignore_eos=True,
                                            stop_token_ids=list(range(2, vocab, 5)))),
        "long": (prompts[4], SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)),
    }
    sampled = Counter()
    launch = overlapped.runner.launch

    def counting_launch(step, previous=None):
        sampled.update(s.seq.seq_id for s in step if s.samples)
        return launch(step, previous)

    overlapped.runner.launch = counting_launch
    want = _drive(sync, requests)
    got = _drive(overlapped, requests)
    assert got == want
    assert got["token"][0][1:3] == ("stop", first[stop_at]) and len(got["token"][0][0]) == stop_at + 1
    assert got["string"][0][1:3] == ("stop", text[6:8])
    assert got["eos"][0][1] == "stop" and got["eos"][0][0][-1] == eos and len(got["eos"][0][0]) == 6
    assert got["one"][0][1] == "length" and len(got["one"][0][0]) == 1
    assert {c[1] for c in got["pair"]} == {"stop"}
    # each stop was found with the sequence's next step already launched: one wasted row each, no
    # more; a length stop is seen coming and wastes nothing
    wasted = sum(sampled.values()) - sum(len(c[0]) for out in got.values() for c in out)
    assert wasted == sum(c[1] == "stop" for out in got.values() for c in out)


# -- (e) prefix-cache commits of blocks whose last token was a placeholder -------------------------


def test_blocks_committed_over_a_placeholder_hold_the_right_tokens_and_kv(llama_dir, device):
    # Block size 4: a sequence whose stop token completes a block has that block committed (tokens
    # and keys/values) by the wasted step that was launched with the token still a placeholder.
    bs = 4
    sync, overlapped = _engines(llama_dir, device, block_size=bs, num_kv_blocks=64, max_num_batched_tokens=32)
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = prompts_for(sync.model_config.vocab_size, (5, 6, 7, 9), seed=5)
    requests = {}
    for i, prompt in enumerate(prompts):
        ids = _drive(sync, {"g": (prompt, free)})["g"][0][0]
        stops = [j for j in range(1, 16) if (len(prompt) + j + 1) % bs == 0 and ids[j] not in ids[:j]]
        if stops:
            requests[f"r{i}"] = (prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                         stop_token_ids=[ids[stops[0]]]))
    assert len(requests) >= 2
    want = _drive(sync, requests)
    got = _drive(overlapped, requests)
    assert got == want
    assert all(out[0][1] == "stop" for out in got.values())
    # every registered block holds the keys/values of its chained prefix
    prefixes = {}
    for rid, (prompt, _) in requests.items():
        tokens = prompt + got[rid][0][0]
        assert len(tokens) % bs == 0  # the stop token ends a block
        parent = None
        for b in range(len(tokens) // bs):
            parent = block_digest(parent, tuple(tokens[b * bs : (b + 1) * bs]))
            prefixes[parent] = tokens[: (b + 1) * bs]
    last_blocks = {hash_ for hash_, tokens in prefixes.items() if any(
        tokens == prompt + got[rid][0][0] for rid, (prompt, _) in requests.items())}
    registered = overlapped.blocks._by_hash
    assert last_blocks <= set(registered)  # the blocks ending in the stop token were committed
    for hash_, (block, tokens) in registered.items():
        full = prefixes[hash_]
        assert tuple(full[-bs:]) == tokens
        ref = _reference_kv(llama_dir, full, device)
        for (k, v), (rk, rv) in zip(_cached_kv(overlapped, [block], bs), ref):
            # decode and prefill kernels round differently: a bfloat16 cache (CUDA's "auto" dtype) differs by an ulp
            tol = dict(atol=1e-5, rtol=1e-4) if k.dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(k, rk[-bs:], **tol)
            torch.testing.assert_close(v, rv[-bs:], **tol)
    # and a continuation over them matches an engine without the cache
    follow = {rid: (prompt + got[rid][0][0] + [3, 4], free) for rid, (prompt, _) in requests.items()}
    hits_before = overlapped.blocks.hit_tokens
    assert _drive(overlapped, follow) == _drive(sync, follow)
    assert overlapped.blocks.hit_tokens - hits_before >= sum(len(p) - 2 for p, _ in follow.values())
