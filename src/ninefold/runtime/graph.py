"""Task graphs: callables with dependencies, each queued on a stream of its own choosing.

A task's arguments may be other tasks (their results are passed in, which makes them dependencies)
and ``after=`` adds dependencies that pass nothing. Tasks are launched from the host in the order
they were added, which is a dependency order (a task can only depend on tasks added before it). On
an accelerator each task runs with its stream current, after that stream waits for events recorded
behind its dependencies, so independent tasks on different streams overlap (a copy of the next
batch's inputs while the current step computes). On the CPU they simply run in that order.

A failing task does not stop the others: tasks that depend on it (directly or not) are skipped,
the rest run, and ``run`` then raises ``TaskFailed`` from the first error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ninefold.runtime.device import Device

__all__ = ["Task", "TaskFailed", "TaskGraph"]


class TaskFailed(RuntimeError):
    """One or more tasks raised. ``failed``: task name -> exception; ``skipped``: names of tasks not
    run because something they depend on failed; ``results``: what the other tasks returned."""

    def __init__(self, failed: dict[str, BaseException], skipped: list[str], results: dict[str, Any]):
        first = next(iter(failed))
        super().__init__(f"task {first!r} raised {type(failed[first]).__name__}: {failed[first]}"
                         + (f"; skipped its dependents {skipped}" if skipped else ""))
        self.failed, self.skipped, self.results = failed, skipped, results


@dataclasses.dataclass(eq=False)
class Task:
    """A node of a ``TaskGraph``; pass it as an argument of a later task to use its result."""

    name: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    deps: tuple[Task, ...]
    stream: Any
    graph: TaskGraph = dataclasses.field(repr=False)

    def __repr__(self) -> str:
        return f"Task({self.name!r}, deps={[d.name for d in self.deps]})"


class TaskGraph:
    """Tasks with dependencies on ``device``'s streams; build with ``add``, execute with ``run``.

    ``stream`` of a task is None (the stream current when ``run`` is called), a name (a stream this
    graph creates once and keeps, e.g. ``"copy"``) or a stream object.
    """

    def __init__(self, device: str | torch.device | Device = "cpu"):
        self.device = Device(device)
        self.tasks: list[Task] = []
        self._streams: dict[str, Any] = {}

    def add(self, fn: Callable[..., Any], *args, after: Iterable[Task] = (), stream=None,
            name: str | None = None, **kwargs) -> Task:
        """Add ``fn(*args, **kwargs)`` as a task; tasks among the arguments are replaced by their results."""
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        name = name if name is not None else f"{getattr(fn, '__name__', 'task')}#{len(self.tasks)}"
        if not isinstance(name, str) or any(t.name == name for t in self.tasks):
            raise ValueError(f"name: task names must be unique strings, got {name!r}")
        after = list(after)
        for dep in after:
            if not isinstance(dep, Task):
                raise TypeError(f"after: expected Tasks, got {type(dep).__name__}")
        deps: list[Task] = []
        for dep in [*args, *kwargs.values(), *after]:
            if isinstance(dep, Task):
                if dep.graph is not self:
                    raise ValueError(f"after: task {dep.name!r} belongs to another graph")
                if all(dep is not d for d in deps):
                    deps.append(dep)
        if isinstance(stream, str):
            if stream not in self._streams:
                self._streams[stream] = self.device.stream()
            stream = self._streams[stream]
        task = Task(name, fn, args, kwargs, tuple(deps), stream, self)
        self.tasks.append(task)
        return task

    def run(self) -> dict[str, Any]:
        """Run every task once; returns task name -> result (raises ``TaskFailed`` if any task raised).

        On accelerators the streams join the calling stream at the end, so work queued after ``run``
        sees every task's effects; nothing waits on the host.
        """
        results: dict[Task, Any] = {}
        done: dict[Task, Any] = {}  # task -> event recorded after it (None on the CPU)
        failed: dict[str, BaseException] = {}
        bad: set[Task] = set()
        skipped: list[str] = []
        caller = self.device.current_stream()
        dev = self.device
        for task in self.tasks:
            if any(d in bad for d in task.deps):
                bad.add(task)
                skipped.append(task.name)
                continue
            stream = task.stream if task.stream is not None else caller
            if dev.is_accelerator:
                if not task.deps:
                    stream.wait_stream(caller)
                for dep in task.deps:
                    stream.wait_event(done[dep])
            args = tuple(results[a] if isinstance(a, Task) else a for a in task.args)
            kwargs = {k: results[v] if isinstance(v, Task) else v for k, v in task.kwargs.items()}
            try:
                with dev.use_stream(stream):
                    results[task] = task.fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - reported through TaskFailed
                failed[task.name] = exc
                bad.add(task)
                continue
            if dev.is_accelerator:
                event = dev.event()
                event.record(stream)
                done[task] = event
        if dev.is_accelerator:
            for event in done.values():
                caller.wait_event(event)
        named = {t.name: r for t, r in results.items()}
        if failed:
            raise TaskFailed(failed, skipped, named) from next(iter(failed.values()))
        return named
