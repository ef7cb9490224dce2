"""Rotary position embedding (``rope``) with a cos/sin cache and per-token positions."""

from __future__ import annotations

import torch

from ninefold.ops import spec
from ninefold.ops.dispatch import Operator
from ninefold.ops.registry import register


def _rope_key(q, k, positions, cos_sin_cache, is_neox=True):
    op = "rope"
    spec.tensor(op, "q", q, ndim=3)
    spec.tensor(op, "k", k, ndim=3)
    spec.tensor(op, "positions", positions, ndim=1)
    spec.integer(op, "positions", positions)
    spec.tensor(op, "cos_sin_cache", cos_sin_cache, ndim=2)
    spec.floating(op, "cos_sin_cache", cos_sin_cache)
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise spec.OpError(f"rope: k must be [{t}, Hk, {d}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    spec.shape(op, "positions", positions, (t,), " (one position per token)")
    r = cos_sin_cache.shape[1]
    if r % 2 or r > d or r == 0:
        raise spec.OpError(f"rope: cos_sin_cache must be [max_pos, R] with R even and 0 < R <= head size {d}, "
                           f"got {tuple(cos_sin_cache.shape)}")
    if not isinstance(is_neox, bool):
        raise TypeError(f"rope: is_neox must be a bool, got {type(is_neox).__name__}")
    spec.same_device(op, "q", q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    spec.same_dtype(op, "q", q, k=k)
    contiguous = q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    return q.device, q.dtype, (spec.pow2(t), hq, k.shape[1], d, r), is_neox, contiguous


def _rope_values(q, k, positions, cos_sin_cache, is_neox=True, op: str = "rope") -> None:
    if positions.device.type == "cpu" and positions.numel():  # (on GPUs reading them would synchronise)
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= cos_sin_cache.shape[0]:
            raise spec.OpError(f"{op}: positions must lie in [0, {cos_sin_cache.shape[0]}) (cos_sin_cache rows), "
                               f"got values from {low} to {high}")


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
         is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``R`` features of every head of q ``[T, Hq, D]`` and k ``[T, Hk, D]``.

    ``cos_sin_cache[p]`` holds ``cos`` for position ``p`` in its first ``R/2`` columns and ``sin``
    in the rest. ``is_neox``: rotate halves (``x[:R/2]`` with ``x[R/2:R]``); otherwise
    interleaved pairs (``x[2i]`` with ``x[2i+1]``). Positions must lie in ``[0, max_pos)``.
    Returns new ``(q, k)``; features past ``R`` are copied unchanged.
    """
    return _ROPE.call(q, k, positions, cos_sin_cache, is_neox)


_ROPE = Operator("rope", rope, _rope_key, _rope_values)


def _rotate(x, cos, sin, is_neox):
    r = cos.shape[-1] * 2
    xf = x[..., :r].float()
    if is_neox:
        x1, x2 = xf[..., : r // 2], xf[..., r // 2:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if r == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., r:]), dim=-1)


@register("rope", "vendor")
def _rope_torch(q, k, positions, cos_sin_cache, is_neox):
    r = cos_sin_cache.shape[1]
    try:
        cs = cos_sin_cache.index_select(0, positions).float()
    except IndexError:  # the CPU checks the range (CUDA raises a device-side assert instead)
        raise spec.OpError(f"rope: positions must lie in [0, {cos_sin_cache.shape[0]}) (cos_sin_cache rows), got "
                           f"values from {int(positions.min())} to {int(positions.max())}") from None
    cos, sin = cs[:, None, : r // 2], cs[:, None, r // 2:]
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)
