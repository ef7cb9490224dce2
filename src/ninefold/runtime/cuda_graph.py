"""Capture a callable once per batch size and replay it (CUDA graphs); eager elsewhere.

The runner owns static input buffers sized for the largest batch. A call copies its inputs into the
first rows of those buffers, fills the rest with each input's pad value, replays the graph captured
for the smallest batch size that holds the batch, and returns the first ``batch`` rows of the
graph's outputs. Those outputs are views of static memory: the next call overwrites them. On
devices without CUDA graphs (the CPU) the callable is simply called on the inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from ninefold.runtime.device import Device

__all__ = ["CudaGraphRunner"]


class CudaGraphRunner:
    """One captured graph of ``fn`` per batch size in ``batch_sizes``.

    ``fn`` takes tensors whose first dimension is the batch and returns a tensor or a tuple of
    tensors shaped the same way. ``example_inputs`` are inputs at the largest batch size; they fix
    the shapes (beyond the batch dimension), dtypes and devices of the static buffers, and are used
    to warm up and capture. ``pad_values`` (one per input, default 0) fill the rows beyond the
    batch. ``capture()`` runs automatically on the first call.
    """

    def __init__(self, fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], batch_sizes: Sequence[int],
                 example_inputs: Sequence[torch.Tensor], *, device: str | torch.device | Device | None = None,
                 pad_values: Sequence[float] | None = None, warmup: int = 2):
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable):
            raise TypeError(f"batch_sizes: expected a sequence of positive ints, got {type(batch_sizes).__name__} "
                            f"{batch_sizes!r}")
        batch_sizes = list(batch_sizes)
        if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
            raise ValueError(f"batch_sizes: expected positive ints, got {batch_sizes}")
        sizes = sorted(set(batch_sizes))
        if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, Iterable):
            raise TypeError(f"example_inputs: expected a sequence of tensors, got {type(example_inputs).__name__}")
        example_inputs = tuple(example_inputs)
        if not example_inputs or any(not isinstance(x, torch.Tensor) or x.dim() == 0 for x in example_inputs):
            raise TypeError("example_inputs: expected one or more tensors with a batch dimension, got "
                            f"{[tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in example_inputs]}")
        if any(x.shape[0] != sizes[-1] for x in example_inputs):
            raise ValueError(f"example_inputs: the batch dimension must be the largest batch size {sizes[-1]}, "
                             f"got {[x.shape[0] for x in example_inputs]}")
        self.device = Device(device if device is not None else example_inputs[0].device)
        if any(x.device != self.device.torch for x in example_inputs):
            raise ValueError(f"example_inputs: expected tensors on {self.device.torch}, got "
                             f"{[str(x.device) for x in example_inputs]}")
        pad_values = tuple(pad_values) if pad_values is not None else (0,) * len(example_inputs)
        if len(pad_values) != len(example_inputs):
            raise ValueError(f"pad_values: expected {len(example_inputs)} values, got {len(pad_values)}")
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in pad_values):
            raise TypeError(f"pad_values: expected ints or floats, got {list(pad_values)!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup: expected an int >= 0 (eager calls before capture), got {warmup!r}")
        self.fn, self.batch_sizes, self.pad_values, self.warmup = fn, sizes, pad_values, warmup
        self.enabled = self.device.type == "cuda"
        self._static = tuple(x.clone() for x in example_inputs) if self.enabled else example_inputs
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], bool]] = {}

    @property
    def max_batch_size(self) -> int:
        """The largest batch a call may pass."""
        return self.batch_sizes[-1]

    def capture(self, pool=None) -> None:
        """Warm up and capture every batch size (largest first, all in one memory pool: ``pool``, a
        ``torch.cuda.graph_pool_handle()`` another runner's graphs may share, else a new one)."""
        if not self.enabled or self._graphs:
            return
        side = torch.cuda.Stream(self.device.torch)
        side.wait_stream(torch.cuda.current_stream(self.device.torch))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(*self._static)
        torch.cuda.current_stream(self.device.torch).wait_stream(side)
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        graphs = {}
        for size in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            inputs = tuple(x[:size] for x in self._static)
            with torch.cuda.graph(graph, pool=pool):
                out = self.fn(*inputs)
            is_tuple = isinstance(out, tuple)
            graphs[size] = (graph, out if is_tuple else (out,), is_tuple)
        self.device.synchronize()
        self._graphs = graphs  # all or nothing: a capture that raised is tried again by the next call

    def __call__(self, *inputs: torch.Tensor):
        """``fn(*inputs)``, by replaying the captured graph of the smallest batch size that fits."""
        if len(inputs) != len(self._static):
            raise ValueError(f"inputs: expected {len(self._static)} tensors, got {len(inputs)}")
        first = inputs[0]
        batch = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() > 0 else None
        for i, (x, s) in enumerate(zip(inputs, self._static)):
            if (not isinstance(x, torch.Tensor) or x.dim() != s.dim() or x.shape[1:] != s.shape[1:]
                    or x.shape[0] != batch or x.dtype != s.dtype):
                raise ValueError(f"inputs[{i}]: expected a {s.dtype} tensor of shape "
                                 f"[{', '.join(map(str, ['batch' if batch is None else batch, *s.shape[1:]]))}], got "
                                 + (f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__))
            # Host inputs are copied into the static buffers; anything else must be on the runner's device.
            if x.device != s.device and not (self.enabled and x.device.type == "cpu"):
                raise ValueError(f"inputs[{i}]: expected a tensor on {s.device}, got one on {x.device}")
        if not 1 <= batch <= self.max_batch_size:
            raise ValueError(f"inputs: batch size {batch} is outside 1..{self.max_batch_size} (captured: {self.batch_sizes})")
        if not self.enabled:
            return self.fn(*inputs)
        self.capture()
        size = next(b for b in self.batch_sizes if b >= batch)
        for x, static, pad in zip(inputs, self._static, self.pad_values):
            static[:batch].copy_(x, non_blocking=True)
            if size > batch:
                static[batch:size].fill_(pad)
        graph, outputs, is_tuple = self._graphs[size]
        graph.replay()
        sliced = tuple(o[:batch] for o in outputs)
        return sliced if is_tuple else sliced[0]
