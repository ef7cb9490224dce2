"""``rope_cache_attention_decode``: a decode step's attention with the step's rope and cache write folded in.

The same results as ``rope_and_cache`` of the step's q/k/v followed by ``attention_decode`` over the
caches. The vendor implementation is exactly that pair of calls (through dispatch); the Triton one
is the decode attention kernel itself, which rotates q as it loads it, and whose program holding a
row's last position rotates that token's key and writes it and the value to the row's slot before it
reads the cache: one launch per layer fewer, and no kernel of the step writes the cache before the
attention starts.
"""

from __future__ import annotations

import torch

from ninefold.ops import spec
from ninefold.ops.attention import _decode_key, _decode_values, attention_decode
from ninefold.ops.dispatch import Operator
from ninefold.ops.registry import register
from ninefold.ops.rope_cache import _rope_and_cache_key, _rope_and_cache_values, rope_and_cache

OP = "rope_cache_attention_decode"


def _renamed(error: Exception) -> Exception:
    text = str(error)
    for inner in ("rope_and_cache:", "attention_decode:"):
        if text.startswith(inner):
            text = OP + ":" + text[len(inner):]
    return type(error)(text)


def _key(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, context_lens, scale=None,
         is_neox=True):
    try:
        device, dtype, (bucket, hq, hk, d, r, bs, *fp8), neox, rope_ok = _rope_and_cache_key(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox)
        _, _, (_, _, _, _, _, capacity, *_), decode_ok = _decode_key(q, k_cache, v_cache, block_tables, context_lens,
                                                                 scale)
    except (TypeError, ValueError) as error:  # name this operator, not the unfused ones that checked
        raise _renamed(error) from None
    return device, dtype, (bucket, hq, hk, d, r, bs, capacity, *fp8), neox, rope_ok and decode_ok


def _values(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, context_lens, scale=None,
            is_neox=True) -> None:
    try:
        _rope_and_cache_values(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox)
        _decode_values(q, k_cache, v_cache, block_tables, context_lens, scale)
    except (TypeError, ValueError) as error:
        raise _renamed(error) from None
    if q.device.type == "cpu" and q.shape[0]:  # (on GPUs reading them would synchronise)
        _check_last_slots(slot_mapping, block_tables, context_lens, k_cache.shape[1])


def _check_last_slots(slot_mapping, block_tables, context_lens, block_size: int) -> None:
    """Every cached row's slot must be its last position's (``OpError`` naming the first that is not;
    the lengths were checked against the tables before)."""
    last = context_lens.long() - 1
    blocks = block_tables.long().gather(1, (last // block_size)[:, None])[:, 0]
    expected = blocks * block_size + last % block_size
    wrong = (slot_mapping >= 0) & (slot_mapping.long() != expected)
    if bool(wrong.any()):
        row = int(wrong.nonzero()[0])
        raise spec.OpError(f"{OP}: slot_mapping[{row}] is {int(slot_mapping[row])}, but the row's last position "
                           f"({int(last[row])}) is slot {int(expected[row])} of its block table; the step's token "
                           "must be the row's last position (or its slot negative: not cached)")


def rope_cache_attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                                cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                                scale: float | None = None, is_neox: bool = True) -> torch.Tensor:
    """A decode step's attention from its unrotated q ``[B, Hq, D]``, k and v ``[B, Hk, D]``:
    ``rope_and_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox)``
    then ``attention_decode`` of the rotated q over the caches (``block_tables``, ``context_lens``,
    ``scale``). Returns ``[B, Hq, D]``; the caches are written in place.

    Row ``b``'s new token must be its last position: ``slot_mapping[b]`` addresses position
    ``context_lens[b] - 1`` of ``block_tables[b]``, or is negative (the token is not cached, as for
    CUDA-graph padding rows). On CPUs that and the other values are checked (``OpError``); on GPUs
    they are not (that would synchronise). Under the fused kernel a row whose table reads a slot another
    row of the call writes may see that slot before or after the write: harmless for padding rows (their
    output is discarded), wrong for speculative draft rows of one sequence, which the engine therefore
    never passes here. Other arguments and errors as in the two operators.
    """
    return _OPERATOR.call(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                          context_lens, scale, is_neox)


_OPERATOR = Operator(OP, rope_cache_attention_decode, _key, _values)


@register(OP, "vendor", calls=("rope_and_cache", "attention_decode"))
def _rope_cache_then_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                               context_lens, scale, is_neox):
    q, _ = rope_and_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox)
    return attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale=scale)
