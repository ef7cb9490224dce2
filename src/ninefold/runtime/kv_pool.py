"""The KV cache memory class: fixed-size blocks of per-layer key/value storage with ref-counts.

Block ids index dimension 0 of every layer's ``k_cache(layer)`` / ``v_cache(layer)``
(``[num_blocks, block_size, num_kv_heads, head_dim]``). When the pool runs out, its policy says what
the caller does: ``"preempt"`` (free the victim's blocks and recompute it later) or ``"swap"`` (copy the
victim's blocks to pinned host memory with ``swap_out`` and back with ``swap_in``).

On accelerators swaps run on a copy stream of their own and never block the host. Ordering is kept
with events: a swap-out copy waits for the work queued before it; a block freed while a kernel may
still read it carries an event, and whoever takes it next on another stream waits for that event.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import operator
from collections import Counter, deque
from collections.abc import Callable, Iterable

import torch

from ninefold.runtime.device import Device, host_memory_info

__all__ = ["KVCacheExhausted", "KVCachePool"]

POLICIES = ("preempt", "swap")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8)


# vLLM's kv_cache_dtype names -> what the cache holds (None: the model's dtype; both fp8 names: e4m3 codes, no scale).
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` to index, copy or send: FP8 codes as their bytes (indexing float8 is not implemented on every device,
    nor is float8 carried by every communication backend); other tensors as they are."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _zero_filled(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros for the pool. In host memory they come from an anonymous mapping, whose pages the
    kernel zero-fills on first touch: the process pays time and resident memory only for the blocks
    that sequences use, not for the whole budget up front."""
    if device.type != "cpu" or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(1, count * dtype.itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


class KVCacheExhausted(RuntimeError):
    """Fewer KV cache blocks (or bytes) are available than were asked for.

    ``needed`` and ``available`` hold the two numbers, in ``unit`` (``"blocks"``, ``"host blocks"``
    or ``"bytes"``).
    """

    def __init__(self, message: str, *, needed: int, available: int, unit: str):
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.unit = unit


class KVCachePool:
    """Paged key/value storage for ``num_layers`` layers plus the block bookkeeping.

    ``policy`` is ``"preempt"`` or ``"swap"``; with ``"swap"``, ``num_host_blocks`` (> 0) blocks of
    pinned host memory receive swapped-out blocks. ``watermark`` is the fraction of blocks that
    ``can_allocate`` keeps free (headroom so that running sequences can grow without preemption).
    The storage is zero-filled. Asking for more than the device has free raises ``KVCacheExhausted``
    at once (in bytes) instead of an out-of-memory error later.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device | Device,
        num_blocks: int,
        *,
        policy: str = "preempt",
        num_host_blocks: int = 0,
        watermark: float = 0.01,
    ):
        for arg, value in [("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                           ("block_size", block_size), ("num_blocks", num_blocks)]:
            _check_int(arg, value, minimum=1)
        _check_int("num_host_blocks", num_host_blocks, minimum=0)
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
            raise TypeError(f"dtype: expected one of {', '.join(map(str, _DTYPES))}, got {dtype!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
        if policy == "swap" and num_host_blocks == 0:
            raise ValueError("num_host_blocks: policy 'swap' needs at least 1 host block, got 0")
        if policy == "preempt" and num_host_blocks != 0:
            raise ValueError(f"num_host_blocks: policy 'preempt' keeps no host blocks, got {num_host_blocks}")
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"watermark: expected a fraction in [0, 1), got {watermark!r}")

        self.device = Device(device)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.dtype, self.policy = block_size, dtype, policy
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.watermark_blocks = int(watermark * num_blocks)

        needed = num_blocks * self.bytes_per_block
        free = self.device.available_bytes()
        if needed > free:
            raise KVCacheExhausted(
                f"num_blocks: {num_blocks} blocks need {needed} bytes but {self.device.torch} has {free} bytes available",
                needed=needed, available=free, unit="bytes")
        host_needed = num_host_blocks * self.bytes_per_block
        host_free, _ = host_memory_info()
        if not self.device.is_accelerator:
            host_free = max(0, free - needed)  # on the CPU both kinds of block come out of the same memory
        if host_needed > host_free:
            raise KVCacheExhausted(
                f"num_host_blocks: {num_host_blocks} blocks need {host_needed} bytes of host memory, {host_free} free"
                + ("" if self.device.is_accelerator else f" after the {num_blocks} device blocks ({needed} bytes)"),
                needed=host_needed, available=host_free, unit="bytes")

        shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self._kv = _zero_filled((shape[0], 2, num_blocks, *shape[2:]), dtype, self.device.torch)
        self._host = self.device.empty_host((num_host_blocks, *shape), dtype)

        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._host_used = [False] * num_host_blocks
        self._host_free: deque[int] = deque(range(num_host_blocks))
        # Accelerators only: block id -> (event after which it may be reused, recorded on the copy stream?).
        self._fence: dict[int, tuple[object, bool]] = {}
        self._copy_stream = self.device.stream() if self.device.is_accelerator else None
        self._last_copy = None

    # -- sizing -----------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers, keys and values."""
        return bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)

    @classmethod
    def from_memory(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device | Device,
        *,
        memory_fraction: float = 0.9,
        reserved_bytes: int = 0,
        weight_bytes: int = 0,
        activation_bytes: int = 0,
        profile_fn: Callable[[], object] | None = None,
        num_blocks: int | None = None,
        min_blocks: int = 1,
        policy: str = "preempt",
        swap_bytes: int = 0,
        watermark: float = 0.01,
        instance_fraction: float | None = None,
        instance_used_bytes: int = 0,
    ) -> KVCachePool:
        """A pool sized from the device's free memory.

        The KV budget is ``free - (1 - memory_fraction) * total - weight_bytes - activation_bytes -
        reserved_bytes``, where ``free`` counts memory torch's allocator holds unused: ``weight_bytes``
        counts weights not loaded yet (loaded ones are already out of ``free``), ``activation_bytes`` the
        activation peak, or ``profile_fn`` (a forward pass at the largest batch) is run and its measured peak
        used. So ``memory_fraction`` bounds the whole device's use, whoever else holds memory on it.

        ``instance_fraction`` (vLLM's ``gpu_memory_utilization``) bounds only the pool's owner instead: its
        budget is ``instance_fraction * total - instance_used_bytes - weight_bytes - activation_bytes -
        reserved_bytes`` (``instance_used_bytes``: what the owner already holds, its loaded weights), and never
        more than ``free`` less the same reserves; ``memory_fraction`` is then not used.

        Without ``num_blocks`` the pool takes every block that fits (at least ``min_blocks``); with it, exactly
        that many. Either way, asking for more than fits raises ``KVCacheExhausted`` with the needed and
        available bytes. ``swap_bytes`` of pinned host memory become host blocks (policy ``"swap"``).
        """
        _check_fraction("memory_fraction", memory_fraction)
        if instance_fraction is not None:
            _check_fraction("instance_fraction", instance_fraction, "None or ")
        for arg, value in [("reserved_bytes", reserved_bytes), ("weight_bytes", weight_bytes),
                           ("activation_bytes", activation_bytes), ("swap_bytes", swap_bytes),
                           ("instance_used_bytes", instance_used_bytes)]:
            _check_int(arg, value, minimum=0)
        _check_int("min_blocks", min_blocks, minimum=1)
        if num_blocks is not None:
            _check_int("num_blocks", num_blocks, minimum=1)
        if profile_fn is not None and not callable(profile_fn):
            raise TypeError(f"profile_fn: expected None or a callable, got {type(profile_fn).__name__}")
        dev = Device(device)
        per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        if policy == "swap" and swap_bytes < per_block:
            raise ValueError(f"swap_bytes: policy 'swap' needs room for at least one host block ({per_block} bytes), "
                             f"got {swap_bytes}")
        if policy == "preempt" and swap_bytes:
            raise ValueError(f"swap_bytes: policy 'preempt' keeps no host blocks, so it must be 0, got {swap_bytes}")

        if profile_fn is not None:
            activation_bytes = max(activation_bytes, dev.peak_bytes(profile_fn))
            empty_cache = getattr(dev.module, "empty_cache", None) if dev.is_accelerator else None
            if empty_cache is not None:
                empty_cache()
        _, total = dev.memory_info()
        free = dev.available_bytes()
        host_blocks = swap_bytes // per_block
        # On the CPU the host blocks that receive swapped-out blocks come out of the same memory.
        swap_share = 0 if dev.is_accelerator else host_blocks * per_block
        reserves = weight_bytes + activation_bytes + reserved_bytes + swap_share
        if instance_fraction is None:
            headroom = int(total * (1 - memory_fraction))
            budget = free - headroom - reserves
            limit = f"minus headroom {headroom} (memory_fraction={memory_fraction})"
        else:
            allowed = int(total * instance_fraction)
            budget = min(allowed - instance_used_bytes, free) - reserves
            limit = (f"this instance may use {allowed} (instance_fraction={instance_fraction}) and holds "
                     f"{instance_used_bytes}")
        fits = max(0, budget) // per_block
        wanted = num_blocks if num_blocks is not None else min_blocks
        if wanted > fits:
            raise KVCacheExhausted(
                f"KV cache: {wanted} blocks need {wanted * per_block} bytes ({per_block} per block) but only "
                f"{max(0, budget)} are available on {dev.torch}: {free} free of {total}, {limit}, "
                f"weights {weight_bytes}, activation peak {activation_bytes}, "
                f"reserved {reserved_bytes}" + (f", swap space {swap_share}" if swap_share else ""),
                needed=wanted * per_block, available=max(0, budget), unit="bytes")
        return cls(num_layers, num_kv_heads, head_dim, block_size, dtype, dev,
                   num_blocks if num_blocks is not None else fits,
                   policy=policy, num_host_blocks=host_blocks, watermark=watermark)

    # -- storage ----------------------------------------------------------------------------------

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self._kv[self._layer(layer), 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self._kv[self._layer(layer), 1]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape :meth:`read_blocks` gives per block: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def read_blocks(self, ids: Iterable[int]) -> torch.Tensor:
        """A copy of blocks ``ids``, ``[len(ids), num_layers, 2, block_size, num_kv_heads, head_dim]`` (contiguous,
        on the pool's device): what :meth:`write_blocks` of a pool with the same layout takes."""
        ids = self._ids("ids", ids)
        index = torch.tensor(ids, dtype=torch.long, device=self._kv.device)
        return as_bytes(self._kv).index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous().view(self.dtype)

    def write_blocks(self, ids: Iterable[int], data: torch.Tensor) -> None:
        """Overwrite blocks ``ids`` with ``data`` as :meth:`read_blocks` returns it (any device; same dtype)."""
        ids = self._ids("ids", ids)
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"data: expected a torch.Tensor, got {type(data).__name__}")
        want = (len(ids), *self.block_shape)
        if tuple(data.shape) != want:
            raise ValueError(f"data: expected shape {want} (blocks, layers, k/v, block_size, kv_heads, head_dim), "
                             f"got {tuple(data.shape)}")
        if data.dtype != self.dtype:
            raise TypeError(f"data: expected {self.dtype} like the pool, got {data.dtype}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"ids: expected distinct block ids, got {ids}")
        index = torch.tensor(ids, dtype=torch.long, device=self._kv.device)
        as_bytes(self._kv).index_copy_(2, index, as_bytes(data.to(self._kv.device, non_blocking=True)).permute(1, 2, 0, 3, 4, 5))

    def copy_blocks(self, sources: Iterable[int], targets: Iterable[int]) -> None:
        """Copy blocks ``sources`` onto blocks ``targets`` (pairwise, every layer's keys and values) on the pool's
        device, in stream order with the steps that write and read them."""
        sources, targets = self._ids("sources", sources), self._ids("targets", targets)
        if len(sources) != len(targets):
            raise ValueError(f"targets: {len(targets)} given for {len(sources)} sources")
        for source, target in zip(sources, targets):  # (no index tensor to upload: nothing waits for the device)
            self._kv[:, :, target].copy_(self._kv[:, :, source])

    # -- bookkeeping ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks not held by anyone."""
        return len(self._free)

    @property
    def num_free_host(self) -> int:
        """Host blocks free to receive swapped-out blocks."""
        return len(self._host_free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, from 0 to 1."""
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` blocks can be taken while keeping the watermark's blocks free."""
        _check_int("n", n, minimum=0)
        return len(self._free) - n >= self.watermark_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref-count 1 each); raises ``KVCacheExhausted`` if fewer are free."""
        ids = self._take(n, stream_is_copy=False)
        for i in ids:
            self._ref[i] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add one reference to each block in ``ids`` (a block listed twice gains two)."""
        ids = self._ids("ids", ids)
        for i in ids:
            if self._ref[i] == 0:
                raise ValueError(f"ids: block {i} is free; only allocated blocks can gain references")
        for i in ids:
            self._ref[i] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference from each block in ``ids``; a block at zero returns to the free list.

        Freeing a block that is already free raises ``ValueError`` and changes nothing.
        """
        ids = self._ids("ids", ids)
        for i, times in Counter(ids).items():
            if self._ref[i] < times:
                raise ValueError(f"ids: block {i} freed {times} time(s) but holds {self._ref[i]} reference(s) (double free)")
        event = self._record_current() if self.device.is_accelerator else None
        for i in ids:
            self._ref[i] -= 1
            if self._ref[i] == 0:
                self._release(i, event, on_copy=False)

    def ref_count(self, block_id: int) -> int:
        """How many holders block ``block_id`` has (0 = free)."""
        return self._ref[self._ids("block_id", [block_id])[0]]

    # -- swapping ---------------------------------------------------------------------------------

    def swap_out(self, ids: Iterable[int]) -> list[int]:
        """Copy blocks ``ids`` to host blocks, drop one reference from each, and return the host ids.

        The copy waits for work already queued on the current stream and runs on the copy stream;
        work queued afterwards overlaps with it.
        """
        ids = self._require_swap("swap_out", self._ids("ids", ids))
        if len(set(ids)) != len(ids):
            raise ValueError(f"ids: each block may be swapped out once per call, got {ids}")
        for i in ids:
            if self._ref[i] == 0:
                raise ValueError(f"ids: block {i} is free; only allocated blocks can be swapped out")
        if len(ids) > len(self._host_free):
            raise KVCacheExhausted(
                f"swap_out: {len(ids)} host blocks needed, {len(self._host_free)} free of {self.num_host_blocks}",
                needed=len(ids), available=len(self._host_free), unit="host blocks")
        if not ids:
            return []
        host_ids = list(itertools.islice(self._host_free, len(ids)))  # taken once the copy is queued

        if self._copy_stream is not None:
            self._copy_stream.wait_stream(self.device.current_stream())
        with self._on_copy_stream():
            index = self._device_index(ids)
            staged = as_bytes(self._kv).movedim(2, 0).index_select(0, index)  # [n, L, 2, bs, Hk, D], contiguous
            for j, h, n in _runs(host_ids):
                as_bytes(self._host[h:h + n]).copy_(staged[j:j + n], non_blocking=True)
            event = self._record_copy()
        for h in host_ids:
            self._host_free.popleft()
            self._host_used[h] = True
        for i in ids:
            self._ref[i] -= 1
            if self._ref[i] == 0:
                self._release(i, event, on_copy=True)
        return host_ids

    def swap_in(self, host_ids: Iterable[int], *, wait: bool = True) -> list[int]:
        """Copy host blocks back into newly allocated device blocks (ref-count 1); returns their ids.

        The host blocks become free. With ``wait`` (default) the current stream waits for the copy, so
        anything queued next may read the blocks; with ``wait=False`` the copy overlaps with what is
        queued next and the caller calls ``wait_for_swaps()`` before touching the blocks.
        """
        host_ids = self._require_swap("swap_in", _index_list("host_ids", host_ids, self.num_host_blocks, "host block"))
        for h in host_ids:
            if not self._host_used[h]:
                raise ValueError(f"host_ids: host block {h} holds nothing (already swapped in or never swapped out)")
        if len(set(host_ids)) != len(host_ids):
            raise ValueError(f"host_ids: each host block may be swapped in once, got {host_ids}")
        fences = {i: self._fence[i] for i in itertools.islice(self._free, len(host_ids)) if i in self._fence}
        ids = self._take(len(host_ids), stream_is_copy=True)
        if ids:
            try:
                with self._on_copy_stream():
                    staged = torch.empty((len(ids), *self._host.shape[1:]), dtype=self.dtype, device=self.device.torch)
                    for j, h, n in _runs(host_ids):
                        staged[j:j + n].copy_(self._host[h:h + n], non_blocking=True)
                    as_bytes(self._kv).index_copy_(2, self._device_index(ids), as_bytes(staged).movedim(0, 2))
                    self._record_copy()
            except BaseException:
                # Nothing was swapped in: the blocks go back to the front of the free list, with their fences.
                self._free.extendleft(reversed(ids))
                self._fence.update(fences)
                raise
            if wait:
                self.wait_for_swaps()
        for i in ids:
            self._ref[i] = 1
        for h in host_ids:
            self._host_used[h] = False
            self._host_free.append(h)
        return ids

    def wait_for_swaps(self) -> None:
        """Make the current stream wait (on the device, not the host) for every swap issued so far."""
        if self._last_copy is not None:
            self.device.current_stream().wait_event(self._last_copy)

    @property
    def copy_stream(self):
        """The stream swaps run on (None on the CPU, where they are plain synchronous copies)."""
        return self._copy_stream

    def host_block(self, host_id: int) -> torch.Tensor:
        """Host block ``host_id``'s data, ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self._host[_index_list("host_id", [host_id], self.num_host_blocks, "host block")[0]]

    # -- internals --------------------------------------------------------------------------------

    def _take(self, n: int, *, stream_is_copy: bool) -> list[int]:
        _check_int("n", n, minimum=0)
        if n > len(self._free):
            raise KVCacheExhausted(f"allocate: {n} blocks needed, {len(self._free)} free of {self.num_blocks}",
                                   needed=n, available=len(self._free), unit="blocks")
        ids = [self._free.popleft() for _ in range(n)]
        stream = self._copy_stream if stream_is_copy else None
        waited = set()
        for i in ids:
            fence = self._fence.pop(i, None)
            # The copy stream's own order covers its events; any other event is waited for (cheap when it
            # was recorded on the stream that takes the block).
            if fence is not None and not (fence[1] and stream_is_copy) and id(fence[0]) not in waited:
                (stream if stream is not None else self.device.current_stream()).wait_event(fence[0])
                waited.add(id(fence[0]))
        return ids

    def _release(self, block_id: int, event, *, on_copy: bool) -> None:
        self._free.append(block_id)
        if event is not None:
            self._fence[block_id] = (event, on_copy)

    def _on_copy_stream(self):
        return self.device.use_stream(self._copy_stream) if self._copy_stream is not None else contextlib.nullcontext()

    def _device_index(self, ids: list[int]) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.long)
        if not self.device.is_accelerator:
            return index
        # Through pinned memory: a copy from pageable memory would make the host wait for the copy stream.
        return index.pin_memory().to(self.device.torch, non_blocking=True)

    def _record_current(self):
        event = self.device.event()
        event.record(self.device.current_stream())
        return event

    def _record_copy(self):
        if self._copy_stream is None:
            return None
        event = self.device.event()
        event.record(self._copy_stream)
        self._last_copy = event
        return event

    def _require_swap(self, what: str, ids: list[int]) -> list[int]:
        if self.policy != "swap":
            raise ValueError(f"{what}: this pool's policy is {self.policy!r}; swapping needs policy 'swap'")
        return ids

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    def _ids(self, arg: str, ids: Iterable[int]) -> list[int]:
        return _index_list(arg, ids, self.num_blocks, "block")

    def __repr__(self) -> str:
        return (f"KVCachePool(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"device={self.device.torch}, free={self.num_free}, policy={self.policy!r})")


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of such a pool occupies across all layers, keys and values (arguments checked)."""
    for arg, value in [("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                       ("block_size", block_size)]:
        _check_int(arg, value, minimum=1)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def _index_list(arg: str, ids, limit: int, what: str) -> list[int]:
    """``ids`` (an iterable of ints, or an integer tensor) as a list of Python ints in ``[0, limit)``."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{arg}: expected integer {what} ids, got a {ids.dtype} tensor")
        ids = ids.reshape(-1).tolist()
    elif isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"{arg}: expected a list of {what} ids (ints), got {type(ids).__name__} {ids!r}")
    out = []
    for i in ids:
        index = None
        if not isinstance(i, bool) and not (isinstance(i, torch.Tensor) and i.dtype == torch.bool):
            with contextlib.suppress(TypeError):
                index = operator.index(i)  # ints, numpy integers, one-element integer tensors
        if index is None:
            raise TypeError(f"{arg}: expected {what} ids as ints, got {type(i).__name__} {i!r}")
        if not 0 <= index < limit:
            raise ValueError(f"{arg}: expected {what} ids in [0, {limit}), got {index}")
        out.append(index)
    return out


def _runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position, first host id, length)`` of each run of consecutive host ids: one copy per run."""
    runs: list[tuple[int, int, int]] = []
    for j, h in enumerate(host_ids):
        if runs and runs[-1][1] + runs[-1][2] == h:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((j, h, 1))
    return runs


def _check_fraction(arg: str, value, also: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{arg}: expected {also}a fraction in (0, 1], got {value!r}")


def _check_int(arg: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{arg}: expected an int >= {minimum}, got {value}")
