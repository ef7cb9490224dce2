"""Float64 CPU references of every operator, written independently of the implementations.

Slow and plain on purpose: loops over sequences, tokens and heads where that is clearer. Each
takes the operator's arguments (on any device, any dtype) and returns float64 CPU tensors.
"""

from __future__ import annotations

import math

import torch


def _f64(t):
    return None if t is None else t.detach().to("cpu", torch.float64)


def embedding(ids, weight):
    w = _f64(weight)
    flat = [w[i] for i in ids.cpu().reshape(-1).tolist()]
    return torch.stack(flat).reshape(*ids.shape, w.shape[1])


def linear(x, weight, bias=None):
    out = _f64(x) @ _f64(weight).T
    return out if bias is None else out + _f64(bias)


def add(a, b):
    return _f64(a) + _f64(b)


def mul(a, b):
    return _f64(a) * _f64(b)


def rms_norm(x, weight, eps=1e-6):
    x = _f64(x)
    mean_square = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return x / torch.sqrt(mean_square + eps) * _f64(weight)


def add_rms_norm(x, residual, weight, eps=1e-6):
    # The implementations round the sum to x's dtype first, as an unfused model does.
    total = (_f64(x) + _f64(residual)).to(x.dtype).double()
    return rms_norm(total, weight, eps), total


def _silu(a):
    return a / (1 + torch.exp(-a))


def _gelu(a, approximate):
    if approximate == "tanh":
        return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
    return 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))


def silu_and_mul(x):
    x = _f64(x)
    d = x.shape[-1] // 2
    return _silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x, approximate="none"):
    x = _f64(x)
    d = x.shape[-1] // 2
    return _gelu(x[..., :d], approximate) * x[..., d:]


def softmax(x, dim=-1):
    x = _f64(x)
    e = torch.exp(x - x.max(dim, keepdim=True).values)
    return e / e.sum(dim, keepdim=True)


def rope(q, k, positions, cos_sin_cache, is_neox=True):
    cache = _f64(cos_sin_cache)
    r = cache.shape[1]
    half = r // 2

    def rotate(x):
        x = _f64(x).clone()
        out = x.clone()
        for t, pos in enumerate(positions.cpu().tolist()):
            for i in range(half):
                c, s = cache[pos, i], cache[pos, half + i]
                a, b = (i, half + i) if is_neox else (2 * i, 2 * i + 1)
                out[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
                out[t, :, b] = x[t, :, b] * c + x[t, :, a] * s
        return out

    return rotate(q), rotate(k)


def _attend(q, keys, values, allowed, scale):
    """q [Hq, D]; keys/values [L, Hk, D]; allowed: number of visible keys (a prefix)."""
    hq, hk = q.shape[0], keys.shape[1]
    out = torch.empty_like(q)
    for h in range(hq):
        kv = h // (hq // hk)
        scores = keys[:allowed, kv] @ q[h] * scale
        weights = torch.exp(scores - scores.max())
        weights = weights / weights.sum()
        out[h] = weights @ values[:allowed, kv]
    return out


def _paged_tokens(cache, table, length):
    bs = cache.shape[1]
    return torch.stack([cache[table[p // bs], p % bs] for p in range(length)])


def attention_decode(q, k_cache, v_cache, block_tables, context_lens, *, scale=None):
    q, kc, vc = _f64(q), _f64(k_cache), _f64(v_cache)
    scale = scale or 1 / math.sqrt(q.shape[-1])
    tables, lens = block_tables.cpu().tolist(), context_lens.cpu().tolist()
    out = torch.empty_like(q)
    for b, length in enumerate(lens):
        keys, values = _paged_tokens(kc, tables[b], length), _paged_tokens(vc, tables[b], length)
        out[b] = _attend(q[b], keys, values, length, scale)
    return out


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, k_cache=None, v_cache=None,
                      block_tables=None):
    q = _f64(q)
    scale = scale or 1 / math.sqrt(q.shape[-1])
    cu_q, cu_k = cu_seqlens_q.cpu().tolist(), cu_seqlens_k.cpu().tolist()
    out = torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if block_tables is None:
            keys, values = _f64(k)[cu_k[b]:cu_k[b + 1]], _f64(v)[cu_k[b]:cu_k[b + 1]]
        else:
            table = block_tables[b].cpu().tolist()
            keys, values = _paged_tokens(_f64(k_cache), table, lk), _paged_tokens(_f64(v_cache), table, lk)
        for i in range(lq):
            out[cu_q[b] + i] = _attend(q[cu_q[b] + i], keys, values, lk - lq + i + 1, scale)
    return out


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """Returns the updated caches (float64 copies) instead of writing in place."""
    kc, vc = _f64(k_cache).clone(), _f64(v_cache).clone()
    bs = kc.shape[1]
    for t, slot in enumerate(slot_mapping.cpu().tolist()):
        if slot >= 0:
            kc[slot // bs, slot % bs] = _f64(key[t])
            vc[slot // bs, slot % bs] = _f64(value[t])
    return kc, vc


def argmax(x, dim=-1):
    return _f64(x).argmax(dim)


def sample_distribution(logits, temperature, top_k=None, top_p=None, min_p=None):
    """The exact probability of every token per row under ``ops.sample``'s rules, float64 ``[B, V]``."""
    logits = _f64(logits)
    rows = []
    for b in range(logits.shape[0]):
        row, t = logits[b], float(temperature[b])
        v = row.shape[0]
        if t <= 0:
            p = torch.zeros(v, dtype=torch.float64)
            p[int(row.argmax())] = 1
            rows.append(p)
            continue
        p = softmax(row / t)
        order = sorted(range(v), key=lambda i: -float(p[i]))
        keep = set(order)
        k = int(top_k[b]) if top_k is not None else 0
        if 0 < k < v:  # ties with the k-th largest are kept
            keep = {i for i in order if float(row[i]) >= float(row[order[k - 1]])}
        if top_p is not None and float(top_p[b]) < 1:
            kept = [i for i in order if i in keep]
            total = sum(float(p[i]) for i in kept)
            mass, chosen = 0.0, []
            for i in kept:
                if chosen and mass >= float(top_p[b]):
                    break
                chosen.append(i)
                mass += float(p[i]) / total
            keep = {i for i in kept if float(row[i]) >= float(row[chosen[-1]])}  # and ties with the last one
        if min_p is not None and float(min_p[b]) > 0:
            largest = max(float(p[i]) for i in keep)
            keep = {i for i in keep if float(p[i]) >= float(min_p[b]) * largest}
        q = torch.zeros(v, dtype=torch.float64)
        for i in keep:
            q[i] = p[i]
        rows.append(q / q.sum())
    return torch.stack(rows)


def linear_int4(x, weight, bias=None):
    """``x @ w.T + bias`` with ``w = codes * scale + offset`` per group, all in float64 (from the
    weight's codes and its float32 scales/zeros, ``w = (codes - 8) * scale + zero``)."""
    n, k = weight.shape
    g = weight.group_size
    codes = weight.codes().cpu().double().reshape(n, k // g, g)
    sz = weight.scales_and_zeros.cpu().double()[:, :n].transpose(0, 1)
    w = ((codes - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k)
    out = _f64(x) @ w.T
    return out if bias is None else out + _f64(bias)
