"""Start ``nproc`` processes of one command on this host, each told its place in the group.

Every rank gets the rendezvous environment under torchrun's names (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that ``torch.distributed.init_process_group()`` and
``ninefold.comm`` find their peers without arguments, plus ``NINEFOLD_COMM_LAUNCHED=1``.

The launcher supervises the ranks as one job: the first rank that fails stops the others, a signal
sent to the launcher reaches every rank, and no rank (nor anything a rank started) outlives it.
Each rank runs in its own process group so that stopping a rank stops its children too (POSIX only).

``python -m ninefold.comm.launch`` is the command line ``ninefold launch`` (``ninefold.cli.launch``).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

RENDEZVOUS_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "NINEFOLD_COMM_LAUNCHED")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL_S = 0.02


def launch(command: list[str], nproc: int, *, master_addr: str = "127.0.0.1", master_port: int | None = None,
           env: dict | None = None, tag_output: bool = True, grace_s: float = 5.0) -> int:
    """Run ``nproc`` copies of ``command`` on this host as ranks 0..nproc-1; return the job's exit code.

    ``master_port`` defaults to a free TCP port. ``env`` adds variables to the launcher's environment
    (it may not set the rendezvous names). With ``tag_output`` every line a rank writes is forwarded
    whole, as ``[rank N] line``, to the launcher's stdout or stderr (and Python ranks run unbuffered,
    unless PYTHONUNBUFFERED is set already); without it the ranks write to the launcher's streams
    directly. Ranks do not read the launcher's stdin.

    Returns 0 when every rank exits 0. When a rank fails, one line on stderr names it, the others get
    SIGTERM and, ``grace_s`` seconds later, SIGKILL; the failing rank's code is returned (128 + the
    signal number for a rank killed by a signal). SIGINT, SIGTERM or SIGHUP sent to the launcher (in
    the main thread) is forwarded to every rank, a second one sends SIGKILL, and 128 + that signal
    is returned once the ranks are gone.
    """
    extra = _check_env(env)
    command = _check_command(command, extra)
    _check_count("nproc", nproc)
    _check_master_addr(master_addr)
    if master_port is not None:
        _check_port("master_port", master_port)
    if not isinstance(tag_output, bool):
        raise TypeError(f"tag_output: got {tag_output!r}; expected True or False")
    _check_seconds("grace_s", grace_s)

    port = free_port() if master_port is None else master_port
    base = {**os.environ, **extra}
    if tag_output:
        base.setdefault("PYTHONUNBUFFERED", "1")
    job = _Job(grace_s)
    with _forwarding_signals(job):
        try:
            for rank in range(nproc):
                if job.signals:
                    break
                job.start(command, {**base, **rendezvous_env(rank, nproc, master_addr, port)}, tag_output)
            if tag_output:
                job.forward_output()
            return job.supervise()
        finally:
            job.stop()


def rendezvous_env(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment that tells one process of a single-host group where it stands and where to meet."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "NINEFOLD_COMM_LAUNCHED": "1"}


def free_port() -> int:
    """A TCP port that no socket on this host is bound to right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def exit_code(returncode: int) -> int:
    """A child's status as a shell reports it: its exit code, or 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL (code 137)``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name} (code {exit_code(returncode)})"


class _Job:
    """The ranks of one launch: started, watched, signalled and reaped together."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.signals: list[int] = []  # the signals the launcher received, in order
        self.output_lock = threading.Lock()  # one for both streams: they may be the same terminal

    def start(self, command: list[str], env: dict[str, str], tag_output: bool) -> None:
        pipe = subprocess.PIPE if tag_output else None
        self.procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe,
                                           preexec_fn=rank_preexec_fn()))

    def forward_output(self) -> None:
        """Start the threads that copy each rank's lines to our streams (after every fork: see ``rank_preexec_fn``)."""
        for rank, proc in enumerate(self.procs):
            for pipe, stream in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                reader = threading.Thread(target=_forward_lines, name=f"ninefold-launch-rank{rank}", daemon=True,
                                          args=(pipe, f"[rank {rank}] ".encode(), stream, self.output_lock))
                reader.start()
                self.readers.append(reader)

    def on_signal(self, signum: int, frame) -> None:
        self.signals.append(signum)
        self.signal_all(signal.SIGKILL if len(self.signals) > 1 else signum)

    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to every rank's process group (the rank and whatever it started)."""
        for proc in self.procs:
            _signal_group(proc.pid, signum)

    def supervise(self) -> int:
        """Wait for every rank to end, stopping them all at the first failure or signal."""
        codes: list[int | None] = [None] * len(self.procs)
        failure: int | None = None
        kill_at: float | None = None
        while True:
            for rank, proc in enumerate(self.procs):
                if codes[rank] is None:
                    codes[rank] = proc.poll()
                    if codes[rank] and failure is None and not self.signals:
                        failure = rank
                        with self.output_lock:
                            _say(f"ninefold launch: rank {rank} {describe_exit(codes[rank])}; stopping the other ranks")
                        self.signal_all(signal.SIGTERM)
            if all(code is not None for code in codes):
                break
            if kill_at is None and (failure is not None or self.signals):
                kill_at = time.monotonic() + self.grace_s
            if kill_at is not None and time.monotonic() >= kill_at:
                self.signal_all(signal.SIGKILL)
                kill_at = math.inf
            time.sleep(_POLL_S)
        if self.signals:
            return 128 + self.signals[0]
        return 0 if failure is None else exit_code(codes[failure])

    def stop(self) -> None:
        """End whatever is left of the job (ranks, their children) and reap it; runs on every path out."""
        left = [proc.pid for proc in self.procs if proc.poll() is None or _group_exists(proc.pid)]
        for pid in left:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(_group_has_live_members(pid) for pid in left):
            time.sleep(_POLL_S)
        for pid in left:
            _signal_group(pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        deadline = time.monotonic() + 1.0  # a process that left its group may hold a pipe open for ever
        for reader in self.readers:
            reader.join(timeout=max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def _forwarding_signals(job: _Job):
    """While active (and only in the main thread), the signals in FORWARDED_SIGNALS go to ``job.on_signal``.

    A signal the launcher was started ignoring stays ignored, as its ranks inherit.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in FORWARDED_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, job.on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _forward_lines(pipe, prefix: bytes, stream, lock: threading.Lock) -> None:
    """Copy ``pipe`` to ``stream`` line by line, each line whole and prefixed; a last line without a
    newline gets one. Keeps reading after ``stream`` breaks, so that the rank never blocks on a full pipe."""
    broken = False
    with pipe:
        for line in iter(pipe.readline, b""):
            if broken:
                continue
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                try:
                    _write(stream, prefix + line)
                except (OSError, ValueError, AttributeError):  # a closed or broken stream, or none
                    broken = True


def _write(stream, data: bytes) -> None:
    buffer = getattr(stream, "buffer", None)
    stream.flush()
    if buffer is None:
        stream.write(data.decode(getattr(stream, "encoding", None) or "utf-8", "replace"))
        stream.flush()
    else:
        buffer.write(data)
        buffer.flush()


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):
        pass


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _group_has_live_members(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies do not count: a rank's orphaned
    children belong to whoever adopted them, which may reap them late or never."""
    if not _group_exists(pgid):
        return False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()  # the name in parentheses may hold spaces
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


_PR_SET_PDEATHSIG = 1


def rank_preexec_fn():
    """A ``preexec_fn`` that puts a rank in a process group of its own and, on Linux, makes it receive
    SIGKILL if the launcher dies without stopping it (SIGKILL, an OOM kill): the one path on which the
    launcher cannot clean up.

    It runs between fork and exec, with other threads possibly frozen mid-work, so everything it
    needs is looked up here, before the fork.
    """
    setpgid, getppid, kill, getpid = os.setpgid, os.getppid, os.kill, os.getpid
    launcher = os.getpid()
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            pass

    def setup() -> None:
        setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if getppid() != launcher:  # the launcher died before the line above
                kill(getpid(), signal.SIGKILL)

    return setup


def _check_command(command, env: dict[str, str]) -> list[str]:
    accepted = "a non-empty list of strings: the program, then its arguments, e.g. ['python', 'train.py']"
    if isinstance(command, (str, bytes)) or not isinstance(command, (list, tuple)):
        raise TypeError(f"command: got {command!r} ({type(command).__name__}); expected {accepted}")
    if not command:
        raise ValueError(f"command: got an empty list; expected {accepted}")
    if not all(isinstance(part, str) for part in command):
        raise TypeError(f"command: got {command!r}; expected {accepted}")
    program = command[0]
    path = env.get("PATH", os.environ.get("PATH"))
    if os.sep in program:
        runnable = os.path.isfile(program) and os.access(program, os.X_OK)
    else:
        runnable = shutil.which(program, path=path) is not None
    if not runnable:
        raise ValueError(f"command: program {program!r} was not found; expected a program on PATH or the path "
                         f"of an executable file")
    return list(command)


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); expected an int >= 1")
    if value < 1:
        raise ValueError(f"{name}: got {value}; expected an int >= 1")


def _check_master_addr(value) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"master_addr: got {value!r}; expected a host name or IP address of this host, "
                        f"e.g. '127.0.0.1'")


