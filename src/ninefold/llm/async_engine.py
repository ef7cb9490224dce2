"""``AsyncEngine``: the engine on a thread of its own, with asyncio streams for the server.

All engine state is touched by the engine thread only. ``generate`` checks and tokenizes a
request in the caller (bad requests raise ValueError/TypeError before anything is yielded),
then posts it to the thread's inbox; ``abort`` posts an abort. The thread drains the inbox
before every step, so an abort that lands mid-step is applied right after that step and
frees the request's KV blocks before the next one is scheduled.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from ninefold.llm.engine import LLMEngine
from ninefold.llm.outputs import RequestOutput
from ninefold.llm.sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    """Serve one model to many concurrent asyncio callers. Keywords: ``EngineConfig`` fields."""

    def __init__(self, model=None, **engine_args):
        self.engine = LLMEngine(model, **engine_args)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
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
        self, prompt: str | list[int], sampling_params: SamplingParams | None, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request; the last has ``finished=True``. ``priority``: see
        ``LLMEngine.build_request``.

        Closing the iterator early (or cancelling the task) aborts the request.
        """
        if self._stopped:
            raise RuntimeError("AsyncEngine: shut down")
        request = self.engine.build_request(prompt, sampling_params, request_id, priority)
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
            idle = not engine.has_unfinished_requests()
            if not self._drain(block=idle):
                break
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
            if kind == "add":
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
