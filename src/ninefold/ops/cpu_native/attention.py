"""``attention_prefill``'s ``cpu_native`` implementation: causal attention over packed sequences
(no paged cache) in ``nf_attention.c``, float32 or bfloat16, float32 arithmetic.

torch's CPU flash attention spends ~6 ms per SmolLM2 layer on a 512-token prompt at 2 threads (a
third of the prefill); this kernel tiles keys by 16 (one FMA per query value and 16 keys) with an
online softmax and parallelizes over (sequence, KV head, 32-row query tile), the keys and values
converted to float32 once per (sequence, KV head).
"""

from __future__ import annotations

import math

import torch

from ninefold.ops import spec
from ninefold.ops.registry import register


def _supports(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables, *_) -> str | None:
    from ninefold.ops import cpu_native

    if block_tables is not None:
        return "reads no paged cache (packed k/v only)"
    if q.dtype not in (torch.float32, torch.bfloat16):
        return f"takes float32 or bfloat16, not {spec.dtype_name(q.dtype)}"
    d = q.shape[-1]
    if d % 16 or d > 512:
        return f"head size {d} is not a multiple of 16 up to 512"
    for t in (q, k, v):
        if t.stride(-1) != 1 or t.stride(-2) != d:
            return "the heads of q, k or v are not contiguous rows"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads"
    if not cpu_native.fast():  # the portable C loops would be slower than torch's attention
        return cpu_native.slow_reason()
    return None


@register("attention_prefill", "cpu_native", devices=("cpu",), supports=_supports, priority={"cpu": 5})
def _attention_prefill_native(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables, *_):
    from ninefold.ops import cpu_native

    lib = cpu_native.library()
    tq, hq, d = q.shape
    cu_q, cu_k = cu_seqlens_q.to(torch.int64).contiguous(), cu_seqlens_k.to(torch.int64).contiguous()
    lq, lk = cu_q.diff(), cu_k.diff()
    bad = ((lq > lk) | (lq < 0)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise spec.OpError(f"attention_prefill: sequence {b} has {int(lq[b])} queries but {int(lk[b])} keys "
                           "(cu_seqlens must be non-decreasing with Lq <= Lk)")
    out = torch.empty((tq, hq, d), dtype=q.dtype)
    if tq == 0:
        return out
    scratch = torch.empty(lib.nf_attention_scratch_floats(cu_k.data_ptr(), cu_k.shape[0] - 1, k.shape[1], d),
                          dtype=torch.float32)
    lib.nf_attention_prefill(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                             int(q.dtype == torch.bfloat16), cu_q.data_ptr(), cu_k.data_ptr(), cu_q.shape[0] - 1,
                             hq, k.shape[1], d, scale or 1.0 / math.sqrt(d), out.data_ptr(), out.stride(0),
                             scratch.data_ptr())
    return out
