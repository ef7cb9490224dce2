"""Paged attention: ``reshape_and_cache``, ``attention_prefill`` and ``attention_decode``.

KV caches are ``[num_blocks, block_size, Hk, D]``; token ``p`` of a sequence lives in block
``block_tables[b, p // block_size]`` at offset ``p % block_size``. Query heads map onto KV heads
in groups (GQA): query head ``h`` reads KV head ``h // (Hq // Hk)``.

The caches hold the model's dtype, or FP8 codes (``KV_FP8``, ``float8_e4m3fn``: vLLM's ``kv_cache_dtype="fp8"``
without scales): writes round to the nearest code (values beyond +-448 saturate), reads widen the codes to the
query's dtype (Triton's kernels under bfloat16 queries: codes and queries both to float16, queries saturating at
+-65504, ``ops/triton/fp8_operand.py``). Half the bytes of bfloat16 per token, so twice the tokens in the same memory and half the bytes a
decode step reads from the cache.
"""

from __future__ import annotations

import functools
import inspect
import math

import numpy as np
import torch

from ninefold.ops import spec
from ninefold.ops.dispatch import Operator
from ninefold.ops.registry import register
from ninefold.runtime.kv_pool import as_bytes

KV_FP8 = torch.float8_e4m3fn


def fp8_cache(k_cache: torch.Tensor) -> tuple:
    """What an FP8 cache adds to an operator's key: its bytes per value, 1 (nothing for a cache of the model's dtype:
    keys, and the tuning tables that hold them, stay as they were)."""
    return (1,) if k_cache.dtype == KV_FP8 else ()


