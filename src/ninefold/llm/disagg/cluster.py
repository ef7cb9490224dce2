"""Prefill and decode on different ranks of one job: a router on rank 0, engines on every other rank.

Every rank of a ``ninefold.comm`` job calls :func:`start`. The workers load the model and wait for
plans; rank 0 gets a :class:`Router`. For each :meth:`Router.generate` call the router splits the
workers into prefill and decode workers (``num_prefill``, or the split that balances the measured
prefill and decode costs of earlier calls, so the P/D ratio follows the load), hands each request
to one of each, and collects the results. A prefill worker computes its prompts (one token each) and
sends each prompt's KV blocks to the decode worker chosen for it as soon as that prompt is done, before
later prompts can evict them from its prefix cache. A decode worker imports a prefix into its prefix
cache when the request can be admitted beside the running ones, holds those blocks until it is (so that
it computes only the last partial block), and keeps stepping while other prefixes arrive. A request
whose decode worker computed its prompt blocks again anyway is a lost transfer: counted
(``Router.num_lost_transfers``), named in ``Router.last_errors`` and warned about.

Transfers go in ascending request order on every worker, so the smallest pending transfer always
has its sender and its receiver ready: no cycle of waiting workers can form.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
import warnings

import torch

from ninefold.llm.disagg.kv_transfer import (
    PrefixKV,
    export_prefix,
    import_prefix,
    recv_prefix,
    send_prefix,
)
from ninefold.llm.sampling import SamplingParams

_ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


@dataclasses.dataclass
class Plan:
    """How one :meth:`Router.generate` call was split: the ranks of each role and why."""

    prefill: list[int]
    decode: list[int]
    reason: str


@dataclasses.dataclass
class Result:
    """One request's result: the generated token ids and text, why it stopped, and the ranks that served it.

    ``token_ids``, ``text`` and ``finish_reason`` are the first sample's; ``outputs`` holds every sample
    (``SamplingParams.n`` of them) as ``CompletionOutput``."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prefill_rank: int
    decode_rank: int
    cached_tokens: int
    outputs: list = dataclasses.field(default_factory=list)


def start(comm, model, **llm_args) -> Router | None:
    """Every rank of ``comm`` calls this. Rank 0 gets the :class:`Router`; every other rank loads ``model``
    (``LLM(model, **llm_args)``), serves plans until :meth:`Router.shutdown`, and then returns None.

    Workers that share a GPU load one after another, each allowed up to its share of
    ``kv_cache_memory_fraction`` (default 0.9) of the GPU, so that the first does not take every worker's
    KV-cache memory; with ``gpu_memory_utilization`` (a per-engine share already) each takes what it says.
    A worker that cannot load makes the router raise, naming it and why."""
    if llm_args.get("tensor_parallel_size", 1) != 1:
        raise ValueError(f"tensor_parallel_size: got {llm_args['tensor_parallel_size']!r}; a disaggregated worker is "
                         "one rank of the job's communicator, and its KV blocks travel whole (use 1)")
    if llm_args.get("enable_prefix_caching", True) is not True:
        raise ValueError("enable_prefix_caching: the KV blocks travel into the decode worker's prefix cache, "
                         f"so it must be True; got {llm_args['enable_prefix_caching']!r}")
    if comm.world_size < 3:
        raise ValueError(f"comm: disaggregation needs a router and at least one prefill and one decode worker, "
                         f"so 3 or more ranks; got {comm.world_size}")
    stages, my_stage, share = _loading_order(comm.topology, comm.rank)
    llm_args = worker_llm_args(llm_args, share)
    llm, failure = None, None
    for stage in range(stages):
        if comm.rank != 0 and stage == my_stage:
            try:
                from ninefold.llm.api import LLM

                llm = LLM(model, **llm_args)
            except Exception as e:  # reported to the router below; the other ranks must not wait forever
                failure = f"{type(e).__name__}: {e}"
        comm.barrier()
    states = comm.all_gather_object((failure, llm.engine.max_model_len if llm is not None else None))
    broken = {r: why for r, (why, _) in enumerate(states) if why is not None}
    if broken:
        raise RuntimeError("disaggregation workers failed to load the model: "
                           + "; ".join(f"rank {r}: {why}" for r, why in broken.items()))
    if comm.rank == 0:
        return Router(comm, max_model_len=min(limit for _, limit in states[1:]))
    _serve(comm, llm)
    return None


