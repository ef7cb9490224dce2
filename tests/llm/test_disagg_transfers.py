"""Disaggregation under memory pressure and what the P/D controller measures: every prompt's blocks reach its decode
worker even when a worker's prompts outnumber its KV pool, a transfer lost anyway is counted and warned about, and
the decode cost counts only the decode engine's own work, every sample's tokens, and an unlimited request's
context."""

from __future__ import annotations

import collections
import time
import warnings

import torch

from ninefold import LLM, SamplingParams
from ninefold.comm.spawn import spawn
from ninefold.llm.disagg import export_prefix, send_prefix
from ninefold.llm.disagg.cluster import _decode

BLOCK = 4
POOL = 64  # blocks of 4 tokens per worker: 256 tokens, fewer than the pressure prompts' 500
FAILING_EXPORT_LEN = 45  # the prefill worker's export of a prompt this long is made to fail
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def _llm(model_dir, **kw):
    return LLM(str(model_dir), **{"dtype": "float32", "device": "cpu", "block_size": BLOCK, **kw})


def test_a_cluster_under_memory_pressure_moves_every_prompt_and_measures_decode_alone(llama_dir):
    pressure = _prompts([100] * 5)
    reference = [o.outputs[0].token_ids for o in _llm(llama_dir).generate(prompt_token_ids=pressure,
                                                                          sampling_params=GREEDY)]
    out = spawn(cluster_calls, 4, (str(llama_dir), pressure), timeout_s=300)[0]

    # 1. 500 prompt tokens through one prefill worker with room for 256, into decode workers with room for 256
    # each: every full block moves (before, a prompt's blocks were exported only after its whole group was
    # computed, by then evicted by the later prompts', and the decode worker computed all of them again silently).
    tokens, cached, errors, lost, caught = out["pressure"]
    assert cached == [(len(ids) - 1) // BLOCK * BLOCK for ids in pressure]
    assert tokens == reference
    assert errors == [] and lost == 0 and caught == []
    # A transfer lost anyway (here: its export made to fail) is counted, named and warned about.
    errors, lost, caught = out["lost"]
    assert lost == 1
    assert errors == ["rank 2: request 0: 44 of its 44 prompt tokens in full blocks computed again (0 arrived "
                      "from rank 1)",
                      "rank 1: export of request 0: RuntimeError: export made to fail"]
    assert len(caught) == 1 and "request 0: 44 of its 44 prompt tokens" in caught[0]

    # 2. The decode cost starts when the decode worker has something to do: no longer than from its first
    # prefix's arrival (the prefill worker is made slow to start) to its reply.
    for cost in out["costs"]:
        assert cost["seconds"] <= cost["since_first_arrival"]

    # 3. Every sample's tokens are counted (only the first sample's were).
    assert out["samples"] == (15, 15)

    # 4. With equal measured rates, 40 prompt tokens and 2 requests without max_tokens (236 tokens each, up to the
    # workers' 256-token context) want one prefill and two decode workers (each counted as 1 token, they
    # wanted two prefill workers).
    limit, plan, generated = out["unlimited"]
    assert limit == POOL * BLOCK
    assert (plan.prefill, plan.decode) == ([1], [2, 3])
    assert generated == 2 * 236


def cluster_calls(model_dir: str, pressure: list[list[int]]) -> dict | None:
    """Every rank: join a cluster of small KV pools. Rank 0 makes the calls the test checks; on the workers, the
    prefill starts late, exports of 45-token prompts fail, and each decode reply tells how long it took from its
    first prefix's arrival."""
    import ninefold.llm.disagg.cluster as cluster
    from ninefold.comm import init

    torch.set_num_threads(1)
    _make_workers_observable(cluster)
    comm = init(device="cpu")
    try:
        router = cluster.start(comm, model_dir, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=POOL)
        if router is None:
            return None
        with router:
            return {"pressure": _pressure_call(router, pressure), "lost": _lost_transfer_call(router),
                    "costs": list(router.last_decode_costs), "samples": _samples_call(router),
                    "unlimited": _unlimited_call(router)}
    finally:
        comm.close()


def _make_workers_observable(cluster) -> None:
    """Wrap the worker functions of ``cluster`` as ``cluster_calls`` describes."""
    real_prefill, real_decode, real_export, real_recv = (cluster._prefill, cluster._decode, cluster.export_prefix,
                                                         cluster.recv_prefix)
    first_arrival: list[float] = []

    def slow_prefill(comm, llm, jobs):
        time.sleep(0.2)
        return real_prefill(comm, llm, jobs)

    def failing_export(engine, token_ids):
        if len(token_ids) == (FAILING_EXPORT_LEN - 1) // BLOCK * BLOCK:
            raise RuntimeError("export made to fail")
        return real_export(engine, token_ids)

    def timed_recv(comm, src, **kw):
        prefix = real_recv(comm, src, **kw)
        if not first_arrival:
            first_arrival.append(time.perf_counter())
        return prefix

    def timed_decode(comm, llm, jobs):
        first_arrival.clear()
        reply = real_decode(comm, llm, jobs)
        if "cost" in reply:
            # (a decode worker without requests receives nothing, and has nothing to do)
            reply["cost"]["since_first_arrival"] = time.perf_counter() - first_arrival[0] if first_arrival else 0.0
        return reply

    cluster._prefill, cluster._decode, cluster.export_prefix, cluster.recv_prefix = (
        slow_prefill, timed_decode, failing_export, timed_recv)


def _recorded(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught]


def _pressure_call(router, prompts):
    before = router.num_lost_transfers
    results, caught = _recorded(lambda: router.generate(prompts, GREEDY, num_prefill=1))
    return ([r.token_ids for r in results], [r.cached_tokens for r in results], list(router.last_errors),
            router.num_lost_transfers - before, caught)


def _lost_transfer_call(router):
    before = router.num_lost_transfers
    _, caught = _recorded(lambda: router.generate(_prompts([FAILING_EXPORT_LEN, 9], seed=1), GREEDY,
                                                  num_prefill=1))
    return list(router.last_errors), router.num_lost_transfers - before, caught


def _samples_call(router):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, n=3)
    result = router.generate(_prompts([21], seed=2), params, num_prefill=1)[0]
    return sum(len(o.token_ids) for o in result.outputs), router.last_decode_costs[0]["tokens"]


