"""Adapters resident on the device, and the per-step computation of their deltas.

``max_loras`` slots hold one adapter each. Per layer and fused matrix (``qkv``, ``o``, ``gate_up``,
``down``) the slots' ``A`` matrices sit side by side in one ``[in, S * R]`` tensor and their ``B``
matrices one above the other in ``[S * R, out]`` (``R`` = ``max_lora_rank`` times the matrix's parts,
ranks below the maximum padded with zeros), so the deltas of a whole step, whatever mix of adapters
its rows use, are two dense matmuls: ``((x @ A) * mask) @ B``, where ``mask[t, c]`` is 1 when column
``c`` belongs to row ``t``'s slot (rows without an adapter match no column). On GPUs two Triton kernels
can compute it where ``NINEFOLD_LORA_KERNELS=1`` (``ninefold.ops.triton.lora``: the first applies the mask
to its reduced ``x @ A``, the second adds ``@ B`` into the output; in the decode graphs only).

Under tensor parallelism every rank holds slots of its own heads' and channels' sizes (``plan``): rank 0's
slots decide which adapter sits where and send each worker its slices of what they write (``mirror``);
a worker's slots only hold what they are sent (``place``).

On CPUs the slots are also kept slot by slot, in bfloat16, for the native decode step (``a_rows``
``[L, S, in, R]``, ``b_tiles`` ``[L, S, ceil(out / 16), R, 16]``): what one row's adapter reads there is
contiguous, the 16 outputs of one kernel group are one run of memory, and half the bytes of float32 are read
(that step rounds its activations to int8 anyway).
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict

import torch

from ninefold.llm.config import ModelConfig
from ninefold.llm.lora.adapter import Adapter, load_adapter, part_sizes
from ninefold.llm.lora.request import LoRARequest


@functools.cache
def lora_kernels():
    """``ninefold.ops.triton.lora`` where ``NINEFOLD_LORA_KERNELS=1`` (opt-in: in an H100's decode graphs they tie with
    torch's matmuls at 1 row and lose 1% at 32 rows and 10% at 128; docs/perf/llm.md, twenty-fifth session)
    and Triton imports; else None (torch's matmuls). Imported on first use: engines without adapters, and CPU
    programs, never load Triton for it."""
    if os.environ.get("NINEFOLD_LORA_KERNELS", "0") != "1":
        return None
    try:
        from ninefold.ops.triton import lora
    except ImportError:
        return None
    return lora


class LoRASlots:
    """The device slots, the adapters read from disk (kept for ``max_cpu_loras`` of them, least recently
    used dropped first) and which slot each adapter in use occupies."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device, max_loras: int,
                 max_rank: int, max_cpu_loras: int | None = None, plan=None, mirror=None):
        """``config``: the whole model's (adapters are checked against it). ``plan``: a tensor-parallel rank's
        ``ShardPlan`` (slots of its slices); ``mirror``: rank 0's ``ParallelModel``, told every slot written or
        cleared (``write_lora``)."""
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.plan, self.mirror, self.dtype = plan, mirror, dtype
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.parts = part_sizes(config if plan is None else plan.local_config(config))
        L = config.num_layers
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for matrix, parts in self.parts.items():
            width = max_loras * max_rank * len(parts)
            self.a[matrix] = torch.zeros((L, parts[0][0], width), dtype=dtype, device=device)
            self.b[matrix] = torch.zeros((L, width, sum(out for _, out in parts)), dtype=dtype, device=device)
        self.a_rows: dict[str, torch.Tensor] = {}
        self.b_tiles: dict[str, torch.Tensor] = {}
        if device.type == "cpu" and plan is None:  # (tensor-parallel ranks run the generic layers)
            for matrix, parts in self.parts.items():
                r, out = max_rank * len(parts), sum(n for _, n in parts)
                self.a_rows[matrix] = torch.zeros((L, max_loras, parts[0][0], r), dtype=torch.bfloat16)
                self.b_tiles[matrix] = torch.zeros((L, max_loras, -(-out // 16), r, 16), dtype=torch.bfloat16)
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self.holder: list[int | None] = [None] * max_loras  # slot -> lora_int_id
        self.adapter_in: list[Adapter | None] = [None] * max_loras  # slot -> the adapter it holds
        self.refs = [0] * max_loras  # slot -> sequences using it
        self._idle: OrderedDict[int, None] = OrderedDict()  # slots holding an adapter nobody uses, oldest first
        self._cached: OrderedDict[int, Adapter] = OrderedDict()  # lora_int_id -> adapter read from disk
        self._names: dict[int, str] = {}  # lora_int_id -> the name it was first loaded under
        self._generation: dict[int, int] = {}  # lora_int_id -> times it was forgotten (unloaded)
        self._lock = threading.Lock()  # requests are checked on callers' threads, slots change on the engine's
        self._load_lock = threading.Lock()  # one adapter read at a time: an id is never read twice at once

    # -- adapters on the host -----------------------------------------------------------------------

    def prepare(self, request: LoRARequest) -> Adapter:
        """``request``'s adapter, read from its files once per id and generation (ValueError if it does not fit
        this model), before the request is queued. An id names fixed weights: files changed in place are read
        again only after ``forget``."""
        lora_id = request.lora_int_id
        with self._load_lock:
            with self._lock:
                known = self._names.get(lora_id)
                if known is not None and known != request.lora_name:
                    raise ValueError(f"lora_request.lora_int_id: {lora_id} already names adapter {known!r}, "
                                     f"not {request.lora_name!r}")
                adapter = self._cached.get(lora_id)
                if adapter is not None:
                    self._cached.move_to_end(lora_id)
                    return adapter
                generation = self._generation.get(lora_id, 0)
                slot = self.slot_of.get(lora_id)
                resident = self.adapter_in[slot] if slot is not None else None
            if resident is not None and resident.generation == generation:  # dropped from the cache, still in a slot
                adapter = resident
            else:
                adapter = load_adapter(request.lora_name, request.lora_path, self.config, self.max_rank)
                adapter.generation = generation
            with self._lock:
                self._names[lora_id] = request.lora_name
                self._cached[lora_id] = adapter
                while len(self._cached) > self.max_cpu_loras:  # (queued requests hold their adapter themselves)
                    self._cached.popitem(last=False)
        return adapter

    def forget(self, lora_int_id: int) -> None:
        """Drop an adapter read earlier: the next request for this id reads its files again, as a new generation
        (its own slot contents and prefix-cache entries; requests queued or running keep the adapter they were
        checked with)."""
        with self._lock:
            self._cached.pop(lora_int_id, None)
            self._names.pop(lora_int_id, None)
            self._generation[lora_int_id] = self._generation.get(lora_int_id, 0) + 1

    # -- device slots -------------------------------------------------------------------------------

    def acquire(self, lora_id: int, adapter: Adapter) -> int | None:
        """The slot holding adapter ``lora_id`` (``adapter``, from ``prepare``), loading it into a free or unused
        one; None when every slot is in use."""
        slot = self.slot_of.get(lora_id)
        if slot is not None and self.adapter_in[slot].generation != adapter.generation:  # unloaded, loaded again
            if self.refs[slot]:
                return None  # requests still run on the adapter it named before
            self._clear(slot)
            slot = None
        if slot is None:
            free = [s for s, holder in enumerate(self.holder) if holder is None]
            if free:
                slot = free[0]
            elif self._idle:
                slot = next(iter(self._idle))
                self._clear(slot)
            else:
                return None
            self._write(slot, adapter)
            self.slot_of[lora_id], self.holder[slot], self.adapter_in[slot] = slot, lora_id, adapter
        self.refs[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        """One sequence stopped using ``slot``; an unused slot keeps its adapter until it is needed."""
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._idle[slot] = None

    def _clear(self, slot: int) -> None:
        del self.slot_of[self.holder[slot]]
        self.holder[slot] = self.adapter_in[slot] = None
        self._idle.pop(slot, None)
        self._zero(slot)
        if self.mirror is not None:
            self.mirror.write_lora(slot, None, self.config, self.dtype)

    def place(self, slot: int, adapter: Adapter | None) -> None:
        """A tensor-parallel worker: hold ``adapter`` (already this rank's slices, ``shard_lora``; None: nothing) in
        ``slot``, as rank 0's slots do now."""
        self.adapter_in[slot] = adapter
        if adapter is None:
            self._zero(slot)
        else:
            self._fill(slot, adapter.weights)

    def _zero(self, slot: int) -> None:
        for matrix, parts in self.parts.items():
            width = self.max_rank * len(parts)
            self.a[matrix][:, :, slot * width : (slot + 1) * width] = 0
            self.b[matrix][:, slot * width : (slot + 1) * width, :] = 0
            if self.a_rows:
                self.a_rows[matrix][:, slot] = 0
                self.b_tiles[matrix][:, slot] = 0

    def _write(self, slot: int, adapter: Adapter) -> None:
        weights = adapter.weights
        if self.plan is not None:
            from ninefold.llm.parallel.sharding import shard_lora

            weights = shard_lora(weights, self.config, self.plan)
        self._fill(slot, weights)
        if self.mirror is not None:
            self.mirror.write_lora(slot, adapter, self.config, self.dtype)

    def _fill(self, slot: int, weights: dict) -> None:
        self._zero(slot)
        for (layer, matrix, part), (a, b) in weights.items():
            parts = self.parts[matrix]
            first = slot * self.max_rank * len(parts) + part * self.max_rank
            out_at = sum(out for _, out in parts[:part])
            A, B = self.a[matrix], self.b[matrix]
            A[layer, :, first : first + a.shape[0]] = a.t().to(A.dtype)
            B[layer, first : first + a.shape[0], out_at : out_at + b.shape[0]] = b.t().to(B.dtype)
        for matrix, parts in self.parts.items() if self.a_rows else ():  # the native step's copies
            width = self.max_rank * len(parts)
            cols = slice(slot * width, (slot + 1) * width)
            self.a_rows[matrix][:, slot] = self.a[matrix][:, :, cols].to(torch.bfloat16)
            b = self.b[matrix][:, cols, :]  # [L, R, out]
            tiles = self.b_tiles[matrix]
            padded = b.new_zeros((b.shape[0], width, tiles.shape[2] * 16))
            padded[:, :, : b.shape[2]] = b
            tiles[:, slot] = padded.view(b.shape[0], width, tiles.shape[2], 16).transpose(1, 2).to(tiles.dtype)

    def matrices_in_use(self) -> set[str]:
        """The fused matrices that some adapter in a slot changes."""
        return {m for adapter in self.adapter_in if adapter is not None for m in adapter.matrices}

    # -- one step -----------------------------------------------------------------------------------

    def step(self, row_slots: torch.Tensor, every_matrix: bool = False, kernels: bool = False) -> LoRAStep:
        """The deltas for a step whose row ``t`` uses slot ``row_slots[t]`` (-1: no adapter), ``[T]`` int64;
        ``every_matrix``: compute them for every projection, not only those the adapters in the slots now
        change (a CUDA graph must not depend on which adapters are loaded). ``kernels``: on GPUs, two Triton
        launches per matrix (``ninefold.ops.triton.lora``) instead of torch's three, for CUDA graphs (eagerly
        their launches cost the host more than they save)."""
        return LoRAStep(self, row_slots, every_matrix, kernels)


class LoRAStep:
    """Adds the adapters' deltas to one step's projections (``add``), building each rank width's mask once."""

    def __init__(self, slots: LoRASlots, row_slots: torch.Tensor, every_matrix: bool = False, kernels: bool = False):
        self.slots = slots
        self.row_slots = row_slots
        self.used = set(slots.parts) if every_matrix else slots.matrices_in_use()
        self.kernels = lora_kernels() if kernels else None
        self._masks: dict[int, torch.Tensor] = {}

    def add(self, layer: int, matrix: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the deltas of ``matrix`` in ``layer`` for inputs ``x`` (``[T, in]``; ``y`` is ``[T, out]``, a
        projection's fresh output: the deltas are added into it in place where its dtype is the slots')."""
        if matrix not in self.used:
            return y
        A, B = self.slots.a[matrix][layer], self.slots.b[matrix][layer]
        if self.kernels is not None and x.is_cuda and self.kernels.supports(x, A, B, y) is None:
            return self.kernels.lora_add(x, A, B, self.row_slots, A.shape[1] // self.slots.max_loras, y)
        down = x.to(A.dtype) @ A
        down *= self._mask(A.shape[1], down.dtype)
        if y.dtype == B.dtype:
            return y.addmm_(down, B)  # the sum in the GEMM's epilogue: one kernel less per matrix, one rounding
        return y + (down @ B).to(y.dtype)

    def _mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        mask = self._masks.get(width)
        if mask is None:
            per_slot = width // self.slots.max_loras
            column_slot = torch.arange(width, device=self.row_slots.device) // per_slot
            mask = self._masks[width] = (self.row_slots[:, None] == column_slot[None, :]).to(dtype)
        return mask
