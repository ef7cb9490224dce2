"""Scaled dot-product attention, flash-attention style (online softmax in base 2), optionally causal.

``q``/``o`` are ``[B, H, Sq, D]`` and ``k``/``v`` ``[B, H, Sk, D]``. A program owns ``BLOCK_M``
query rows of one head and walks every ``BLOCK_N``-row tile of that head's keys and values. The
causal mask is aligned to the bottom right: query ``i`` sees keys ``j <= i + Sk - Sq``; causal
programs stop after the last key tile that one of their rows can see. Only the tiles that cross
the diagonal (or the end of the keys) are masked: the others run in a loop of their own.
"""

import math

import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor
from ninefold.ops.kernels._checks import check_same, check_tensor

BLOCK_M = Symbol("BLOCK_M", meta=True, lower_bound=64, upper_bound=128)
BLOCK_N = Symbol("BLOCK_N", meta=True, lower_bound=32, upper_bound=128)


def arrangement(q, k, v, scale, is_causal, o, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N):
    def query_rows(t):  # programs (B, H, Sq / BLOCK_M, 1), each a (BLOCK_M, D) tile
        t = t.tile((1, 1, BLOCK_M, -1))
        t.dtype = t.dtype.squeeze((0, 1))
        return t[:, :, ::-1]  # last query blocks first: with a causal mask they have the most keys

    def key_tiles(t):  # every query program sees all (BLOCK_N, D) tiles of its head
        t = t.tile((1, 1, BLOCK_N, -1)).tile((1, 1, -1, -1)).expand((-1, -1, q_rows.shape[2], -1))
        t.dtype = t.dtype.squeeze((0, 1, 3))
        t.dtype.dtype = t.dtype.dtype.squeeze((0, 1))
        return t

    q_rows = query_rows(q)
    return q_rows, key_tiles(k), key_tiles(v), scale, is_causal, query_rows(o)


def application(q, k, v, scale, is_causal, o):
    q_scaled = (q * (scale * 1.4426950408889634)).to(q.dtype)  # log2(e): softmax in base 2
    shift = k.source.shape[-2] - q.source.shape[-2]
    row_max = nl.full((q.shape[-2],), float("-inf"), dtype=nl.float32)
    row_sum = nl.zeros((q.shape[-2],), dtype=nl.float32)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    n_tiles = k.shape[0]
    n_full = k.source.shape[-2] // k[0].shape[0]  # key tiles with no row past the end
    if is_causal:  # key tiles wholly past this block's last row are skipped
        n_tiles = nl.minimum(n_tiles, nl.cdiv(nl.max(q.offsets(-2)) + shift + 1, k[0].shape[0]))
        n_full = nl.minimum(n_full, (nl.min(q.offsets(-2)) + shift + 1) // k[0].shape[0])
    # Two loops with the same online-softmax update (kept inline: the source also runs under
    # NineToothed); the first needs no mask at all.
    for j in range(n_full):  # tiles every row of the block sees whole: no mask
        scores = nl.dot(q_scaled, nl.trans(k[j]))
        new_max = nl.maximum(row_max, nl.max(scores, 1))
        p = nl.exp2(scores - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q_scaled.dtype), v[j])
        row_sum = row_sum * alpha + nl.sum(p, 1)
        row_max = new_max
    for j in range(n_full, n_tiles):  # the diagonal and the last partial tile: masked
        scores = nl.dot(q_scaled, nl.trans(k[j]))
        keep = k[j].offsets(-2)[None, :] < k.source.shape[-2]
        if is_causal:
            keep = keep & (k[j].offsets(-2)[None, :] <= q.offsets(-2)[:, None] + shift)
        scores = nl.where(keep, scores, float("-inf"))
        new_max = nl.maximum(row_max, nl.max(scores, 1))
        p = nl.exp2(scores - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q_scaled.dtype), v[j])
        row_sum = row_sum * alpha + nl.sum(p, 1)
        row_max = new_max
    o = acc / row_sum[:, None]  # noqa: F841


_head_dim = {"constexpr": True, "upper_bound": 256}

def tensors():
    """The symbolic parameters (q, k, v, scale, is_causal, o) of ``kernel``."""
    return (
        *(Tensor(4, shape_options=(None, None, None, _head_dim)) for _ in range(3)),
        Tensor(0),
        Tensor(0, constexpr=True),
        Tensor(4, shape_options=(None, None, None, _head_dim)),
    )


kernel = nd.make(arrangement, application, tensors())


def scaled_dot_product_attention(q, k, v, is_causal=False, scale=None, **blocks):
    """``softmax(q k^T * scale [+ causal mask]) v`` for ``[B, H, S, D]`` tensors (one dtype)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4)
    check_same(("q", "k", "v"), (q, k, v))
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k/v: shapes {tuple(k.shape)}/{tuple(v.shape)} do not match q {tuple(q.shape)}")
    if q.shape[3] > 256:
        raise ValueError(f"q: head dims up to 256 are supported, got {q.shape[3]}")
    if is_causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"is_causal: needs Sq <= Sk (bottom-right aligned), got {q.shape[2]} > {k.shape[2]}")
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kernel(q, k, v, scale, bool(is_causal), o, **blocks)
    return o