def _unlimited_call(router):
    router.prefill_s_per_token = router.decode_s_per_token = 1e-3
    results = router.generate(_prompts([20] * 2, seed=4), SamplingParams(temperature=0, max_tokens=None,
                                                                         ignore_eos=True))
    return router.max_model_len, router.last_plan, sum(len(r.token_ids) for r in results)


class _Arrived:
    """A communicator whose messages have all arrived already: what ``send`` was given, in order, by tag."""

    rank = 1
    device = torch.device("cpu")

    def __init__(self):
        self.messages = collections.defaultdict(collections.deque)

    def send(self, tensor, dst, *, tag=0):
        self.messages[tag].append(tensor.clone())

    def recv(self, tensor, src, *, tag=0):
        return tensor.copy_(self.messages[tag].popleft())


def test_a_decode_worker_keeps_prefixes_that_arrive_faster_than_its_pool_takes_them(llama_dir):
    """Five 100-token prefixes, all arrived at once, into a pool of 64 blocks: each is imported when its request
    fits and held until it is admitted (they were all imported before the first step, evicting one another)."""
    prompts = _prompts([100] * 5, seed=5)
    reference = [o.outputs[0].token_ids for o in _llm(llama_dir).generate(prompt_token_ids=prompts,
                                                                          sampling_params=GREEDY)]
    prefill = _llm(llama_dir)
    prefill.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1))
    comm = _Arrived()
    for i, ids in enumerate(prompts):
        send_prefix(comm, export_prefix(prefill.engine, ids[:96]), 1, tag=i)
    decode = _llm(llama_dir, num_kv_blocks=POOL)
    reply = _decode(comm, decode, [(i, ids, GREEDY, 0) for i, ids in enumerate(prompts)])
    assert [r.cached_tokens for r in reply["results"]] == [96] * 5
    assert [r.token_ids for r in reply["results"]] == reference
    assert reply["errors"] == [] and reply["lost"] == 0
    assert decode.engine.blocks.num_available == POOL  # nothing is left held
