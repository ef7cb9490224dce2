"""Run one Python function as the ranks of a group, in fresh processes: ``launch`` for library code and tests.

Each process is started with multiprocessing's "spawn" method, gets the same rendezvous
environment as :func:`ninefold.comm.launch.launch` before ``fn`` is even unpickled, and sends back
``fn``'s return value or the traceback of what it raised.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import time
import traceback

from ninefold.comm.launch import (
    _check_count,
    _check_env,
    _check_seconds,
    describe_exit,
    free_port,
    rendezvous_env,
)

_GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping ranks


class SpawnError(RuntimeError):
    """A rank of :func:`spawn` raised, died without a result, or the ranks ran past ``timeout_s``.

    ``ranks`` names the ranks at fault (the one that failed, or those still running at the timeout).
    """

    def __init__(self, message: str, ranks: list[int] | tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = list(ranks)


def spawn(fn, nprocs: int, args: tuple = (), *, timeout_s: float | None = None, env: dict | None = None) -> list:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes, ranks 0..nprocs-1 of one group; return their
    return values in rank order.

    ``fn`` must be importable by name (a module-level function, not a lambda or a nested function),
    and ``args`` and the return values picklable. ``env`` adds environment variables to the ranks'.
    If a rank raises, or ends without a result, or ``timeout_s`` passes, the other ranks are stopped
    (SIGTERM, then SIGKILL) and :class:`SpawnError` says which rank and why (with its traceback).
    """
    payload = _pickled_call(fn, args)
    _check_count("nprocs", nprocs)
    if timeout_s is not None:
        _check_seconds("timeout_s", timeout_s, allow_zero=False)
    extra = _check_env(env)

    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    succeeded = False
    try:
        for rank in range(nprocs):
            receiver, sender = context.Pipe(duplex=False)
            rank_env = {**extra, **rendezvous_env(rank, nprocs, "127.0.0.1", port)}
            proc = context.Process(target=_run_rank, args=(payload, rank_env, sender), name=f"ninefold-rank{rank}")
            proc.start()
            sender.close()  # the rank holds the only sending end now: its death reads as EOF here
            procs.append(proc)
            conns.append(receiver)
        results = _collect(procs, conns, timeout_s)
        succeeded = True
        return results
    finally:
        _stop(procs, patient=succeeded)
        for conn in conns:
            conn.close()


def _pickled_call(fn, args) -> bytes:
    accepted = "a function importable by name (defined at module level), not a lambda or a nested function"
    if not callable(fn):
        raise TypeError(f"fn: got {fn!r} ({type(fn).__name__}); expected {accepted}")
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(f"fn: got {qualname} from {getattr(fn, '__module__', '?')}; expected {accepted}, because "
                        f"each rank imports it anew")
    try:
        pickle.dumps(fn)
    except Exception as error:
        raise TypeError(f"fn: got {fn!r}, which cannot be pickled ({error}); expected {accepted}") from None
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args: got {args!r} ({type(args).__name__}); expected a tuple of picklable arguments")
    try:
        return pickle.dumps((fn, tuple(args)))
    except Exception as error:
        raise TypeError(f"args: cannot be pickled ({error}); expected a tuple of picklable arguments") from None


def _run_rank(payload: bytes, env: dict[str, str], conn) -> None:
    """The body of each rank: set the environment, run the call, send back ``("ok", value)`` or
    ``("error", traceback text)``."""
    os.environ.update(env)
    try:
        fn, args = pickle.loads(payload)
        result = ("ok", fn(*args))
    except BaseException:  # SystemExit and KeyboardInterrupt end a rank without a result too
        result = ("error", traceback.format_exc())
    try:
        conn.send(result)
    except Exception:
        conn.send(("error", f"fn returned a value that cannot be pickled:\n{traceback.format_exc()}"))
    conn.close()


def _collect(procs, conns, timeout_s: float | None) -> list:
    """Wait for every rank's message; raise SpawnError at the first failure or at the deadline."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    results: dict[int, object] = {}
    waiting = dict(enumerate(conns))
    while waiting:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait([*waiting.values(), *(procs[r].sentinel for r in waiting)], left)
        if not ready:
            running = sorted(waiting)
            raise SpawnError(f"spawn: timed out after {timeout_s} s; ranks still running: {running}", running)
        for rank in sorted(waiting):
            conn, proc = waiting[rank], procs[rank]
            if conn not in ready and proc.sentinel not in ready:
                continue
            try:
                status, value = conn.recv()  # a rank that exited has left its message in the pipe, if it sent one
            except EOFError:
                proc.join()
                raise SpawnError(f"spawn: rank {rank} {describe_exit(proc.exitcode)} without returning a result",
                                 [rank]) from None
            if status == "error":
                raise SpawnError(f"spawn: rank {rank} failed:\n{value}", [rank])
            results[rank] = value
            del waiting[rank]
    return [results[rank] for rank in range(len(procs))]


def _stop(procs, patient: bool) -> None:
    """Reap every rank: terminate those still running (SIGTERM, then SIGKILL after a grace period).

    ``patient``: the ranks have all sent their results, so first give them the grace period to exit.
    """
    if patient:
        _join_all(procs, _GRACE_S)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    _join_all(procs, _GRACE_S)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
        proc.close()


def _join_all(procs, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
