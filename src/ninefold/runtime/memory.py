"""Two memory classes: weights (``WeightStore``) and per-step scratch (``Workspace``).

The third, the KV cache, is ``ninefold.runtime.kv_pool.KVCachePool``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping

import torch

from ninefold.runtime.device import Device

__all__ = ["WeightStore", "Workspace", "WeightsDoNotFit"]

ALIGN = 256  # bytes; every tensor starts on this boundary, enough for any vector load


class WeightsDoNotFit(ValueError):
    """The weights need more memory than the device has free; ``needed`` and ``available`` are bytes."""

    def __init__(self, message: str, *, needed: int, available: int):
        super().__init__(message)
        self.needed = needed
        self.available = available


class WeightStore(Mapping):
    """A model's weights in one allocation made at load time and kept for the process's life.

    Build it with ``WeightStore(tensors, device, dtype=None)``: every tensor is copied into one
    buffer (floating-point tensors converted to ``dtype`` when given); a tensor listed under two
    names (tied embeddings) is stored once. Read it like a dict of name -> tensor. ``nbytes`` is
    what the tensors hold, ``allocated_bytes`` the buffer (with alignment padding). Checks the
    device's free memory first and raises ``WeightsDoNotFit`` with both numbers.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], device: str | torch.device | Device = "cpu",
                 dtype: torch.dtype | None = None):
        if not isinstance(tensors, Mapping):
            raise TypeError(f"tensors: expected a mapping of name -> torch.Tensor, got {type(tensors).__name__}")
        if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype: expected None, torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
        self.device = Device(device)
        layout: dict[str, tuple[int, torch.Size, torch.dtype]] = {}
        first_name: dict[tuple, str] = {}
        offset = 0
        for name, tensor in tensors.items():
            if not isinstance(name, str):
                raise TypeError(f"tensors: names must be str, got {type(name).__name__} {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensors[{name!r}]: expected a torch.Tensor, got {type(tensor).__name__}")
            key = (tensor.device, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
            if tensor.numel() and key in first_name:
                layout[name] = layout[first_name[key]]
                continue
            first_name[key] = name
            out_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            layout[name] = (offset, tensor.shape, out_dtype)
            offset += _aligned(tensor.numel() * _itemsize(out_dtype))
        free = self.device.available_bytes()
        if offset > free:
            raise WeightsDoNotFit(f"tensors: the weights need {offset} bytes but {self.device.torch} has {free} free",
                                  needed=offset, available=free)
        for name, tensor in tensors.items():
            if tensor.is_meta:
                raise ValueError(f"tensors[{name!r}]: a meta tensor holds no data to store; load its values first")
        self._buffer = torch.empty(offset, dtype=torch.uint8, device=self.device.torch)
        self._tensors: dict[str, torch.Tensor] = {}
        copied: set[int] = set()  # aliases share one layout entry and are copied once
        # Without autograd: a copy of a parameter that requires grad would record the copy, so the stored
        # weights would require grad and keep the source tensors alive through their grad_fn.
        with torch.no_grad():
            for name, entry in layout.items():
                view = _carve(self._buffer, *entry)
                if id(entry) not in copied:
                    view.copy_(tensors[name])
                    copied.add(id(entry))
                self._tensors[name] = view
        unique = {id(entry): entry for entry in layout.values()}.values()
        self.nbytes = sum(shape.numel() * _itemsize(dt) for _, shape, dt in unique)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the one buffer that holds every weight."""
        return self._buffer.numel()

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"name: no weight {name!r} in this store ({len(self._tensors)} weights)") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"WeightStore({len(self)} tensors, {self.nbytes} bytes on {self.device.torch})"


class Workspace:
    """Named scratch tensors, one set per stream, reused from step to step.

    ``get(name, shape, dtype)`` returns a view of a buffer that is allocated the first time and
    re-used afterwards (grown when a larger shape is asked for), so a steady-state step allocates
    nothing. Buffers of different streams never alias, so concurrent streams can use the same names.
    The contents are whatever the previous user left.

    ``nbytes`` is what the workspace holds now; ``allocations`` counts every buffer it has allocated
    since it was made (growth and re-allocation after ``clear()`` included), like the cumulative
    counters of ``torch.cuda.memory_stats()`` that ``torch.cuda.empty_cache()`` leaves alone: a steady
    loop is one that leaves it unchanged.
    """

    def __init__(self, device: str | torch.device | Device = "cpu"):
        self.device = Device(device)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.allocations = 0

    def get(self, name: str, shape, dtype: torch.dtype, *, stream=None) -> torch.Tensor:
        """A ``shape`` tensor of ``dtype`` named ``name`` for ``stream`` (default: the current one)."""
        if not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
        shape = _shape(shape)
        key = (_stream_key(stream if stream is not None else self.device.current_stream()), name)
        nbytes = shape.numel() * _itemsize(dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            available = self.device.available_bytes()
            if _aligned(nbytes) > available:
                raise ValueError(f"shape: {tuple(shape)} of {dtype} needs {nbytes} bytes but {self.device.torch} has "
                                 f"{available} available")
            buffer = torch.empty(_aligned(nbytes), dtype=torch.uint8, device=self.device.torch)
            self._buffers[key] = buffer
            self.allocations += 1
        return _carve(buffer, 0, shape, dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held across every stream's buffers."""
        return sum(b.numel() for b in self._buffers.values())

    def clear(self) -> None:
        """Release every buffer: ``nbytes`` drops to 0 and the next ``get`` of each name allocates again
        (counted in ``allocations``, which is cumulative and not reset here)."""
        self._buffers.clear()

    def __repr__(self) -> str:
        return (f"Workspace({len(self._buffers)} buffers, {self.nbytes} bytes on {self.device.torch}; "
                f"{self.allocations} allocations since created)")


def _shape(shape) -> torch.Size:
    """``shape`` (an int or a sequence of ints >= 0) as a ``torch.Size``."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list, torch.Size)):
        raise TypeError(f"shape: expected an int or a sequence of ints, got {type(shape).__name__} {shape!r}")
    sizes = []
    for n in shape:
        try:
            sizes.append(operator.index(n) if not isinstance(n, bool) else None)
        except TypeError:
            sizes.append(None)
    if None in sizes:
        raise TypeError(f"shape: expected ints, got {tuple(shape)!r}")
    if any(n < 0 for n in sizes):
        raise ValueError(f"shape: sizes must be >= 0, got {tuple(sizes)}")
    return torch.Size(sizes)


def _stream_key(stream) -> tuple:
    stream_id = getattr(stream, "stream_id", None)
    if stream_id is None:
        return ("host",)
    return (getattr(stream, "device_type", None), getattr(stream, "device_index", None), stream_id)


def _carve(buffer: torch.Tensor, start: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    nbytes = shape.numel() * _itemsize(dtype)
    return buffer[start:start + nbytes].view(dtype).view(shape)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