def worker_llm_args(llm_args: dict, share: float | None) -> dict:
    """``llm_args`` for a worker allowed ``share`` of the device-wide KV memory fraction (None: alone on its GPU).
    A fixed ``num_kv_blocks`` or a per-engine ``gpu_memory_utilization`` is left as given."""
    if share is None or "num_kv_blocks" in llm_args or llm_args.get("gpu_memory_utilization") is not None:
        return llm_args
    return {**llm_args, "kv_cache_memory_fraction": (llm_args.get("kv_cache_memory_fraction") or 0.9) * share}


def _loading_order(topology, rank: int) -> tuple[int, int, float | None]:
    """(stages, this rank's stage, its share of the GPU's KV memory or None): workers sharing a GPU load in turn,
    the j-th of k allowed (j + 1) / k of the memory fraction, since each sees what the earlier ones took."""
    me = topology.ranks[rank]
    groups: dict[str, list[int]] = {}
    for info in topology.ranks[1:]:
        if info.gpu_uuid is not None:
            groups.setdefault(info.gpu_uuid, []).append(info.rank)
    stages = max((len(g) for g in groups.values()), default=1)
    group = groups.get(me.gpu_uuid) if me.rank != 0 and me.gpu_uuid is not None else None
    if not group:
        return stages, 0, None
    j = group.index(me.rank)
    return stages, j, (j + 1) / len(group)


