"""``torch.ops.ninefold.*``: the operators as PyTorch custom ops with fake (meta) implementations,
so ``torch.compile(fullgraph=True)`` traces through them.

Every tensor they return is contiguous: the fakes say so, and a result an implementation returns in
another layout (``torch.add`` keeps its inputs' transposed strides) is copied, so that what runs
matches what was traced whichever implementation dispatch picks.

``sample`` is exposed without per-row generators (a list of generators is not a schema type);
seeded sampling stays an eager call to ``ninefold.ops.sample``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_registered = False


def register_torch_library() -> None:
    """Define every operator under the ``ninefold`` namespace (idempotent)."""
    global _registered
    if _registered:
        return
    _define()
    _registered = True


def _define() -> None:  # noqa: C901  (one short definition per operator)
    import ninefold.ops as ops

    def op(name, fake, mutates=()):
        def wrap(fn):
            @functools.wraps(fn)  # (the schema is read from fn's signature)
            def contiguous_results(*args, **kwargs):
                return _contiguous(fn(*args, **kwargs))

            custom = torch.library.custom_op(f"ninefold::{name}", contiguous_results, mutates_args=mutates)
            custom.register_fake(fake)
            return custom

        return wrap

    def rows_like(x, last):
        return x.new_empty((*x.shape[:-1], last))

    @op("embedding", lambda ids, weight: weight.new_empty((*ids.shape, weight.shape[1])))
    def embedding(ids: Tensor, weight: Tensor) -> Tensor:
        return ops.embedding(ids, weight)

    @op("linear", lambda x, weight, bias=None: rows_like(x, weight.shape[0]))
    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return ops.linear(x, weight, bias)

    def broadcast(a, b):
        return a.new_empty(torch.broadcast_shapes(a.shape, b.shape))

    @op("add", broadcast)
    def add(a: Tensor, b: Tensor) -> Tensor:
        return ops.add(a, b)

    @op("mul", broadcast)
    def mul(a: Tensor, b: Tensor) -> Tensor:
        return ops.mul(a, b)

    @op("rms_norm", lambda x, weight, eps: torch.empty_like(x, memory_format=torch.contiguous_format))
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return ops.rms_norm(x, weight, eps)

    @op("add_rms_norm", lambda x, residual, weight, eps: (x.new_empty(x.shape), x.new_empty(x.shape)))
    def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        return ops.add_rms_norm(x, residual, weight, eps)

    @op("rope", lambda q, k, positions, cos_sin_cache, is_neox=True: (q.new_empty(q.shape), k.new_empty(k.shape)))
    def rope(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool = True) -> tuple[Tensor, Tensor]:
        return ops.rope(q, k, positions, cos_sin_cache, is_neox)

    @op("silu_and_mul", lambda x: rows_like(x, x.shape[-1] // 2))
    def silu_and_mul(x: Tensor) -> Tensor:
        return ops.silu_and_mul(x)

    @op("gelu_and_mul", lambda x, approximate="none": rows_like(x, x.shape[-1] // 2))
    def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
        return ops.gelu_and_mul(x, approximate)

    @op("softmax", lambda x, dim=-1: x.new_empty(x.shape))
    def softmax(x: Tensor, dim: int = -1) -> Tensor:
        return ops.softmax(x, dim)

    @op("reshape_and_cache", lambda key, value, k_cache, v_cache, slot_mapping: None, mutates=("k_cache", "v_cache"))
    def reshape_and_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    @op("attention_prefill", lambda q, *args, **kwargs: q.new_empty(q.shape))
    def attention_prefill(q: Tensor, k: Tensor | None, v: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          scale: float | None = None, k_cache: Tensor | None = None, v_cache: Tensor | None = None,
                          block_tables: Tensor | None = None) -> Tensor:
        return ops.attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, k_cache=k_cache,
                                     v_cache=v_cache, block_tables=block_tables)

    @op("attention_decode", lambda q, *args, **kwargs: q.new_empty(q.shape))
    def attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                         scale: float | None = None) -> Tensor:
        return ops.attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale=scale)

    def argmax_fake(x, dim=-1):
        shape = list(x.shape)
        shape.pop(dim)
        return x.new_empty(shape, dtype=torch.int64)

    @op("argmax", argmax_fake)
    def argmax(x: Tensor, dim: int = -1) -> Tensor:
        return ops.argmax(x, dim)

    @op("sample", lambda logits, temperature, top_k=None, top_p=None, min_p=None:
        logits.new_empty((logits.shape[0],), dtype=torch.int64))
    def sample(logits: Tensor, temperature: Tensor, top_k: Tensor | None = None, top_p: Tensor | None = None,
               min_p: Tensor | None = None) -> Tensor:
        return ops.sample(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def _contiguous(result):
    """``result`` (a tensor, a tuple of tensors or None) with every tensor contiguous."""
    if isinstance(result, tuple):
        return tuple(t.contiguous() for t in result)
    return result if result is None else result.contiguous()
