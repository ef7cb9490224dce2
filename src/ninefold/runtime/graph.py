"""Task graphs: callables with dependencies, each queued on a stream of its own choosing.

A task's arguments may be other tasks, also inside lists, tuples and dicts (their results are passed
in, which makes them dependencies), and ``after=`` adds dependencies that pass nothing. Tasks are
launched from the host in the order they were added, which is a dependency order (a task can only
depend on tasks added before it). On an accelerator each task runs with its stream current, after
that stream waits for events recorded behind its dependencies, so independent tasks on different
streams overlap (a copy of the next batch's inputs while the current step computes). On the CPU they
simply run in that order.

A failing task does not stop the others: tasks that depend on it (directly or not) are skipped,
the rest run, and ``run`` then raises ``TaskFailed`` naming every failed task, from the first error.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ninefold.runtime.device import Device

__all__ = ["Task", "TaskFailed", "TaskGraph"]


class TaskFailed(RuntimeError):
    """One or more tasks raised. ``failed``: task name -> exception; ``skipped``: names of tasks not
    run because something they depend on failed; ``results``: what the other tasks returned."""

    def __init__(self, failed: dict[str, BaseException], skipped: list[str], results: dict[str, Any]):
        first, *others = failed
        super().__init__(f"task {first!r} raised {type(failed[first]).__name__}: {failed[first]}"
                         + "".join(f"; task {n!r} raised {type(failed[n]).__name__}: {failed[n]}" for n in others)
                         + (f"; skipped their dependents {skipped}" if skipped else ""))
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

    def add(self, fn: Callable[..., Any], *args, after: Task | Iterable[Task] = (), stream=None,
            name: str | None = None, **kwargs) -> Task:
        """Add ``fn(*args, **kwargs)`` as a task; tasks among the arguments (also inside lists, tuples and
        dicts) are replaced by their results. ``after`` is a task or an iterable of tasks."""
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        taken = {t.name for t in self.tasks}
        if name is None:
            base = getattr(fn, "__name__", "task")
            name = next(n for n in (f"{base}#{k}" for k in itertools.count(len(self.tasks))) if n not in taken)
        if not isinstance(name, str) or name in taken:
            raise ValueError(f"name: task names must be unique strings, got {name!r}")
        if isinstance(after, Task):
            after = [after]
        elif isinstance(after, (str, bytes)) or not isinstance(after, Iterable):
            raise TypeError(f"after: expected a Task or an iterable of Tasks, got {type(after).__name__}")
        after = list(after)
        for dep in after:
            if not isinstance(dep, Task):
                raise TypeError(f"after: expected Tasks, got {type(dep).__name__}")
        if not (stream is None or isinstance(stream, str) or all(hasattr(stream, a) for a in ("wait_event", "wait_stream"))):
            raise TypeError(f"stream: expected None, a stream name (str) or a stream, got {type(stream).__name__}")
        deps: list[Task] = []
        for where, dep in [*(("args", t) for t in _tasks_in(args)), *(("kwargs", t) for t in _tasks_in(kwargs)),
                           *(("after", t) for t in after)]:
            if dep.graph is not self:
                raise ValueError(f"{where}: task {dep.name!r} belongs to another graph")
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
            args = _resolve(task.args, results) if task.deps else task.args
            kwargs = _resolve(task.kwargs, results) if task.deps else task.kwargs
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


def _tasks_in(value) -> list[Task]:
    """The tasks in ``value``, looking inside lists, tuples and dicts."""
    if isinstance(value, Task):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tasks_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tasks_in(v)]
    return []


def _resolve(value, results: dict[Task, Any]):
    """``value`` with every task (also inside lists, tuples and dicts) replaced by its result."""
    if isinstance(value, Task):
        return results[value]
    if isinstance(value, (list, tuple)) and _tasks_in(value):
        items = [_resolve(v, results) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict) and _tasks_in(value):
        resolved = copy.copy(value)  # the same type (defaultdict, OrderedDict), its default_factory kept
        for k, v in value.items():
            resolved[k] = _resolve(v, results)
        return resolved
    return value
