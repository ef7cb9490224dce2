"""Dense layers: ``embedding`` (row gather) and ``linear`` (``x @ weight.T + bias``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninefold.ops import spec
from ninefold.ops.dispatch import Operator
from ninefold.ops.registry import register


def _embedding_key(ids, weight):
    spec.tensor("embedding", "ids", ids)
    spec.integer("embedding", "ids", ids)
    spec.tensor("embedding", "weight", weight, ndim=2)
    spec.same_device("embedding", "weight", weight, ids=ids)
    return weight.device, weight.dtype, (spec.pow2(ids.numel()), weight.shape[1])


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``weight`` ``[V, D]`` at ``ids`` (int32/int64 ``[...]``) -> ``[..., D]``.

    Ids must lie in ``[0, V)``: the CPU raises ``OpError`` otherwise; on GPUs they are not checked
    (that would synchronise) and an out-of-range id is a device-side assert.
    """
    return _EMBEDDING.call(ids, weight)


def _linear_key(x, weight, bias=None):
    spec.tensor("linear", "x", x, min_ndim=1)
    spec.tensor("linear", "weight", weight, ndim=2)
    if weight.shape[1] != x.shape[-1]:
        raise spec.OpError(f"linear: weight must be [N, {x.shape[-1]}] (x's last dimension is K), "
                           f"got {tuple(weight.shape)}")
    if bias is not None:
        spec.tensor("linear", "bias", bias)
    spec.same_device("linear", "x", x, weight=weight, bias=bias)
    spec.same_dtype("linear", "x", x, weight=weight, bias=bias)
    if bias is not None:
        spec.shape("linear", "bias", bias, (weight.shape[0],), " (weight's N)")
    m = x.numel() // max(x.shape[-1], 1)
    return x.device, x.dtype, (spec.pow2(m), weight.shape[0], weight.shape[1]), bias is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` -> ``[..., N]``."""
    return _LINEAR.call(x, weight, bias)


_EMBEDDING = Operator("embedding", embedding, _embedding_key)
_LINEAR = Operator("linear", linear, _linear_key)



@register("embedding", "vendor")
def _embedding_torch(ids, weight):
    try:
        return F.embedding(ids, weight)
    except IndexError:  # the CPU checks the range (CUDA raises a device-side assert instead)
        raise spec.OpError(f"embedding: ids must lie in [0, {weight.shape[0]}), got values from {int(ids.min())} "
                           f"to {int(ids.max())}") from None
register("linear", "vendor")(F.linear)


def _register_cpu_linear() -> None:
    from ninefold.ops import cpu_linear, cpu_upcast

    # Above F.linear on CPUs where it applies (2..64 rows, large weights): it measures both forms first.
    register("linear", "cpu_measured", devices=("cpu",), dtypes=(torch.float32, torch.bfloat16, torch.float16),
             supports=cpu_linear.supports, priority={"cpu": 5})(cpu_linear.linear)
    # Above both for bfloat16/float16 on CPUs without a fast GEMM in those dtypes (AVX2), 9+ rows.
    register("linear", "cpu_upcast", devices=("cpu",), dtypes=(torch.bfloat16, torch.float16),
             supports=cpu_upcast.supports, priority={"cpu": 6})(cpu_upcast.linear)


_register_cpu_linear()
