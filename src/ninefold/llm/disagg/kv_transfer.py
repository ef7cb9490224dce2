"""A prompt's KV-cache blocks out of one engine, over a communicator, into another engine's prefix cache.

The prefill engine computes a prompt (a request with ``max_tokens=1`` is enough); its full blocks
then sit in the prefix cache. :func:`export_prefix` copies them out, :func:`send_prefix` /
:func:`recv_prefix` move them between ranks of a :class:`ninefold.comm.Communicator` (the blocks over
the transport for their device, e.g. NCCL between GPUs; the header and the token ids over the CPU
transport), and :func:`import_prefix` registers them in the decode engine's prefix cache. A request
for the same prompt on the decode engine then starts after those blocks: it computes only the last,
partial block (at least one token, for the first logits), exactly as a prefix-cache hit.
"""

from __future__ import annotations

import dataclasses

import torch

from ninefold.runtime.kv_pool import as_bytes

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)  # (the header's index: append only)
_HEADER = 9  # token count, block count, the 5 numbers of a block's shape, the dtype's index, the rope fingerprint


@dataclasses.dataclass
class PrefixKV:
    """The KV cache of a prompt's first ``len(blocks)`` full blocks.

    ``token_ids``: the tokens those blocks hold (``len(blocks) * block_size`` of them); ``blocks``:
    ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` as ``KVCachePool.read_blocks`` gives;
    ``rope``: the exporting engine's ``rope_fingerprint`` (its keys are rotated; None: not checked).
    """

    token_ids: list[int]
    blocks: torch.Tensor
    rope: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def export_prefix(engine, token_ids: list[int]) -> PrefixKV:
    """The cached full blocks of ``token_ids`` in ``engine`` (an ``LLMEngine``), up to the first one not cached."""
    token_ids = _token_list(token_ids)
    blocks = engine.blocks.cached_blocks(token_ids)
    data = engine.pool.read_blocks(blocks)
    return PrefixKV(token_ids[: len(blocks) * engine.pool.block_size], data, engine.rope_fingerprint)


def import_prefix(engine, prefix: PrefixKV) -> int:
    """Register ``prefix`` in ``engine``'s prefix cache; returns the blocks written (those not cached already).

    The layouts must agree (layers, block size, KV heads, head dimension, dtype): a ValueError names
    the first that differs."""
    if not isinstance(prefix, PrefixKV):
        raise TypeError(f"prefix: expected a PrefixKV, got {type(prefix).__name__}")
    pool = engine.pool
    _check_layout(tuple(prefix.blocks.shape[1:]), prefix.blocks.dtype, pool.block_shape, pool.dtype)
    _check_rope(prefix.rope, engine)
    if prefix.num_tokens != len(prefix.blocks) * pool.block_size:
        raise ValueError(f"prefix: {len(prefix.blocks)} blocks of {pool.block_size} tokens hold "
                         f"{len(prefix.blocks) * pool.block_size} tokens, got {prefix.num_tokens} token ids")
    return engine.blocks.insert_prefix(prefix.token_ids, prefix.blocks)


def send_prefix(comm, prefix: PrefixKV, dst: int, *, tag: int = 0) -> None:
    """Send ``prefix`` to rank ``dst`` of ``comm``, which calls :func:`recv_prefix`."""
    if not isinstance(prefix, PrefixKV):
        raise TypeError(f"prefix: expected a PrefixKV, got {type(prefix).__name__}")
    if prefix.blocks.dtype not in _DTYPES:
        raise TypeError(f"prefix: blocks of {prefix.blocks.dtype}; KV caches hold {', '.join(map(str, _DTYPES))}")
    header = torch.tensor([prefix.num_tokens, len(prefix.blocks), *prefix.blocks.shape[1:],
                           _DTYPES.index(prefix.blocks.dtype), -1 if prefix.rope is None else prefix.rope],
                          dtype=torch.int64)
    comm.send(header, dst, tag=tag)
    if len(prefix.blocks):
        comm.send(torch.tensor(prefix.token_ids, dtype=torch.int64), dst, tag=tag)
        comm.send(as_bytes(prefix.blocks.contiguous()), dst, tag=tag)


def recv_prefix(comm, src: int, *, device: torch.device | str | None = None, like=None, tag: int = 0) -> PrefixKV:
    """Receive a :class:`PrefixKV` sent by rank ``src`` with :func:`send_prefix`.

    The blocks land on ``device`` (default: the communicator's). With ``like`` (the receiving
    ``LLMEngine``) the layout is checked against its pool before any block is received."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    comm.recv(header, src, tag=tag)
    num_tokens, num_blocks, *shape, dtype_index, rope = (int(v) for v in header)
    if not 0 <= dtype_index < len(_DTYPES) or num_blocks < 0 or num_tokens < 0:
        raise ValueError(f"recv_prefix: rank {src} sent a malformed header {header.tolist()}")
    dtype = _DTYPES[dtype_index]
    rope = None if rope == -1 else rope
    if like is not None:
        _check_layout(tuple(shape), dtype, like.pool.block_shape, like.pool.dtype)
        _check_rope(rope, like)
    device = torch.device(device) if device is not None else comm.device
    if num_blocks == 0:
        return PrefixKV([], torch.empty((0, *shape), dtype=dtype, device=device), rope)
    tokens = torch.empty(num_tokens, dtype=torch.int64)
    comm.recv(tokens, src, tag=tag)
    blocks = torch.empty((num_blocks, *shape), dtype=dtype, device=device)
    comm.recv(as_bytes(blocks), src, tag=tag)
    return PrefixKV(tokens.tolist(), blocks, rope)


def _check_layout(shape: tuple, dtype: torch.dtype, want: tuple, want_dtype: torch.dtype) -> None:
    names = ("num_layers", "k/v", "block_size", "num_kv_heads", "head_dim")
    if len(shape) != len(want):
        raise ValueError(f"prefix: blocks of shape {shape} per block, expected {want} ({', '.join(names)})")
    for name, got, expected in zip(names, shape, want):
        if got != expected:
            raise ValueError(f"prefix: {name} {got} does not match the receiving engine's {expected}")
    if dtype != want_dtype:
        raise ValueError(f"prefix: dtype {dtype} does not match the receiving engine's KV cache ({want_dtype})")


def _check_rope(rope: int | None, engine) -> None:
    want = getattr(engine, "rope_fingerprint", None)
    if rope is not None and want is not None and rope != want:
        raise ValueError("prefix: its keys were rotated with another rotary table than the receiving engine's "
                         "(rope_theta, rope_scaling, or the longrope factors a different max_model_len picks)")


def _token_list(token_ids) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                      for t in token_ids):
        raise TypeError(f"token_ids: expected a list of ints, got {type(token_ids).__name__}")
    return list(token_ids)
