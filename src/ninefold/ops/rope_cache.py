"""``rope_and_cache``: rotary embedding of q and k fused with the paged KV-cache write.

The same results as ``rope`` followed by ``reshape_and_cache`` of the rotated k and v; the
vendor implementation is exactly that pair of calls (through dispatch, so CPU results do not
change), the Triton one a single kernel (``ninefold.ops.triton.rope_cache``).
"""

from __future__ import annotations

import torch

from ninefold.ops import spec
from ninefold.ops.attention import _reshape_and_cache_key, reshape_and_cache
from ninefold.ops.dispatch import Operator
from ninefold.ops.registry import register
from ninefold.ops.rope import _rope_key, _rope_values, rope


def _rope_and_cache_key(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox=True):
    op = "rope_and_cache"
    spec.tensor(op, "v", v, ndim=3)
    try:
        device, dtype, (bucket, hq, hk, d, r), neox, rope_ok = _rope_key(q, k, positions, cos_sin_cache, is_neox)
        _, _, (_, _, _, bs, *fp8), cache_ok = _reshape_and_cache_key(k, v, k_cache, v_cache, slot_mapping)
    except (TypeError, ValueError) as error:  # name this operator, not the unfused one that checked
        raise type(error)(str(error).replace("rope:", f"{op}:", 1).replace("reshape_and_cache:", f"{op}:", 1)) from None
    spec.same_device(op, "q", q, k_cache=k_cache, slot_mapping=slot_mapping)
    spec.same_dtype(op, "q", q, v=v)  # (the caches: q's dtype or FP8 codes, checked above)
    return device, dtype, (bucket, hq, hk, d, r, bs, *fp8), neox, rope_ok and cache_ok


def _rope_and_cache_values(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox=True) -> None:
    _rope_values(q, k, positions, cos_sin_cache, is_neox, op="rope_and_cache")


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope(q, k, positions, cos_sin_cache, is_neox)``, then ``reshape_and_cache`` of the rotated
    k and of v ``[T, Hk, D]`` into the paged caches at ``slot_mapping`` (a negative slot, such as the padding rows' ``-1``, skips its token).

    Returns the rotated ``(q, k)`` (new tensors); the caches are written in place. Arguments and
    errors as in ``rope`` and ``reshape_and_cache``.
    """
    return _ROPE_AND_CACHE.call(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox)


_ROPE_AND_CACHE = Operator("rope_and_cache", rope_and_cache, _rope_and_cache_key, _rope_and_cache_values)


@register("rope_and_cache", "vendor", calls=("rope", "reshape_and_cache"))
def _rope_and_cache_unfused(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox):
    q, k = rope(q, k, positions, cos_sin_cache, is_neox)
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    return q, k
