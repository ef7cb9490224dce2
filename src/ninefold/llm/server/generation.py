"""Running the sequences of one request on the engine: merging, aborting, disconnects, shutdown.

A request becomes one engine request per sequence (prompts x n), each with its own id, so every
sequence can be aborted on its own and none is left generating when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from ninefold.llm.outputs import CompletionOutput
from ninefold.llm.sampling import SamplingParams
from ninefold.llm.server.errors import APIError
from ninefold.llm.server.metrics import SequenceTimer
from ninefold.llm.server.preprocess import Prompt

_END = object()
_NEW_OUTPUT = object()  # the sequence has a newer output in Generation._latest


@dataclass
class Sequence:
    """One engine request: choice ``index`` of the response."""

    index: int
    request_id: str
    prompt: Prompt
    params: SamplingParams
    timer: SequenceTimer | None = None
    output: CompletionOutput | None = None
    done: bool = False
    prompt_logprobs: list | None = None  # with SamplingParams.prompt_logprobs: one entry per prompt token
    priority: int = 0  # the request's (scheduling_policy "priority")
    lora_request: Any = None  # the LoRA adapter its ``model`` named (None: the base model)

    @property
    def finish_reason(self) -> str | None:
        """"stop" or "length" once finished; "abort" when it ended without one."""
        if not self.done:
            return None
        reason = self.output.finish_reason if self.output is not None else None
        return reason or "abort"


@dataclass(eq=False)
class Generation:
    """The sequences of one request, run concurrently, their outputs merged in arrival order."""

    engine: Any
    sequences: list[Sequence]
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    # Newest unread output per sequence: a client that stops reading holds one output per sequence,
    # not one per generated token (each of which holds all the token ids so far).
    _latest: dict[int, CompletionOutput | None] = field(default_factory=dict)

    def fail(self, error: APIError) -> None:
        """End the generation with ``error`` (used when a shutdown deadline passes)."""
        self._queue.put_nowait((None, error))

    async def events(self) -> AsyncIterator[Sequence]:
        """Yield a sequence each time its output changes; raises the first error of any sequence.

        Outputs are cumulative, so when several are waiting (the client reads slower than the engine
        steps) a sequence is yielded once with the newest. Leaving the loop early (client gone,
        cancellation, error) aborts every unfinished sequence.
        """
        self._tasks = [asyncio.create_task(self._run(seq)) for seq in self.sequences]
        try:
            pending = len(self.sequences)
            while pending:
                batch = [await self._queue.get()]
                while not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                changed: dict[int, Sequence] = {}
                for seq, item in batch:
                    if isinstance(item, BaseException):
                        raise item
                    if item is _END:
                        pending -= 1
                        if seq.done:
                            continue
                        self._finish(seq)
                    elif item is _NEW_OUTPUT:
                        item = self._latest.pop(seq.index, None)
                        if item is None or seq.done:
                            continue
                        seq.output = item
                        if seq.timer is not None:
                            seq.timer.tokens_now(len(item.token_ids))
                        if item.finish_reason is not None:
                            self._finish(seq)
                    changed[seq.index] = seq
                for seq in changed.values():
                    yield seq
        finally:
            with anyio.CancelScope(shield=True):
                await self.abort()

    @staticmethod
    def _finish(seq: Sequence) -> None:
        seq.done = True
        if seq.timer is not None:
            seq.timer.finish(seq.finish_reason)

    async def abort(self) -> None:
        """Abort every unfinished sequence in the engine and stop their tasks."""
        for task in self._tasks:
            task.cancel()
        for seq in self.sequences:
            if not seq.done:
                with contextlib.suppress(Exception):
                    await self.engine.abort(seq.request_id)
                self._finish(seq)  # counted as "abort"
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task

    async def _run(self, seq: Sequence) -> None:
        try:
            async for out in self.engine.generate(seq.prompt.token_ids, seq.params, seq.request_id, seq.priority,
                                                 seq.lora_request):
                if out.prompt_logprobs is not None:
                    seq.prompt_logprobs = out.prompt_logprobs
                if not out.outputs:
                    continue
                already_signalled = seq.index in self._latest
                self._latest[seq.index] = out.outputs[0]
                if not already_signalled:
                    self._queue.put_nowait((seq, _NEW_OUTPUT))
            self._queue.put_nowait((seq, _END))
        except asyncio.CancelledError:
            raise
        except (ValueError, TypeError) as exc:
            self._queue.put_nowait((seq, APIError(400, f"the engine rejected the request: {exc}")))
        except Exception as exc:
            self._queue.put_nowait((seq, APIError(500, f"generation failed ({type(exc).__name__}: {exc})")))


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return once the client has closed the connection."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run ``work`` unless the client disconnects first (then ``work`` is cancelled).

    Returns ``(True, result)`` when the work finished, ``(False, None)`` when the client left.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        with anyio.CancelScope(shield=True):
            for pending in (task, watcher):
                with contextlib.suppress(BaseException):
                    await pending
    if task.cancelled():
        return False, None
    return True, task.result()
