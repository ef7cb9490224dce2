"""Rank 0 of a tensor-parallel engine: it starts the worker processes and drives them.

The engine runs in the caller's process as rank 0: it schedules, samples and holds the output
layer. Ranks 1..N-1 are processes of ``python -m ninefold.llm.parallel.worker``, started here with
the rendezvous on their command line, each loading its own slice of the checkpoint. Every model call
of rank 0 (``ParallelModel``) first sends the workers the same call, then runs its own slice; the
all-reduces inside the layers keep the ranks in step.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
import weakref

import torch

from ninefold.llm.parallel import protocol
from ninefold.llm.parallel.protocol import Op
from ninefold.llm.parallel.rank_model import TensorParallel

DEFAULT_TIMEOUT_S = 600.0
FAILURE_EXIT_WAIT_S = 2.0  # after a failed collective, how long to look for the worker that exited


class WorkerGroup:
    """The worker processes of one tensor-parallel engine, and rank 0's communicator with them."""

    def __init__(self, size: int, device: torch.device, *, timeout_s: float | None = None):
        import torch.distributed as dist

        from ninefold.comm.launch import free_port

        if dist.is_initialized():  # init() would join that world instead of meeting the workers
            raise RuntimeError(
                "tensor_parallel_size: this process already runs a torch.distributed job (another tensor-parallel "
                "engine that is not closed, torchrun, or the caller's own init_process_group); a tensor-parallel "
                "engine starts and owns its group: close the other engine (LLM.close()) or use "
                "tensor_parallel_size=1 inside a distributed job")
        if timeout_s is None:
            timeout_s = _timeout_from_environment()
        self.size, self.device = size, device
        self.devices = rank_devices(device, size)
        self.failed: str | None = None
        self.comm = self.parallel = None
        init_method = f"tcp://127.0.0.1:{free_port()}"
        threads = max(1, torch.get_num_threads() // size)
        self.procs, ready = [], []
        # what outlives this object if it is dropped without shutdown(): stopped by the finalizer
        self._held = {"procs": self.procs, "threads": torch.get_num_threads() if device.type == "cpu" else None}
        for rank in range(1, size):
            read_end, write_end = os.pipe()
            command = [sys.executable, "-m", "ninefold.llm.parallel.worker", "--rank", str(rank),
                       "--world-size", str(size), "--init-method", init_method, "--device", str(self.devices[rank]),
                       "--timeout-s", str(timeout_s), "--threads", str(threads), "--ready-fd", str(write_end),
                       "--parent-pid", str(os.getpid())]
            try:  # a session of its own: a terminal's Ctrl-C reaches rank 0 only, which stops the workers
                self.procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(write_end,),
                                                   start_new_session=True))
            finally:
                os.close(write_end)
            ready.append(read_end)
        self._finalizer = weakref.finalize(self, _release, self._held)
        if device.type == "cpu":
            torch.set_num_threads(threads)  # the ranks share this machine's cores (given back at shutdown)
        self._wait_ready(ready, timeout_s)
        self.comm = self._held["comm"] = self._rendezvous(init_method, timeout_s)
        try:
            self.parallel = self._held["parallel"] = TensorParallel(self.comm, 0, size, peers_gone=self.workers_gone,
                                                                    timeout_s=timeout_s)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def workers_gone(self) -> str | None:
        """Which workers have exited, and how (None while all run): for waits that cannot see it otherwise."""
        gone = [f"rank {rank} (exit code {p.returncode})" for rank, p in enumerate(self.procs, 1)
                if p.poll() is not None]
        return ", ".join(gone) if gone else None

    def _wait_ready(self, pipes: list[int], timeout_s: float) -> None:
        """Wait until every worker has started (imports done, about to join): a worker that exits before is an
        error now, and rank 0 never enters a rendezvous that cannot complete."""
        waiting = dict(zip(pipes, range(1, self.size)))
        deadline = time.monotonic() + timeout_s
        try:
            while waiting:
                readable, _, _ = select.select(list(waiting), [], [], 0.2)
                for fd in readable:
                    if os.read(fd, 1):
                        del waiting[fd]
                    else:  # the end of file without the byte: the worker exited
                        self._raise_exited(waiting[fd])
                if time.monotonic() > deadline:
                    self.shutdown()
                    raise RuntimeError(f"tensor_parallel_size: worker ranks {sorted(waiting.values())} did not "
                                       f"start within {timeout_s:.0f} s")
        finally:
            for fd in pipes:
                os.close(fd)

    def _raise_exited(self, rank: int) -> None:
        proc = self.procs[rank - 1]
        code = proc.wait()
        self.shutdown()
        raise RuntimeError(f"tensor_parallel_size: worker rank {rank} exited with code {code} before joining the "
                           "group (its error is printed above)")

    def _rendezvous(self, init_method: str, timeout_s: float):
        """Rank 0's communicator; a worker that exits while joining is an error now, not after the timeout
        (the joining thread is then left to its timeout)."""
        import ninefold.comm as nc

        result: dict = {}

        def join() -> None:
            try:
                result["comm"] = nc.init(device=self.devices[0], rank=0, world_size=self.size,
                                         init_method=init_method, timeout_s=timeout_s)
            except BaseException as error:  # handed to the caller's thread
                result["error"] = error

        thread = threading.Thread(target=join, name="ninefold-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            dead = [rank for rank, p in enumerate(self.procs, 1) if p.poll() is not None]
            if dead and thread.is_alive():
                self._raise_exited(dead[0])
        if "error" in result:
            self.shutdown()
            raise result["error"]
        return result["comm"]

    def setup(self, **settings) -> None:
        """Tell the workers what to load (``worker.load_rank_model``'s keywords)."""
        self.comm.broadcast_object(settings)

    def agree_loaded(self, error: BaseException | None, what: str = "load") -> None:
        """Every rank says whether it managed ``what``; raise (on rank 0) naming the ranks that did not."""
        mine = None if error is None else f"{type(error).__name__}: {error}"
        problems = [(rank, text) for rank, text in enumerate(self.comm.all_gather_object(mine)) if text is not None]
        if problems:
            message = f"tensor-parallel workers failed to {what}: " + "; ".join(
                f"rank {rank}: {text}" for rank, text in problems)
            self.failed = self.failed or message  # later calls say why the group stopped
            self.shutdown()
            if error is not None:
                raise error
            raise RuntimeError(message)

    def send(self, header: bytes, payload: torch.Tensor | None = None, objects: list | None = None) -> None:
        """Hand every worker one command (and broadcast its payload, or send worker rank ``r`` its own pickled
        ``objects[r - 1]``)."""
        if self.failed is not None:
            raise RuntimeError(f"the tensor-parallel group stopped after an error: {self.failed}")
        if self.comm is None:
            raise RuntimeError("the tensor-parallel group is closed (LLMEngine.close())")
        try:
            for p in self.procs:
                p.stdin.write(header)
                p.stdin.flush()
            if payload is not None:
                self.comm.broadcast(payload, src=0)
            for rank, obj in enumerate(objects or (), 1):
                self.comm.send_object(obj, rank)
        except (OSError, RuntimeError) as error:
            self.fail(error)
            raise RuntimeError(f"the tensor-parallel workers are gone: {self.workers_gone() or 'none exited yet'}") \
                from error
        except BaseException as error:  # Ctrl-C mid-command: the workers may be a call ahead of rank 0 now
            self.fail(error)
            raise

    def fail(self, error: BaseException) -> None:
        """Stop the workers after an error on rank 0 mid-call: the ranks' collectives are out of step."""
        if self.failed is None:
            # a killed worker's socket can close before the process is reaped: give its exit a moment to show
            deadline = time.monotonic() + FAILURE_EXIT_WAIT_S
            while (gone := self.workers_gone()) is None and time.monotonic() < deadline:
                time.sleep(0.02)
            self.failed = f"{type(error).__name__}: {error}" + (f" (tensor-parallel workers gone: {gone})" if gone else "")
        self.shutdown(graceful=False)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (a STOP command, then the end of their input) and close the communicator."""
        if graceful and self.failed is None and all(p.poll() is None for p in self.procs):
            try:
                for p in self.procs:
                    p.stdin.write(protocol.encode_command(Op.STOP))
                    p.stdin.flush()
            except OSError:
                pass
        self._finalizer()
        self.comm = self.parallel = None


def _timeout_from_environment() -> float:
    text = os.environ.get("NINEFOLD_TP_TIMEOUT_S")
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"NINEFOLD_TP_TIMEOUT_S: expected a positive number of seconds, got {text!r}")
    return value


def _release(held: dict) -> None:
    """Stop the workers, close the shared memory and the communicator, give back the CPU threads."""
    _stop(held["procs"])
    for name in ("parallel", "comm"):
        resource = held.pop(name, None)
        if resource is not None:
            resource.close()
    if held.get("threads"):
        torch.set_num_threads(held.pop("threads"))


def _stop(procs: list, grace_s: float = 10.0) -> None:
    """Close the workers' input (they exit at its end), then kill any left after ``grace_s``."""
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """The device of each rank: the CPU for every rank, or consecutive GPUs from ``device``'s index."""
    if device.type == "cpu":
        return [device] * size
    if device.type != "cuda":
        raise ValueError(f"tensor_parallel_size: supported on 'cpu' and 'cuda' devices, got {device}")
    first = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if first + size > count:
        raise ValueError(f"tensor_parallel_size: {size} ranks need GPUs cuda:{first}..cuda:{first + size - 1}, "
                         f"but this process sees {count}")
    return [torch.device("cuda", first + rank) for rank in range(size)]


class ParallelModel:
    """Rank 0's model in a tensor-parallel engine: every forward pass and cache binding is sent to the
    workers first, then run on rank 0's slice. Everything else is the slice's (``model``)."""

    def __init__(self, model, group: WorkerGroup):
        self.__dict__["model"] = model
        self.__dict__["group"] = group

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, lora=None) -> torch.Tensor:
        """The hidden states of the whole model (every rank computes its slice; ``lora``: rank 0's ``LoRAStep``,
        whose rows' slots the workers apply to theirs)."""
        header, payload = protocol.encode_forward(input_ids, positions, meta,
                                                  None if lora is None else lora.row_slots)
        self.group.send(header, payload)
        try:
            return self.model.forward(input_ids, positions, meta, lora=lora)
        except BaseException as error:
            self.group.fail(error)
            raise

    def bind_kv_cache(self, pool) -> None:
        """Bind ``pool`` here, and a pool of as many blocks (of each rank's heads) on every worker."""
        self.group.send(protocol.encode_command(Op.BIND_KV_CACHE, pool.num_blocks))
        try:
            self.model.bind_kv_cache(pool)
        except BaseException as error:
            self.group.fail(error)
            raise
        self.group.agree_loaded(None, "allocate their KV cache")

    def write_lora(self, slot: int, adapter, config, dtype: torch.dtype) -> None:
        """Put ``adapter`` (a whole ``ninefold.llm.lora.Adapter`` of model ``config``; None: nothing) in LoRA slot
        ``slot`` of every worker, each sent only its own slices, in the slots' ``dtype``; raise (the group
        stopped) naming a worker that could not."""
        from dataclasses import replace

        from ninefold.llm.parallel.sharding import shard_lora, shard_plan

        def slices(rank: int):
            weights = shard_lora(adapter.weights, config, shard_plan(config, rank, self.group.size))
            return replace(adapter, weights={key: (a.to(dtype), b.to(dtype)) for key, (a, b) in weights.items()})

        shards = [None if adapter is None else slices(rank) for rank in range(1, self.group.size)]
        self.group.send(protocol.encode_command(Op.LORA_SLOT, slot), objects=shards)
        self.group.agree_loaded(None, f"load a LoRA adapter into slot {slot}")

    def fit_rope(self, context: int) -> None:
        """Rebuild the rotary table for ``context`` here and on every worker (longrope's factors follow it)."""
        self.group.send(protocol.encode_command(Op.FIT_ROPE, context))
        self.model.fit_rope(context)

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.model, name, value)