def _cache_checks(op: str, ref_name: str, ref, k_cache, v_cache) -> None:
    spec.tensor(op, "k_cache", k_cache, ndim=4)
    spec.tensor(op, "v_cache", v_cache, ndim=4)
    if v_cache.shape != k_cache.shape:
        raise spec.OpError(f"{op}: v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    spec.same_device(op, ref_name, ref, k_cache=k_cache, v_cache=v_cache)
    if KV_FP8 in (k_cache.dtype, v_cache.dtype):
        if k_cache.dtype != v_cache.dtype:
            raise TypeError(f"{op}: k_cache is {spec.dtype_name(k_cache.dtype)} but v_cache is "
                            f"{spec.dtype_name(v_cache.dtype)}; both hold {ref_name}'s dtype or both FP8 codes")
        return
    spec.same_dtype(op, ref_name, ref, k_cache=k_cache, v_cache=v_cache)


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def fp8_codes(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an FP8 cache stores it: rounded to the nearest ``KV_FP8`` code, saturating at +-448 (the clamp
    first: CUDA's conversion turns values beyond the range into NaN where the CPU's saturates)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(KV_FP8)


def _as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` as ``as_bytes(cache)`` holds them (FP8: ``fp8_codes`` as bytes)."""
    return fp8_codes(x).view(torch.uint8) if cache.dtype == KV_FP8 else x


def _scale(op: str, scale) -> None:
    if scale is not None:
        spec.positive_float(op, "scale", scale)


def _gqa(op: str, hq: int, hk: int) -> None:
    if hk == 0 or hq % hk:
        raise spec.OpError(f"{op}: query heads ({hq}) must be a multiple of KV heads ({hk})")


def _reshape_and_cache_key(key, value, k_cache, v_cache, slot_mapping):
    op = "reshape_and_cache"
    spec.tensor(op, "key", key, ndim=3)
    spec.tensor(op, "value", value, ndim=3)
    if value.shape != key.shape:
        raise spec.OpError(f"{op}: value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    spec.same_dtype(op, "key", key, value=value)
    _cache_checks(op, "key", key, k_cache, v_cache)
    t, hk, d = key.shape
    if k_cache.shape[2:] != key.shape[1:]:
        raise spec.OpError(f"{op}: k_cache must be [num_blocks, block_size, {hk}, {d}] to match key, "
                           f"got {tuple(k_cache.shape)}")
    spec.tensor(op, "slot_mapping", slot_mapping, ndim=1)
    spec.integer(op, "slot_mapping", slot_mapping)
    spec.shape(op, "slot_mapping", slot_mapping, (t,), " (one slot per token)")
    spec.same_device(op, "key", key, value=value, slot_mapping=slot_mapping)
    contiguous = k_cache.is_contiguous() and v_cache.is_contiguous() and key.stride(-1) == 1 and value.stride(-1) == 1
    return key.device, key.dtype, (spec.pow2(t), hk, d, k_cache.shape[1]) + fp8_cache(k_cache), contiguous


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value ``[T, Hk, D]`` into the paged caches in place.

    ``slot_mapping[t] = block * block_size + offset`` (int64 ``[T]``); a negative slot (padding's ``-1``) skips token ``t``.
    Slots must be distinct and inside the cache (not checked on the host).
    """
    _RESHAPE_AND_CACHE.call(key, value, k_cache, v_cache, slot_mapping)


def _check_paged(op, block_tables, lengths, num_blocks, bs, lengths_name, min_length=1):
    """Host-side checks of paged-cache metadata (CPU tensors): every length fits its block table,
    and the blocks it reads are inside the cache (entries past a sequence's length are not read)."""
    lengths, tables = lengths.numpy(), block_tables.numpy()  # (numpy: a third of torch's per-call overhead)
    capacity = tables.shape[1] * bs
    low, high = int(lengths.min()), int(lengths.max())
    if low < min_length or high > capacity:
        raise spec.OpError(f"{op}: {lengths_name} must lie in {min_length}..{capacity} (block_tables' "
                           f"{tables.shape[1]} blocks of {bs} tokens), got values from {low} to {high}")
    used = np.arange(tables.shape[1])[None, :] < ((lengths.astype(np.int64) + bs - 1) // bs)[:, None]
    ids = tables[used]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise spec.OpError(f"{op}: block_tables must hold block ids in [0, {num_blocks}) (the cache's blocks) "
                           f"where sequences read, got values from {int(ids.min())} to {int(ids.max())}")


def _check_cu_seqlens(op, tq, cu_seqlens_q, cu_seqlens_k, k, block_tables, k_cache, bs):
    """Host-side checks of a prefill call's sequence offsets (CPU tensors): the queries cover q exactly,
    the keys stay inside k (packed) or inside each block table and the cache (paged)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if cq[0] != 0 or cq[-1] != tq:
        raise spec.OpError(f"{op}: cu_seqlens_q must run from 0 to q's {tq} tokens, got {cq[0]} to {cq[-1]}")
    if ck[0] != 0:
        raise spec.OpError(f"{op}: cu_seqlens_k must start at 0, got {ck[0]}")
    if block_tables is None:
        if ck[-1] > k.shape[0]:
            raise spec.OpError(f"{op}: cu_seqlens_k must end within k's {k.shape[0]} tokens, got {ck[-1]}")
    elif len(ck) > 1:
        keys = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        _check_paged(op, block_tables, keys, k_cache.shape[0], bs, "cu_seqlens_k's per-sequence key counts",
                     min_length=0)


def _decode_key(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    op = "attention_decode"
    spec.tensor(op, "q", q, ndim=3)
    _cache_checks(op, "q", q, k_cache, v_cache)
    b, hq, d = q.shape
    _, bs, hk, dk = k_cache.shape
    if dk != d:
        raise spec.OpError(f"{op}: k_cache head size {dk} differs from q's {d}")
    _gqa(op, hq, hk)
    spec.tensor(op, "block_tables", block_tables, ndim=2)
    spec.integer(op, "block_tables", block_tables)
    spec.shape(op, "block_tables", block_tables, (b, None), " ([batch, max_blocks])")
    spec.tensor(op, "context_lens", context_lens, ndim=1)
    spec.integer(op, "context_lens", context_lens)
    spec.shape(op, "context_lens", context_lens, (b,), " (one length per sequence)")
    spec.same_device(op, "q", q, block_tables=block_tables, context_lens=context_lens)
    _scale(op, scale)
    contiguous = k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    capacity = spec.pow2(block_tables.shape[1] * bs)
    return q.device, q.dtype, (spec.pow2(b), hq, hk, d, bs, capacity) + fp8_cache(k_cache), contiguous


def _decode_values(q, k_cache, v_cache, block_tables, context_lens, scale=None) -> None:
    if q.device.type == "cpu" and q.shape[0]:  # (on GPUs reading them would synchronise)
        _check_paged("attention_decode", block_tables, context_lens, k_cache.shape[0], k_cache.shape[1],
                     "context_lens")


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """One query token per sequence over the paged KV cache.

    q ``[B, Hq, D]``; block_tables int32 ``[B, max_blocks]``; context_lens int32 ``[B]``: keys
    per sequence, the current token included (already written by ``reshape_and_cache``), >= 1.
    ``scale`` defaults to ``1/sqrt(D)``. Returns ``[B, Hq, D]`` in q's dtype. On CPUs the lengths
    and the block ids they read are checked (``OpError``); on GPUs they are not (that would synchronise).
    """
    return _DECODE.call(q, k_cache, v_cache, block_tables, context_lens, scale)


def _prefill_key(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, k_cache=None, v_cache=None, block_tables=None,
                 max_seqlen_q=None, max_seqlen_k=None):
    op = "attention_prefill"
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise spec.OpError(f"{op}: {name} must be a positive int (the longest sequence's length) or None, "
                               f"got {value!r}")
    spec.tensor(op, "q", q, ndim=3)
    tq, hq, d = q.shape
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        spec.tensor(op, name, cu, ndim=1)
        spec.integer(op, name, cu)
        spec.same_device(op, "q", q, **{name: cu})
    if cu_seqlens_q.shape[0] < 2 or cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise spec.OpError(f"{op}: cu_seqlens_q and cu_seqlens_k must both be [B + 1] with B >= 1, got "
                           f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    _scale(op, scale)
    if block_tables is None:
        if k_cache is not None or v_cache is not None:
            raise spec.OpError(f"{op}: k_cache/v_cache need block_tables (pass block_tables to read the paged cache)")
        spec.tensor(op, "k", k, ndim=3)
        spec.tensor(op, "v", v, ndim=3)
        if v.shape != k.shape:
            raise spec.OpError(f"{op}: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        if k.shape[2] != d:
            raise spec.OpError(f"{op}: k head size {k.shape[2]} differs from q's {d}")
        spec.same_device(op, "q", q, k=k, v=v)
        spec.same_dtype(op, "q", q, k=k, v=v)
        hk, bs = k.shape[1], 0
        contiguous = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    else:
        if k_cache is None or v_cache is None:
            raise spec.OpError(f"{op}: block_tables needs k_cache and v_cache")
        _cache_checks(op, "q", q, k_cache, v_cache)
        _, bs, hk, dk = k_cache.shape
        if dk != d:
            raise spec.OpError(f"{op}: k_cache head size {dk} differs from q's {d}")
        spec.tensor(op, "block_tables", block_tables, ndim=2)
        spec.integer(op, "block_tables", block_tables)
        spec.shape(op, "block_tables", block_tables, (batch, None), " ([batch, max_blocks])")
        spec.same_device(op, "q", q, block_tables=block_tables)
        contiguous = q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    _gqa(op, hq, hk)
    fp8 = fp8_cache(k_cache) if k_cache is not None else ()
    return q.device, q.dtype, (spec.pow2(tq), spec.pow2(batch), hq, hk, d, bs) + fp8, contiguous


def _prefill_values(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, k_cache=None, v_cache=None, block_tables=None,
                    max_seqlen_q=None, max_seqlen_k=None) -> None:
    if q.device.type == "cpu":  # (on GPUs reading them would synchronise)
        bs = 0 if block_tables is None else k_cache.shape[1]
        _check_cu_seqlens("attention_prefill", q.shape[0], cu_seqlens_q, cu_seqlens_k, k, block_tables, k_cache, bs)


def attention_prefill(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, *, scale: float | None = None, k_cache: torch.Tensor | None = None,
                      v_cache: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
                      max_seqlen_q: int | None = None, max_seqlen_k: int | None = None) -> torch.Tensor:
    """Causal attention over packed variable-length sequences.

    Sequence ``b`` has queries ``q[cu_q[b]:cu_q[b+1]]`` and ``Lk_b = cu_k[b+1] - cu_k[b]`` keys;
    its queries are its last ``Lq_b`` tokens, so query ``i`` sees keys ``j <= Lk_b - Lq_b + i``.
    Keys/values come from packed k/v ``[Tk, Hk, D]`` or, with ``block_tables``, from the paged
    caches (a cached prefix plus the new tokens, already written by ``reshape_and_cache``).
    Returns ``[Tq, Hq, D]``. ``max_seqlen_q``/``max_seqlen_k``: optional upper bounds on the
    longest ``Lq_b``/``Lk_b`` known to the caller (the scheduler); ``vendor_varlen`` sizes its
    launch with them (else with ``Tq``/``Tk``, correct but with idle programs), the others
    ignore them. The ``vendor`` implementation reads ``cu_seqlens`` on the host. On CPUs the offsets
    (``cu_seqlens_q`` from 0 to ``Tq``, keys inside k or inside each block table) and the block ids
    read are checked (``OpError``); on GPUs they are not (that would synchronise).
    """
    return _PREFILL.call(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables, max_seqlen_q,
                         max_seqlen_k)


_RESHAPE_AND_CACHE = Operator("reshape_and_cache", reshape_and_cache, _reshape_and_cache_key)
_DECODE = Operator("attention_decode", attention_decode, _decode_key, _decode_values)
_PREFILL = Operator("attention_prefill", attention_prefill, _prefill_key, _prefill_values)


@register("reshape_and_cache", "vendor")
def _reshape_and_cache_torch(key, value, k_cache, v_cache, slot_mapping):
    bs = k_cache.shape[1]
    slots = slot_mapping.long()
    if key.device.type == "cpu":
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() and int(slots.max()) >= k_cache.shape[0] * bs:
            raise spec.OpError(f"reshape_and_cache: slot_mapping holds {int(slots.max())}, past the cache's "
                               f"{k_cache.shape[0] * bs} slots")
        as_bytes(k_cache)[slots // bs, slots % bs] = _as_cached(key, k_cache)
        as_bytes(v_cache)[slots // bs, slots % bs] = _as_cached(value, v_cache)
        return
    # Without a host sync: skipped tokens write to slot 0 the value slot 0 ends up with anyway.
    valid = slots >= 0
    target = torch.where(valid, slots, 0)
    writes_zero = valid & (slots == 0)
    first = writes_zero.to(torch.int32).argmax()
    for src, cache in ((key, k_cache), (value, v_cache)):
        rows, held = _as_cached(src, cache), as_bytes(cache)
        row0 = torch.where(writes_zero.any(), rows[first], held[0, 0])
        held[target // bs, target % bs] = torch.where(valid[:, None, None], rows, row0)


def _gather_pages(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, n]`` block ids -> ``[B, n * block_size, Hk, D]`` tokens, in ``dtype`` (FP8 codes widened)."""
    b, n = tables.shape
    pages = as_bytes(cache).index_select(0, tables.reshape(-1)).view(cache.dtype)
    return pages.view(b, n * cache.shape[1], cache.shape[2], cache.shape[3]).to(dtype)


@register("attention_decode", "vendor")
def _attention_decode_torch(q, k_cache, v_cache, block_tables, context_lens, scale):
    b, hq, d = q.shape
    num_blocks, bs, hk, _ = k_cache.shape
    n = block_tables.shape[1]
    if b == 0:
        return q.new_empty(q.shape)
    if q.device.type == "cpu":  # reading lengths is free on the CPU: gather only the used blocks
        n = max(1, min(n, -(-int(context_lens.max()) // bs)))
    tables = block_tables[:, :n].long().clamp(0, num_blocks - 1)
    k = _gather_pages(k_cache, tables, q.dtype).transpose(1, 2)  # [B, Hk, L, D]
    v = _gather_pages(v_cache, tables, q.dtype).transpose(1, 2)
    visible = (torch.arange(k.shape[2], device=q.device)[None, :] < context_lens[:, None])[:, None, None, :]
    # GQA without copies: the query heads of one KV head become that head's query rows.
    out = torch.nn.functional.scaled_dot_product_attention(q.reshape(b, hk, hq // hk, d), k, v, attn_mask=visible,
                                                           scale=scale or 1.0 / math.sqrt(d))
    return out.reshape(b, hq, d)


@register("attention_prefill", "vendor")
def _attention_prefill_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables, *_):
    tq, hq, d = q.shape
    scale = scale or 1.0 / math.sqrt(d)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = q.new_empty(tq, hq, d)
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if lq > lk or lq < 0:
            raise spec.OpError(f"attention_prefill: sequence {b} has {lq} queries but {lk} keys "
                               "(cu_seqlens must be non-decreasing with Lq <= Lk)")
        if lq == 0:
            continue
        if block_tables is None:
            kb, vb = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        else:
            bs = k_cache.shape[1]
            tables = block_tables[b:b + 1, : -(-lk // bs)].long()
            kb, vb = _gather_pages(k_cache, tables, q.dtype)[0, :lk], _gather_pages(v_cache, tables, q.dtype)[0, :lk]
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]  # [1, Hq, Lq, D]
        mask = None
        if lq != lk:  # queries are the last lq tokens: bottom-right aligned causal mask
            rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            mask = torch.arange(lk, device=q.device)[None, :] <= rows
        ob = torch.nn.functional.scaled_dot_product_attention(
            qb, kb.transpose(0, 1)[None], vb.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=hq != kb.shape[1])
        out[cu_q[b]:cu_q[b + 1]] = ob[0].transpose(0, 1)
    return out


@functools.cache
def _varlen_attn():
    """torch's packed-sequence flash attention (``torch.nn.attention.varlen.varlen_attn``) and the
    keyword names its version takes, or ``None`` where this torch has none. Looked up on first use:
    importing it pulls in torch's compiler stack (about 2 s), which CPU-only processes never need."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


VARLEN_UNBOUNDED_SEQS = 8  # without max_seqlen_q the launch has Tq / 128 row blocks per sequence: few sequences only


def _varlen_supports(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables, max_seqlen_q=None,
                     max_seqlen_k=None) -> str | None:
    varlen = _varlen_attn()
    if varlen is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    names = varlen[1]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention takes float16/bfloat16, not {spec.dtype_name(q.dtype)}"
    if block_tables is not None:
        return "reads no paged cache (packed k/v only)"
    if "is_causal" not in names and "window_size" not in names:
        return "this torch's varlen_attn has no causal mode"
    if scale is not None and "scale" not in names and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return "this torch's varlen_attn takes no scale"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"head size {q.shape[-1]} is not a multiple of 8 up to 256"
    if max_seqlen_q is None and cu_seqlens_q.shape[0] - 1 > VARLEN_UNBOUNDED_SEQS:
        return f"more than {VARLEN_UNBOUNDED_SEQS} sequences need max_seqlen_q (else most of the launch is idle)"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "the head dimension of q, k or v is not contiguous"
    return None


@register("attention_prefill", "vendor_varlen", devices=("cuda",), supports=_varlen_supports, priority={"cuda": 5})
def _attention_prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables,
                              max_seqlen_q=None, max_seqlen_k=None):
    """Packed sequences in one flash-attention launch. Without the caller's maxima the launch is
    sized by the token totals (a bound: programs past a sequence's end exit at once), so nothing
    is read back from the device. GQA is native; the causal mask is bottom-right aligned."""
    fn, names = _varlen_attn()
    kwargs = {}
    if "is_causal" in names:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if "scale" in names:
        kwargs["scale"] = scale
    if "enable_gqa" in names:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    return fn(q, k, v, cu_q, cu_k, max_seqlen_q or max(1, q.shape[0]), max_seqlen_k or max(1, k.shape[0]), **kwargs)
