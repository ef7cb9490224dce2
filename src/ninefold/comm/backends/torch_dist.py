"""NCCL and Gloo through ``torch.distributed`` process groups."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ninefold.comm.backends.base import Backend, CommError, DoneWork, ReduceOp, Work

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}
_GLOO_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                torch.int32, torch.int64, torch.bool)
_NCCL_DTYPES = _GLOO_DTYPES
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _TorchWork:
    """A torch ``Work`` plus what must happen after it (AVG's division) and what must stay alive until then."""

    def __init__(self, work, what: str, after=None, keep=()):
        self._work, self._what, self._after, self._keep = work, what, after, keep
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        try:
            self._work.wait()
        except RuntimeError as e:
            raise CommError(f"{self._what} failed: {e}") from e
        if self._after is not None:
            self._after()
        self._done = True
        self._keep = ()

    def is_completed(self) -> bool:
        """Whether the operation has finished; True also means its result is in place (AVG divided)."""
        if not self._done and self._work.is_completed():
            self.wait()
        return self._done


class TorchDistBackend(Backend):
    """One ``torch.distributed`` process group: ``name`` is "nccl" or "gloo"."""

    def __init__(self, name: str, group, ranks: list[int]):
        if name not in ("nccl", "gloo"):
            raise ValueError(f"name: expected 'nccl' or 'gloo', got {name!r}")
        self.name, self._group, self._ranks = name, group, list(ranks)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._closed = False

    @property
    def process_group(self):
        """The torch.distributed process group underneath."""
        return self._group

    @property
    def global_ranks(self) -> list[int]:
        """The members' ranks in the default (world) group."""
        return list(self._ranks)

    def unsupported(self, device_type: str, dtype: torch.dtype, op: ReduceOp | None = None) -> str | None:
        want = "cuda" if self.name == "nccl" else "cpu"
        if device_type != want:
            return f"{self.name} here carries {want} tensors, not {device_type} tensors"
        dtypes = _NCCL_DTYPES if self.name == "nccl" else _GLOO_DTYPES
        if dtype not in dtypes:
            return f"{self.name} carries {', '.join(str(d).removeprefix('torch.') for d in dtypes)}, not {dtype}"
        if op is not None and dtype == torch.bool and op != ReduceOp.MAX and op != ReduceOp.MIN:
            return f"reducing bool tensors with {op.value!r}: only 'max' (or) and 'min' (and) are defined"
        if op == ReduceOp.AVG and dtype not in _FLOATS:
            return f"'avg' of {dtype} tensors: averaging needs a floating-point dtype"
        return None

    def _run(self, what: str, call, async_op: bool, after=None, keep=()) -> Work:
        self._check_open(what)
        try:
            work = call(async_op)
        except RuntimeError as e:
            raise CommError(f"{what} over {self.name} failed: {e}") from e
        if async_op:
            return _TorchWork(work, f"{what} over {self.name}", after, keep)
        if after is not None:
            after()
        return DoneWork()

    def _reduce_args(self, op: ReduceOp, tensor: torch.Tensor):
        """The torch op, and what to do afterwards (AVG outside NCCL is SUM, then a division)."""
        if op == ReduceOp.AVG and self.name != "nccl":
            return dist.ReduceOp.SUM, lambda: tensor.detach().div_(self.world_size)
        return (dist.ReduceOp.AVG if op == ReduceOp.AVG else _TORCH_OPS[op]), None

    def all_reduce(self, tensor, op, async_op):
        top, after = self._reduce_args(op, tensor)
        return self._run("all_reduce", lambda a: dist.all_reduce(tensor, op=top, group=self._group, async_op=a),
                         async_op, after, (tensor,))

    def all_gather(self, out, tensor, async_op):
        return self._run("all_gather", lambda a: _all_gather(out.view(-1), tensor.view(-1), group=self._group,
                                                             async_op=a), async_op, keep=(out, tensor))

    def reduce_scatter(self, out, tensor, op, async_op):
        top, after = self._reduce_args(op, out)
        return self._run("reduce_scatter", lambda a: _reduce_scatter(out.view(-1), tensor.view(-1), op=top,
                                                                     group=self._group, async_op=a),
                         async_op, after, (out, tensor))

    def broadcast(self, tensor, src, async_op):
        return self._run("broadcast", lambda a: dist.broadcast(tensor, group_src=src, group=self._group,
                                                               async_op=a), async_op, keep=(tensor,))

    def reduce(self, tensor, dst, op, async_op):
        top, after = self._reduce_args(op, tensor)
        div = (lambda: tensor.detach().div_(self.world_size)) if after is not None and self.rank == dst else None
        return self._run("reduce", lambda a: dist.reduce(tensor, group_dst=dst, op=top, group=self._group,
                                                         async_op=a), async_op, div, (tensor,))

    def all_to_all(self, out, tensor, async_op):
        return self._run("all_to_all", lambda a: dist.all_to_all_single(out.view(-1), tensor.view(-1),
                                                                        group=self._group, async_op=a),
                         async_op, keep=(out, tensor))

    def send(self, tensor, dst, tag, async_op):
        if async_op:
            return self._run("send", lambda a: dist.isend(tensor, group_dst=dst, group=self._group, tag=tag),
                             True, keep=(tensor,))
        return self._run("send", lambda a: dist.send(tensor, group_dst=dst, group=self._group, tag=tag), False)

    def recv(self, tensor, src, tag, async_op):
        if async_op:
            return self._run("recv", lambda a: dist.irecv(tensor, group_src=src, group=self._group, tag=tag),
                             True, keep=(tensor,))
        return self._run("recv", lambda a: dist.recv(tensor, group_src=src, group=self._group, tag=tag), False)

    def barrier(self) -> None:
        self._check_open("barrier")
        try:
            if self.name == "nccl":  # a one-element all-reduce: NCCL's barrier guesses a device
                flag = torch.zeros(1, device="cuda")
                dist.all_reduce(flag, group=self._group)
                torch.cuda.current_stream().synchronize()
            else:
                dist.barrier(group=self._group)
        except RuntimeError as e:
            raise CommError(f"barrier over {self.name} failed: {e}") from e

    def split(self, ranks: list[int]) -> TorchDistBackend | None:
        self._check_open("split")
        if self.rank not in ranks:
            return None
        members = [self._ranks[r] for r in ranks]
        try:
            group = dist.new_group(members, backend=self.name, use_local_synchronization=True)
        except RuntimeError as e:
            raise CommError(f"split over {self.name} into ranks {ranks} failed: {e}") from e
        return TorchDistBackend(self.name, group, members)

    def close(self) -> None:
        """Destroy this backend's process group (the world's is left to whoever started torch.distributed)
        and drop the reference to it, so that the group and its threads end once torch lets go of it too.

        A group still alive when the interpreter shuts down can abort the process: a Gloo worker thread that
        releases a finished Work's tensor then needs the GIL, Python ends that thread, and the unwinding
        crosses a noexcept destructor ("terminate called without an active exception")."""
        if self._closed:
            return
        self._closed = True
        group, self._group = self._group, None
        if group is not None and group is not dist.GroupMember.WORLD:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CommError(f"{what}: this {self.name} communicator was closed")