class Router:
    """Splits requests over prefill and decode workers and gathers the results (rank 0 of the job).

    ``max_model_len``: the workers' (smallest) context limit, which bounds the tokens a request may generate.
    ``with router:`` stops the workers on leaving the block, as :meth:`shutdown` does."""

    def __init__(self, comm, max_model_len: int):
        self.comm = comm
        self.max_model_len = max_model_len
        self.workers = list(range(1, comm.world_size))
        self.prefill_s_per_token: float | None = None  # measured, per prefill worker
        self.decode_s_per_token: float | None = None  # measured, per decode worker
        self.last_plan: Plan | None = None
        self.last_errors: list[str] = []  # what went wrong in the last call without losing a request
        # per decode worker: seconds of its engine's own work, tokens generated (every sample's), engine steps, and
        # steps run while requests were still to be added (their blocks on their way or waiting for room)
        self.last_decode_costs: list[dict] = []
        # requests, over every call, whose decode worker computed again prompt blocks their prefill worker had computed
        self.num_lost_transfers = 0
        self._stopped = False

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompt_token_ids: list[list[int]], sampling_params: SamplingParams | list[SamplingParams],
                 *, num_prefill: int | None = None) -> list[Result]:
        """Generate for every prompt (token-id lists); results in prompt order."""
        if self._stopped:
            raise RuntimeError("generate: this router was shut down")
        prompts = _check_prompts(prompt_token_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        odd = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if odd is not None:
            raise TypeError(f"sampling_params: expected a SamplingParams or a list of them, got {type(odd).__name__}")
        scored = next((p.prompt_logprobs for p in params if p.prompt_logprobs is not None), None)
        if scored is not None:  # the decode worker would recompute the prompt the prefill worker sent it
            raise ValueError(f"sampling_params.prompt_logprobs: got {scored}; the disaggregated router does not "
                             "return prompt logprobs (use None, or an LLM on one worker)")
        new_tokens = [self.max_new_tokens(ids, p) for ids, p in zip(prompts, params)]
        plan = self.plan(sum(map(len, prompts)), sum(new_tokens), num_prefill)
        self.last_plan = plan
        by_load = {r: 0 for r in plan.prefill + plan.decode}
        jobs: dict[int, list] = {r: [] for r in by_load}
        for i, ids in sorted(enumerate(prompts), key=lambda item: -len(item[1])):  # longest first, least loaded
            p = min(plan.prefill, key=lambda r: by_load[r])
            d = min(plan.decode, key=lambda r: by_load[r])
            by_load[p] += len(ids)
            by_load[d] += new_tokens[i]
            jobs[p].append((i, ids, d))
            jobs[d].append((i, ids, params[i], p))
        for r in plan.prefill:
            self.comm.send_object({"op": "prefill", "jobs": sorted(jobs[r], key=lambda j: j[0])}, r)
        for r in plan.decode:
            self.comm.send_object({"op": "decode", "jobs": sorted(jobs[r], key=lambda j: j[0])}, r)
        # Every reply is read before any is judged: one left unread would be taken for the next call's.
        prefill_cost = [self.comm.recv_object(r) for r in plan.prefill]
        decode_replies = [self.comm.recv_object(r) for r in plan.decode]
        failed = [f"prefill worker {r} failed: {c['error']}" for r, c in zip(plan.prefill, prefill_cost) if "error" in c]
        failed += [f"decode worker {r} failed: {c['error']}" for r, c in zip(plan.decode, decode_replies) if "error" in c]
        if failed:  # a worker's call itself failed: its requests have no result
            raise RuntimeError("; ".join(failed))
        results: list[Result | None] = [None] * len(prompts)
        decode_cost, self.last_errors = [], []
        for r, reply in zip(plan.decode, decode_replies):
            decode_cost.append(reply["cost"])
            self.num_lost_transfers += reply["lost"]
            self.last_errors += [f"rank {r}: {e}" for e in reply["errors"]]
            for res in reply["results"]:
                results[res.index] = res
        for r, cost in zip(plan.prefill, prefill_cost):
            self.last_errors += [f"rank {r}: {e}" for e in cost.get("errors", [])]
        if self.last_errors:
            warnings.warn("some prompts were computed again by their decode worker: " + "; ".join(self.last_errors),
                          stacklevel=2)
        self.last_decode_costs = decode_cost
        self._learn(prefill_cost, decode_cost)
        return results

    def max_new_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The tokens a request may generate, all samples together: ``max_tokens`` each (without it, up to the
        context limit), within the context limit."""
        room = max(self.max_model_len - len(prompt_token_ids), 0)
        return params.n * (room if params.max_tokens is None else min(params.max_tokens, room))

    def plan(self, prompt_tokens: int, new_tokens: int, num_prefill: int | None = None) -> Plan:
        """The split of the workers for a call with ``prompt_tokens`` to prefill and ``new_tokens`` to decode."""
        n = len(self.workers)
        if num_prefill is not None:
            if isinstance(num_prefill, bool) or not isinstance(num_prefill, int) or not 1 <= num_prefill <= n - 1:
                raise ValueError(f"num_prefill: expected an int in 1..{n - 1} (one worker at least must decode), "
                                 f"got {num_prefill!r}")
            p, reason = num_prefill, "asked for"
        elif self.prefill_s_per_token is None or self.decode_s_per_token is None:
            p, reason = max(1, n // 2), "no measurements yet: half the workers prefill"
        else:
            a = prompt_tokens * self.prefill_s_per_token
            b = new_tokens * self.decode_s_per_token
            p = min(range(1, n), key=lambda k: a / k + b / (n - k))
            reason = (f"balances {a:.2f} s of prefill against {b:.2f} s of decode "
                      f"(measured {self.prefill_s_per_token * 1e3:.2f} / {self.decode_s_per_token * 1e3:.2f} ms per token)")
        return Plan(self.workers[:p], self.workers[p:], reason)

    def _learn(self, prefill_cost: list[dict], decode_cost: list[dict]) -> None:
        """Keep the per-worker cost of a prefill token and of a decoded token (the slowest worker's), smoothed."""
        def rate(costs):
            rates = [c["seconds"] / c["tokens"] for c in costs if c["tokens"]]
            return max(rates) if rates else None

        for name, value in (("prefill_s_per_token", rate(prefill_cost)), ("decode_s_per_token", rate(decode_cost))):
            if value is not None:
                old = getattr(self, name)
                setattr(self, name, value if old is None else 0.5 * old + 0.5 * value)

    def shutdown(self) -> None:
        """Stop every worker (their :func:`start` returns). Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        for r in self.workers:
            self.comm.send_object({"op": "stop"}, r)


def _serve(comm, llm) -> None:
    while True:
        try:
            msg = comm.recv_object(0)
        except Exception as e:
            raise RuntimeError(f"disaggregation worker {comm.rank}: the router (rank 0) went away without stopping "
                               "the workers; end its work with Router.shutdown() or a `with router:` block") from e
        if msg["op"] == "stop":
            return
        try:
            if msg["op"] == "prefill":
                reply = _prefill(comm, llm, msg["jobs"])
            else:
                reply = _decode(comm, llm, msg["jobs"])
        except Exception as e:  # the router reports it; the worker stays up for the next plan
            reply = {"error": f"{type(e).__name__}: {e}"}
        comm.send_object(reply, 0)


def _prefill(comm, llm, jobs: list) -> dict:
    """Compute each prompt (one token) and send its blocks as soon as it is done, while they are still in the
    prefix cache: prompts computed after it would evict them. Sends go in request order. A prompt that fails
    still sends an (empty) prefix, so that no decode worker waits forever: it then computes that prompt itself."""
    start = time.perf_counter()
    engine = llm.engine
    errors: list[str] = []
    prompts = {i: ids for i, ids, _ in jobs}
    exported: dict[int, PrefixKV] = {}
    unsent = collections.deque(jobs)

    def send_exported() -> None:
        while unsent and unsent[0][0] in exported:
            i, _, dst = unsent.popleft()
            send_prefix(comm, exported.pop(i), dst, tag=i)

    for i, ids, _ in jobs:
        try:
            engine.add_request(engine.build_request(ids, _ONE_TOKEN, request_id=_request_id(i)))
        except (ValueError, TypeError) as e:
            errors.append(f"prefill of request {i}: {e}")
            exported[i] = _empty_prefix(engine.pool)
    engine.stream_outputs = False
    try:
        while engine.has_unfinished_requests():
            try:
                finished = engine.step()
            except Exception as e:  # the prompts not done yet are left to their decode workers
                errors.append(f"prefill: {type(e).__name__}: {e}")
                break
            for out in finished:
                if out.finished:
                    i = _request_index(out.request_id)
                    exported[i] = _export(engine, i, prompts[i], errors)
            send_exported()
    finally:
        engine.stream_outputs = True
        for i, _, _ in jobs:
            engine.abort_request(_request_id(i))
    for i, _, _ in unsent:
        exported.setdefault(i, _empty_prefix(engine.pool))
    send_exported()
    return {"seconds": time.perf_counter() - start, "tokens": sum(len(ids) for _, ids, _ in jobs), "errors": errors}


def _export(engine, i: int, ids: list[int], errors: list[str]) -> PrefixKV:
    """The blocks of prompt ``ids`` that its decode worker reuses (an empty prefix if they cannot be read)."""
    wanted = _reusable_tokens(ids, engine.pool.block_size)
    try:
        prefix = export_prefix(engine, ids[:wanted])
    except Exception as e:
        errors.append(f"export of request {i}: {type(e).__name__}: {e}")
        return _empty_prefix(engine.pool)
    if prefix.num_tokens < wanted:
        errors.append(f"export of request {i}: only {prefix.num_tokens} of its {wanted} prompt tokens in full blocks "
                      "were still cached")
    return prefix


def _empty_prefix(pool) -> PrefixKV:
    return PrefixKV([], torch.empty((0, *pool.block_shape), dtype=pool.dtype, device=pool.device.torch))


def _decode(comm, llm, jobs: list) -> dict:
    """Admit each request once its blocks have arrived, and step the engine while the next ones are on their way (a
    thread receives them in request order; the engine is only touched here). A prefix is imported only when its
    request fits beside the running ones, and held until the request is admitted: neither later imports nor other
    requests evict it first. A prefix that cannot be imported is reported and its prompt computed here. The cost
    counts this engine's own work (imports and steps), not the waits for blocks."""
    engine = llm.engine
    errors: list[str] = []
    outputs: dict[int, object] = {}
    arrived: queue.Queue = queue.Queue()

    def receive() -> None:
        for i, _, _, src in jobs:
            try:
                arrived.put((i, recv_prefix(comm, src, tag=i)))
            except Exception as e:  # the transport broke: nothing more can arrive
                arrived.put((i, e))
                return

    receiver = threading.Thread(target=receive, name="prefix-receiver", daemon=True)
    receiver.start()
    by_index = {i: (ids, params) for i, ids, params, _ in jobs}
    received: collections.deque = collections.deque()  # (index, prefix) not imported yet, in request order
    arrived_tokens: dict[int, int] = {}
    held: dict[str, tuple[list[int], int]] = {}  # request id -> (its blocks held, blocks its admission adds)
    added = steps = overlapped = 0
    busy = 0.0
    nothing_ran = False  # after the last step, no sequence was running
    engine.stream_outputs = False
    try:
        requests = {i: _build_request(engine, i, ids, params) for i, ids, params, _ in jobs}  # bad input fails first
        while added < len(jobs) or engine.has_unfinished_requests():
            _take(arrived, received, wait=not received and not engine.has_unfinished_requests())
            started = time.perf_counter()
            if received and isinstance(received[0][1], Exception):
                raise received[0][1]
            if received and _fits(engine, *by_index[received[0][0]], received[0][1], held):
                i, prefix = received.popleft()
                ids, params = by_index[i]
                request = requests[i]
                arrived_tokens[i] = prefix.num_tokens
                try:
                    import_prefix(engine, prefix)
                    held[request.request_id] = (engine.blocks.hold(prefix.token_ids),
                                                _blocks_to_admit(engine, ids, params, len(prefix.blocks)))
                except (ValueError, TypeError) as e:
                    errors.append(f"import of request {i}: {e}")
                engine.add_request(request)
                added += 1
            else:
                for out in engine.step():
                    if out.finished:
                        outputs[_request_index(out.request_id)] = out
                steps += 1
                overlapped += added < len(jobs)
                nothing_runs = not engine.stats()["num_running"]
                _release_admitted(engine, held, everything=nothing_runs and nothing_ran)
                nothing_ran = nothing_runs
            busy += time.perf_counter() - started
    finally:
        engine.stream_outputs = True
        for blocks, _ in held.values():
            engine.blocks.release(blocks)
        for i, *_ in jobs:  # finished ones are gone already; this frees what an error left behind
            engine.abort_request(_request_id(i))
        # After an error the receiver may still be taking this call's prefixes (every one is sent, even by a
        # failed prefill): it must be done before the communicator serves the next call.
        receiver.join()
    results, lost = [], 0
    for i, ids, _, src in jobs:
        o = outputs[i]
        results.append(Result(i, list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason, src,
                              comm.rank, o.num_cached_tokens, list(o.outputs)))
        reusable = _reusable_tokens(ids, engine.pool.block_size)
        if o.num_cached_tokens < reusable:
            lost += 1
            errors.append(f"request {i}: {reusable - o.num_cached_tokens} of its {reusable} prompt tokens in full "
                          f"blocks computed again ({arrived_tokens[i]} arrived from rank {src})")
    return {"results": results, "errors": errors, "lost": lost,
            "cost": {"seconds": busy, "tokens": sum(len(c.token_ids) for r in results for c in r.outputs),
                     "steps": steps, "steps_while_receiving": overlapped}}


def _build_request(engine, i: int, ids: list[int], params: SamplingParams):
    """Request ``i`` built by ``engine``; its errors name the prompt's index in the call."""
    try:
        return engine.build_request(ids, params, request_id=_request_id(i))
    except ValueError as e:
        raise ValueError(f"prompt_token_ids[{i}]: {e}") from e
    except TypeError as e:
        raise TypeError(f"prompt_token_ids[{i}]: {e}") from e


def _take(arrived: queue.Queue, received: collections.deque, *, wait: bool) -> None:
    """Move what has arrived to ``received``; ``wait``: for one at least."""
    try:
        if wait:
            received.append(arrived.get())
        while True:
            received.append(arrived.get_nowait())
    except queue.Empty:
        pass


def _blocks_to_admit(engine, ids: list[int], params: SamplingParams, reused: int) -> int:
    """The blocks that admitting a request adds to the ``reused`` ones: each sample's part of its first step."""
    bs = engine.pool.block_size
    first_step = min(len(ids) - reused * bs, engine.config.max_num_batched_tokens)
    return params.n * (engine.blocks.blocks_for(reused * bs + first_step) - reused)


def _fits(engine, ids: list[int], params: SamplingParams, prefix: PrefixKV, held: dict) -> bool:
    """Whether a request can be admitted once ``prefix`` is imported: its blocks and its first step's fit beside the
    running requests (and the pool's watermark) and the requests admitted next, and its samples get sequence
    slots. A request alone in the engine always goes in: nothing else would make room."""
    if not engine.has_unfinished_requests():
        return True
    stats = engine.stats()
    needed = len(prefix.blocks) + _blocks_to_admit(engine, ids, params, len(prefix.blocks))
    room = engine.blocks.num_available - sum(admit for _, admit in held.values()) - engine.pool.watermark_blocks
    slots = engine.config.max_num_seqs - stats["num_running"] - stats["num_waiting"]
    return needed <= room and params.n <= slots


def _release_admitted(engine, held: dict, *, everything: bool) -> None:
    """Stop holding the blocks of requests that were admitted (or finished); ``everything``: of every request (after
    a step that ran nothing and admitted nothing, the holds could be what keeps the waiting requests out)."""
    for request_id in list(held):
        request = engine.requests.get(request_id)
        if everything or request is None or all(seq.num_cached_tokens is not None for seq in request.seqs):
            engine.blocks.release(held.pop(request_id)[0])


def _reusable_tokens(ids: list[int], block_size: int) -> int:
    """The tokens of prompt ``ids`` in full blocks that a request reuses: one token at least is computed, for the
    first logits."""
    return (len(ids) - 1) // block_size * block_size


def _request_id(index: int) -> str:
    return f"disagg-{index}"


def _request_index(request_id: str) -> int:
    return int(request_id.removeprefix("disagg-"))


def _check_prompts(prompts) -> list[list[int]]:
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"prompt_token_ids: expected a non-empty list of token-id lists, got {prompts!r:.80}")
    for k, ids in enumerate(prompts):
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompt_token_ids[{k}]: expected a non-empty list of ints, got {ids!r:.80}")
    return prompts
