"""What rank 0 of a tensor-parallel group sends its workers: one command per model call.

A command is a fixed-size int64 header, written to each worker's stdin (a pipe: a worker waits for
the next command as long as the engine stays idle, with no timeout, and sees the end of file when
rank 0 is gone) and, for a forward pass, one int64 payload broadcast on the model's device (NCCL
between GPUs) holding the step's token ids, positions, attention metadata and (with LoRA adapters)
each row's adapter slot back to back. LORA_SLOT is followed by each worker's slices of the adapter
that rank 0 put in that slot (or None), sent to it alone as a pickled object.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from ninefold.llm.models.llama import AttentionMetadata


class Op(enum.IntEnum):
    FORWARD = 1
    BIND_KV_CACHE = 2
    STOP = 3
    FIT_ROPE = 4
    LORA_SLOT = 5


# The tensors of a forward pass, in payload order, with the dtype the model takes them in.
_FIELDS = (("input_ids", torch.int64), ("positions", torch.int64), ("slot_mapping", torch.int64),
           ("block_tables", torch.int32), ("context_lens", torch.int32), ("cu_seqlens_q", torch.int32),
           ("cu_seqlens_k", torch.int32), ("decode_context_lens", torch.int32), ("lora_slots", torch.int64))
_NOT_METADATA = ("input_ids", "positions", "lora_slots")
_FIXED = 6  # op, use_cache, num_decodes, max_seqlen_q, max_seqlen_k, a command's value (blocks, context)
HEADER_SIZE = _FIXED + 3 * len(_FIELDS)
HEADER_BYTES = 8 * HEADER_SIZE


def _optional(value: int | None) -> int:
    return -1 if value is None else int(value)


def encode_forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   lora_slots: torch.Tensor | None = None) -> tuple[bytes, torch.Tensor]:
    """Rank 0: the header and the device payload of one forward pass (``lora_slots``: each row's adapter slot,
    ``LoRAStep.row_slots``; None without adapters)."""
    tensors = {"input_ids": input_ids, "positions": positions, "lora_slots": lora_slots}
    header = np.zeros(HEADER_SIZE, dtype=np.int64)
    header[:5] = (Op.FORWARD, int(meta.use_cache), meta.num_decodes, _optional(meta.max_seqlen_q),
                  _optional(meta.max_seqlen_k))
    parts = []
    for index, (name, _) in enumerate(_FIELDS):
        t = tensors[name] if name in _NOT_METADATA else getattr(meta, name)
        if t is None:
            continue
        if t.dim() > 2:
            raise ValueError(f"{name}: expected at most 2 dimensions, got shape {tuple(t.shape)}")
        header[_FIXED + 3 * index: _FIXED + 3 * index + 3] = (t.dim() + 1, *(*t.shape, 1, 1)[:2])
        parts.append(t.reshape(-1).to(torch.int64))
    return header.tobytes(), torch.cat(parts)


def encode_command(op: Op, value: int = 0) -> bytes:
    """Rank 0: the header of a command without payload (``value``: BIND_KV_CACHE's block count, FIT_ROPE's
    context, LORA_SLOT's slot)."""
    header = np.zeros(HEADER_SIZE, dtype=np.int64)
    header[0], header[5] = int(op), value
    return header.tobytes()


def decode(header: bytes, comm, device: torch.device):
    """A worker: the command in ``header``, receiving a forward pass's payload from rank 0.

    Returns ``(Op.FORWARD, (input_ids, positions, meta, lora_slots or None))``, ``(Op.BIND_KV_CACHE, num_blocks)``,
    ``(Op.FIT_ROPE, context)``, ``(Op.LORA_SLOT, slot)`` or ``(Op.STOP, 0)``."""
    values = np.frombuffer(header, dtype=np.int64).tolist()
    op = Op(values[0])
    if op is not Op.FORWARD:
        return op, values[5]
    shapes = {}
    for index, (name, _) in enumerate(_FIELDS):
        ndim, d0, d1 = values[_FIXED + 3 * index: _FIXED + 3 * index + 3]
        if ndim:
            shapes[name] = ((), (d0,), (d0, d1))[ndim - 1]
    payload = torch.empty(sum(_numel(s) for s in shapes.values()), dtype=torch.int64, device=device)
    comm.broadcast(payload, src=0)
    tensors, offset = {}, 0
    for name, dtype in _FIELDS:
        if name in shapes:
            n = _numel(shapes[name])
            tensors[name] = payload[offset: offset + n].view(shapes[name]).to(dtype)
            offset += n
    ids, positions, lora_slots = tensors.pop("input_ids"), tensors.pop("positions"), tensors.pop("lora_slots", None)
    meta = AttentionMetadata(use_cache=bool(values[1]), num_decodes=values[2],
                             max_seqlen_q=None if values[3] < 0 else values[3],
                             max_seqlen_k=None if values[4] < 0 else values[4], **tensors)
    return op, (ids, positions, meta, lora_slots)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
