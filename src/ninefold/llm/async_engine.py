"""``AsyncEngine``: the engine on a thread of its own, with asyncio streams for the server.

All engine state is touched by the engine thread only. ``generate`` checks and tokenizes a
request in the caller (bad requests raise ValueError/TypeError before anything is yielded),
then posts it to the thread's inbox; ``abort`` posts an abort. The thread drains the inbox
before every step, so an abort that lands mid-step is applied right after that step and
frees the request's KV blocks before the next one is scheduled. ``embed`` posts embedding requests;
the thread runs one step's worth of them (``max_num_batched_tokens``) between generation steps, so
a large embedding batch does not stall the streams of running requests.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ninefold.llm.beam_search import BeamSearchOutput, BeamSearchParams, search_async, whole_request_params
from ninefold.llm.embedding import EmbeddingRequest
from ninefold.llm.engine import LLMEngine
from ninefold.llm.outputs import EmbeddingRequestOutput, RequestOutput
from ninefold.llm.pooling import PoolingParams
from ninefold.llm.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _EmbedJob:
    """One ``embed`` call's requests, its caller's future, and the results so far (by position)."""

    requests: list[EmbeddingRequest]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    results: list = field(default_factory=list)
    next: int = 0  # requests[:next] have been sent to a step

    def settle(self, value) -> None:
        """Resolve the caller's future with outputs, or an exception (from the engine thread)."""
        def resolve():
            if not self.future.done():
                (self.future.set_exception if isinstance(value, BaseException) else self.future.set_result)(value)

        try:
            self.loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the caller's loop is closed
            pass


class AsyncEngine:
    """Serve one model to many concurrent asyncio callers. Keywords: ``EngineConfig`` fields."""

    def __init__(self, model=None, **engine_args):
        self.engine = LLMEngine(model, **engine_args)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._embed_jobs: deque[_EmbedJob] = deque()  # engine thread only
        self._thread = threading.Thread(target=self._run, name="ninefold-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_llm_args(cls, model=None, dtype="auto", device=None, **engine_args) -> AsyncEngine:
        """Build with the same arguments as ``LLM(...)``."""
        return cls(model, dtype=dtype, device=device, **engine_args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.max_num_seqs

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def dtype(self):
        return self.engine.dtype

    @property
    def device(self):
        return self.engine.device

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams | None, request_id: str, priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request; the last has ``finished=True``. ``priority``,
        ``lora_request``: see ``LLMEngine.build_request``.

        Closing the iterator early (or cancelling the task) aborts the request.
        """
        if self._stopped:
            raise RuntimeError("AsyncEngine: shut down")
        request = self.engine.build_request(prompt, sampling_params, request_id, priority, lora_request)
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request_id: {rid!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", request))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._inbox.put(("abort", rid))

    async def beam_search(self, prompt: str | list[int], params: BeamSearchParams, request_id: str, priority: int = 0,
                          lora_request=None) -> BeamSearchOutput:
        """The ``params.beam_width`` best continuations of one prompt (``ninefold.llm.beam_search``, as
        ``LLM.beam_search``), its rounds interleaved with the engine's other requests (round ids
        ``{request_id}-beam{round}-{k}``). The prompt and parameters are checked first (ValueError/TypeError);
        cancelling the call aborts the round in flight."""
        if self._stopped:
            raise RuntimeError("AsyncEngine: shut down")
        checked = self.engine.build_request(prompt, whole_request_params(params), request_id, priority, lora_request)
        search = await search_async(self, checked.prompt_token_ids, params, checked.request_id, priority=priority,
                                    lora_request=lora_request)
        tokenizer = self.tokenizer
        return search.result(tokenizer.decode if tokenizer is not None else None)

    async def embed(self, prompts: list, pooling_params: PoolingParams | list[PoolingParams] | None,
                    request_id: str) -> list[EmbeddingRequestOutput]:
        """Embeddings of ``prompts`` (each a str, token ids or prompt dict; ``pooling_params`` one for all or one
        per prompt), in order. Bad prompts raise ValueError/TypeError before anything is queued; cancelling the
        call drops what is not computed yet."""
        if self._stopped:
            raise RuntimeError("AsyncEngine: shut down")
        requests = self.engine.embedder.build_requests(prompts, pooling_params, request_id)
        loop = asyncio.get_running_loop()
        job = _EmbedJob(requests, loop, loop.create_future())
        self._inbox.put(("embed", job))
        return await job.future

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op for unknown or finished ids); its KV blocks are freed before the next step."""
        self._inbox.put(("abort", str(request_id)))

    @property
    def broken(self) -> str | None:
        """Why the engine can never serve again (a tensor-parallel worker lost), or None."""
        group = self.engine.parallel_group
        return None if group is None else group.failed

    def stats(self) -> dict:
        """num_running, num_waiting, kv_usage, num_free_blocks, num_blocks, block_size, prefix_cache_hit_rate."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the engine thread (pending requests get a RuntimeError)."""
        if self._stopped:
            return
        self._stopped = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)
        if not self._thread.is_alive():  # (a step still running keeps the engine's workers until it ends)
            self.engine.close()

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests() and not self._embed_jobs
            if not self._drain(block=idle):
                break
            if self._embed_jobs:
                self._embed_step()
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # a bug: fail what is running, keep serving
                log.exception("engine step failed; aborting %d running request(s)", len(engine.requests))
                for rid in list(engine.requests):
                    engine.abort_request(rid)
                    self._deliver(rid, RuntimeError(f"engine step failed: {error!r}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
        for rid in list(engine.requests):
            engine.abort_request(rid)
            self._deliver(rid, RuntimeError("AsyncEngine: shut down"))
        while self._embed_jobs:
            self._embed_jobs.popleft().settle(RuntimeError("AsyncEngine: shut down"))

    def _embed_step(self) -> None:
        """One step of queued embedding requests, oldest first, across jobs up to the token budget."""
        budget = self.engine.config.max_num_batched_tokens
        batch, owners, tokens = [], [], 0
        for job in self._embed_jobs:
            if job.future.cancelled():  # the caller went away: compute nothing more for it
                job.next = len(job.requests)
            while job.next < len(job.requests):
                request = job.requests[job.next]
                if batch and tokens + len(request.token_ids) > budget:
                    break
                batch.append(request)
                owners.append(job)
                tokens += len(request.token_ids)
                job.next += 1
            if job.next < len(job.requests):
                break
        try:
            outputs = self.engine.embedder.run_batch(batch) if batch else []
        except Exception as error:  # a bug: fail the jobs in this step, keep serving
            log.exception("embedding step failed")
            for job in set(owners):
                job.next = len(job.requests)
                job.settle(RuntimeError(f"embedding step failed: {error!r}"))
            outputs = None
        for job, out in zip(owners, outputs or []):
            job.results.append(out)
        while self._embed_jobs and self._embed_jobs[0].next == len(self._embed_jobs[0].requests):
            job = self._embed_jobs.popleft()
            if len(job.results) == len(job.requests):
                job.settle(job.results)

    def _drain(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once asked to stop."""
        while True:
            try:
                kind, item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "embed":
                self._embed_jobs.append(item)
            elif kind == "add":
                try:
                    self.engine.add_request(item)
                except ValueError as error:
                    self._deliver(item.request_id, error)
            elif kind == "abort":
                out = self.engine.abort_request(item)
                if out is not None:
                    self._deliver(item, out)

    def _deliver(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass
