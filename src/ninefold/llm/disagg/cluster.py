"""Prefill and decode on different ranks of one job: a router on rank 0, engines on every other rank.

Every rank of a ``ninefold.comm`` job calls :func:`start`. The workers load the model and wait for
plans; rank 0 gets a :class:`Router`. For each :meth:`Router.generate` call the router splits the
workers into prefill and decode workers (``num_prefill``, or the split that balances the measured
prefill and decode costs of earlier calls, so the P/D ratio follows the load), hands each request
to one of each, and collects the results. A prefill worker computes its prompts (one token each) in
groups of up to one step's token budget and sends each group's KV blocks to the decode workers chosen
for them; a decode worker admits each request as soon as its blocks have arrived (imported into its
prefix cache, so it computes only the last partial block) and keeps stepping while others arrive.

Transfers go in ascending request order on every worker, so the smallest pending transfer always
has its sender and its receiver ready: no cycle of waiting workers can form.
"""

from __future__ import annotations

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
    KV-cache memory. A worker that cannot load makes the router raise, naming it and why."""
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
    if share is not None and "num_kv_blocks" not in llm_args:
        llm_args = {**llm_args, "kv_cache_memory_fraction": llm_args.get("kv_cache_memory_fraction", 0.9) * share}
    llm, failure = None, None
    for stage in range(stages):
        if comm.rank != 0 and stage == my_stage:
            try:
                from ninefold.llm.api import LLM

                llm = LLM(model, **llm_args)
            except Exception as e:  # reported to the router below; the other ranks must not wait forever
                failure = f"{type(e).__name__}: {e}"
        comm.barrier()
    states = comm.all_gather_object(failure)
    broken = {r: why for r, why in enumerate(states) if why is not None}
    if broken:
        raise RuntimeError("disaggregation workers failed to load the model: "
                           + "; ".join(f"rank {r}: {why}" for r, why in broken.items()))
    if comm.rank == 0:
        return Router(comm)
    _serve(comm, llm)
    return None


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
    """Splits requests over prefill and decode workers and gathers the results (rank 0 of the job)."""

    def __init__(self, comm):
        self.comm = comm
        self.workers = list(range(1, comm.world_size))
        self.prefill_s_per_token: float | None = None  # measured, per prefill worker
        self.decode_s_per_token: float | None = None  # measured, per decode worker
        self.last_plan: Plan | None = None
        self.last_errors: list[str] = []  # what went wrong in the last call without losing a request
        # per decode worker: seconds, tokens, engine steps, and steps run while blocks were still arriving
        self.last_decode_costs: list[dict] = []
        self._stopped = False

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
        plan = self.plan(sum(map(len, prompts)), sum((p.max_tokens or 1) * p.n for p in params), num_prefill)
        self.last_plan = plan
        by_load = {r: 0 for r in plan.prefill + plan.decode}
        jobs: dict[int, list] = {r: [] for r in by_load}
        for i, ids in sorted(enumerate(prompts), key=lambda item: -len(item[1])):  # longest first, least loaded
            p = min(plan.prefill, key=lambda r: by_load[r])
            d = min(plan.decode, key=lambda r: by_load[r])
            by_load[p] += len(ids)
            by_load[d] += (params[i].max_tokens or 1) * params[i].n
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
        msg = comm.recv_object(0)
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
    """Compute the prompts in groups of up to one step's token budget and send each group's blocks as soon
    as it is done, so decode workers start early. A failure still sends (empty) prefixes, so that no decode
    worker waits forever: it then computes those prompts itself."""
    start = time.perf_counter()
    budget = llm.engine.config.max_num_batched_tokens
    errors: list[str] = []
    group: list = []
    for k, job in enumerate(jobs):
        group.append(job)
        if k + 1 == len(jobs) or sum(len(ids) for _, ids, _ in group) + len(jobs[k + 1][1]) > budget:
            _prefill_group(comm, llm, group, errors)
            group = []
    return {"seconds": time.perf_counter() - start, "tokens": sum(len(ids) for _, ids, _ in jobs), "errors": errors}


def _prefill_group(comm, llm, jobs: list, errors: list[str]) -> None:
    failed = False
    try:
        llm.generate(prompt_token_ids=[ids for _, ids, _ in jobs], sampling_params=_ONE_TOKEN)
    except Exception as e:
        errors.append(f"prefill: {type(e).__name__}: {e}")
        failed = True
    pool = llm.engine.pool
    for i, ids, dst in jobs:
        prefix = None
        if not failed:
            try:
                prefix = export_prefix(llm.engine, ids)
            except Exception as e:
                errors.append(f"export of request {i}: {type(e).__name__}: {e}")
        if prefix is None:
            prefix = PrefixKV([], torch.empty((0, *pool.block_shape), dtype=pool.dtype, device=pool.device.torch))
        send_prefix(comm, prefix, dst, tag=i)


def _decode(comm, llm, jobs: list) -> dict:
    """Admit each request as soon as its blocks have arrived and step the engine while the next ones are on
    their way (a thread receives them in request order; the engine is only touched here). A prefix that
    cannot be imported is reported and its prompt computed here."""
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
    admitted = steps = overlapped = 0
    start = time.perf_counter()
    engine.stream_outputs = False
    try:
        while admitted < len(jobs) or engine.has_unfinished_requests():
            try:
                i, prefix = arrived.get(block=not engine.has_unfinished_requests())
            except queue.Empty:
                for out in engine.step():
                    if out.finished:
                        outputs[int(out.request_id.removeprefix("disagg-"))] = out
                steps += 1
                overlapped += admitted < len(jobs)
                continue
            if isinstance(prefix, Exception):
                raise prefix
            try:
                import_prefix(engine, prefix)
            except (ValueError, TypeError) as e:
                errors.append(f"import of request {i}: {e}")
            ids, params = by_index[i]
            engine.add_request(engine.build_request(ids, params, request_id=f"disagg-{i}"))
            admitted += 1
    finally:
        engine.stream_outputs = True
        for i, *_ in jobs:  # finished ones are gone already; this frees what an error left behind
            engine.abort_request(f"disagg-{i}")
        # After an error the receiver may still be taking this call's prefixes (every one is sent, even by a
        # failed prefill): it must be done before the communicator serves the next call.
        receiver.join()
    seconds = time.perf_counter() - start
    results = []
    for i, _, _, src in jobs:
        o = outputs[i]
        results.append(Result(i, list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason, src,
                              comm.rank, o.num_cached_tokens, list(o.outputs)))
    return {"results": results, "errors": errors,
            "cost": {"seconds": seconds, "tokens": sum(len(r.token_ids) for r in results), "steps": steps,
                     "steps_while_receiving": overlapped}}


def _check_prompts(prompts) -> list[list[int]]:
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"prompt_token_ids: expected a non-empty list of token-id lists, got {prompts!r:.80}")
    for k, ids in enumerate(prompts):
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompt_token_ids[{k}]: expected a non-empty list of ints, got {ids!r:.80}")
    return prompts