def _check_port(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); expected a TCP port, an int in "
                        f"[1, 65535], or None for a free one")
    if not 1 <= value <= 65535:
        raise ValueError(f"{name}: got {value}; expected a TCP port, an int in [1, 65535], or None for a free one")


def _check_seconds(name: str, value, *, allow_zero: bool = True) -> None:
    accepted = "a finite number of seconds " + (">= 0" if allow_zero else "> 0")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); expected {accepted}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}: got {value!r}; expected {accepted}")


def _check_env(env) -> dict[str, str]:
    """``env`` as a dict of extra variables; refuses non-strings and the names the launcher sets."""
    if env is None:
        return {}
    accepted = "a dict of str to str (extra environment variables), or None"
    if not isinstance(env, dict):
        raise TypeError(f"env: got {env!r} ({type(env).__name__}); expected {accepted}")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"env: got {key!r}: {value!r}; expected {accepted}")
    taken = sorted(set(env) & set(RENDEZVOUS_NAMES))
    if taken:
        raise ValueError(f"env: sets {', '.join(taken)}, which the launcher sets for each rank; expected "
                         f"other names than {', '.join(RENDEZVOUS_NAMES)}")
    return dict(env)


if __name__ == "__main__":
    from ninefold.cli.launch import main  # the command line sits above comm: imported only when run as one

    sys.exit(main())
