"""Representative calls of every operator at a model's shapes, for tuning and benchmarks.

``cases(op, shapes, device, dtype)`` yields ``Case``s: the call's arguments plus the bytes it
must move and the floating-point operations it must do (what rooflines are computed from).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ninefold.ops import spec


@dataclass(frozen=True)
class Shapes:
    """A model's operator shapes and the token counts / KV contexts to try."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tokens: tuple[int, ...]
    decode: tuple[tuple[int, int], ...]  # (batch, context)
    prefill: tuple[tuple[int, int, int], ...]  # (sequences, new tokens each, cached prefix each): the prefill
    # attention's tile classes (up to 64 new tokens, up to 1024 with up to 2048 keys, more) packed and over a cache
    block_size: int = 16
    softmax_width: int = 8192


SHAPES = {
    "llama-8b": Shapes(4096, 14336, 32, 8, 128, 128256, tokens=(1, 16, 256, 2048, 16384),
                       decode=((1, 4096), (1, 32768), (16, 4096), (64, 4096), (8, 32768)),
                       prefill=((1, 4096, 0), (4, 1024, 0), (1, 16384, 0), (32, 512, 0), (2, 512, 3584),
                                (8, 16, 1008), (16, 32, 0), (4, 256, 768))),
    "smollm2": Shapes(576, 1536, 9, 3, 64, 49152, tokens=(1, 8, 64, 512),
                      decode=((1, 512), (8, 512), (8, 2048)),
                      prefill=((1, 512, 0), (4, 64, 256), (8, 32, 0), (2, 256, 256))),
    "tiny": Shapes(64, 96, 4, 2, 16, 512, tokens=(1, 9), decode=((3, 40),), prefill=((2, 5, 7),), softmax_width=300),
}


@dataclass
class Case:
    """One call: ``ops.<op>(*args, **kwargs)`` moving ``bytes`` and doing ``flops``."""

    op: str
    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    bytes: int = 0
    flops: int = 0


def shapes(name: str) -> Shapes:
    """The shape set called ``name`` (``ValueError`` listing the known ones)."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"--shapes: unknown shape set {name!r}; known: {', '.join(SHAPES)}") from None


def cases(op: str, s: Shapes, device, dtype: torch.dtype, seed: int = 0,
          cache_dtype: torch.dtype | None = None) -> Iterator[Case]:
    """Representative calls of ``op`` at the shapes ``s``; the KV caches of the operators in ``CACHE_OPS`` hold
    ``cache_dtype`` (default: ``dtype``; ``torch.float8_e4m3fn`` for an engine's ``kv_cache_dtype="fp8"``)."""
    if op not in _BUILDERS:
        raise ValueError(f"op: {op!r} has no workloads; known: {', '.join(_BUILDERS)}")
    gen = torch.Generator().manual_seed(seed)
    if op in CACHE_OPS:
        yield from _BUILDERS[op](s, torch.device(device), dtype, gen, cache_dtype or dtype)
    elif cache_dtype not in (None, dtype):
        raise ValueError(f"cache_dtype: {op} reads no KV cache; only {', '.join(CACHE_OPS)} take one")
    else:
        yield from _BUILDERS[op](s, torch.device(device), dtype, gen)


def _randn(gen, *shape, device, dtype, scale=1.0):
    if torch.device(device).type == "meta":  # shapes only (validation at full size without the memory)
        return torch.empty(shape, device="meta", dtype=dtype)
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _embedding(s, dev, dt, g):
    weight = _randn(g, s.vocab, s.hidden, device=dev, dtype=dt)
    for t in s.tokens:
        ids = torch.randint(0, s.vocab, (t,), generator=g).to(dev)
        yield Case("embedding", f"T={t} D={s.hidden}", (ids, weight), bytes=2 * t * s.hidden * dt.itemsize)


def _layers(s) -> tuple:
    """``(N, K, name)`` of a decoder layer's projections (q/k/v, o, gate/up, down)."""
    return (((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden, "qkv"), (s.hidden, s.heads * s.head_dim, "o"),
            (2 * s.intermediate, s.hidden, "gate_up"), (s.hidden, s.intermediate, "down"))


def _linear(s, dev, dt, g):
    for n, k, what in (*_layers(s), (s.vocab, s.hidden, "lm_head")):
        weight = _randn(g, n, k, device=dev, dtype=dt, scale=k**-0.5)
        for t in s.tokens if what != "lm_head" else (t for t in s.tokens if t <= 256):  # (logits of last positions)
            x = _randn(g, t, k, device=dev, dtype=dt)
            yield Case("linear", f"{what} T={t} N={n} K={k}", (x, weight),
                       bytes=(t * k + n * k + t * n) * dt.itemsize, flops=2 * t * n * k)


def _fp8_weight(g, n: int, k: int, dev):
    """A random ``[N, K]`` ``Fp8Weight`` (on ``meta``: its shapes only)."""
    from ninefold.ops.fp8 import FP8, Fp8Weight

    if dev.type == "meta":
        return Fp8Weight(torch.empty(n, k, device=dev, dtype=FP8), torch.empty(n, device=dev, dtype=torch.float32))
    return Fp8Weight.quantize(_randn(g, n, k, device=dev, dtype=torch.float32, scale=k**-0.5))


def _weight_bytes(weight, dt) -> int:
    """The bytes a call streams for ``weight``: an ``Fp8Weight``'s codes and scales, else ``numel`` of ``dt``."""
    return weight.nbytes if not isinstance(weight, torch.Tensor) else weight.numel() * dt.itemsize


def _linear_fp8(s, dev, dt, g):
    """The projection layers of an engine run with ``quantization="fp8"`` (the head stays in the model's dtype)."""
    for n, k, what in _layers(s):
        weight = _fp8_weight(g, n, k, dev)
        for t in s.tokens:
            x = _randn(g, t, k, device=dev, dtype=dt)
            yield Case("linear_fp8", f"{what} T={t} N={n} K={k}", (x, weight),
                       bytes=(t * k + t * n) * dt.itemsize + weight.nbytes, flops=2 * t * n * k)


FUSED_ROWS = 32  # the engine fuses the norms and the gate into its GEMVs for decode steps of up to 32 rows
FP8_FUSED_ROWS = 16  # and with FP8 weights for steps of up to 16 rows (more: linear_fp8's scaled_mm)


def _fused_weights(n: int, k: int, dev, dt, g):
    """``(weight, label suffix, most rows)``: the layer's weight in ``dt``, then as an ``Fp8Weight``."""
    yield _randn(g, n, k, device=dev, dtype=dt, scale=k**-0.5), "", FUSED_ROWS
    yield _fp8_weight(g, n, k, dev), " fp8", FP8_FUSED_ROWS


def _add_rms_norm_linear(s, dev, dt, g):
    norm = _randn(g, s.hidden, device=dev, dtype=dt)
    for n, _, what in (layer for layer in _layers(s) if layer[2] in ("qkv", "gate_up")):  # (the normed ones)
        for weight, fp8, most in _fused_weights(n, s.hidden, dev, dt, g):
            for t in (t for t in s.tokens if t <= most):
                x, r = _randn(g, t, s.hidden, device=dev, dtype=dt), _randn(g, t, s.hidden, device=dev, dtype=dt)
                yield Case("add_rms_norm_linear", f"{what}{fp8} T={t} N={n} K={s.hidden}", (x, r, norm, weight, 1e-5),
                           bytes=(3 * t * s.hidden + t * n) * dt.itemsize + _weight_bytes(weight, dt),
                           flops=2 * t * n * s.hidden)


def _silu_and_mul_linear(s, dev, dt, g):
    n, k = s.hidden, s.intermediate
    for weight, fp8, most in _fused_weights(n, k, dev, dt, g):
        for t in (t for t in s.tokens if t <= most):
            x = _randn(g, t, 2 * k, device=dev, dtype=dt)
            yield Case("silu_and_mul_linear", f"down{fp8} T={t} N={n} K={k}", (x, weight),
                       bytes=(2 * t * k + t * n) * dt.itemsize + _weight_bytes(weight, dt), flops=2 * t * n * k)


def _binary(op):
    def build(s, dev, dt, g):
        for t in s.tokens:
            a, b = _randn(g, t, s.hidden, device=dev, dtype=dt), _randn(g, t, s.hidden, device=dev, dtype=dt)
            yield Case(op, f"T={t} D={s.hidden}", (a, b), bytes=3 * t * s.hidden * dt.itemsize)

    return build


def _rms_norm(s, dev, dt, g):
    weight = _randn(g, s.hidden, device=dev, dtype=dt)
    for t in s.tokens:
        x = _randn(g, t, s.hidden, device=dev, dtype=dt)
        yield Case("rms_norm", f"T={t} D={s.hidden}", (x, weight, 1e-5), bytes=2 * t * s.hidden * dt.itemsize)


def _add_rms_norm(s, dev, dt, g):
    weight = _randn(g, s.hidden, device=dev, dtype=dt)
    for t in s.tokens:
        x, r = _randn(g, t, s.hidden, device=dev, dtype=dt), _randn(g, t, s.hidden, device=dev, dtype=dt)
        yield Case("add_rms_norm", f"T={t} D={s.hidden}", (x, r, weight, 1e-5), bytes=4 * t * s.hidden * dt.itemsize)


def _gated(op):
    def build(s, dev, dt, g):
        for t in s.tokens:
            x = _randn(g, t, 2 * s.intermediate, device=dev, dtype=dt)
            yield Case(op, f"T={t} d={s.intermediate}", (x,), bytes=3 * t * s.intermediate * dt.itemsize)

    return build


def _softmax(s, dev, dt, g):
    for t in s.tokens:
        x = _randn(g, t, s.softmax_width, device=dev, dtype=dt, scale=3)
        yield Case("softmax", f"T={t} N={s.softmax_width}", (x,), bytes=2 * t * s.softmax_width * dt.itemsize)


def cos_sin_cache(max_pos: int, rotary: int, base: float = 500000.0, device="cpu") -> torch.Tensor:
    """A float32 ``[max_pos, rotary]`` cache: cos in the first half of the columns, sin in the rest."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float().to(device)


ROPE_POSITIONS = 8192  # the cos/sin table of the rope workloads; their tokens sit at random positions in it


def _rope_bytes(s, t: int, dt) -> int:
    """What rotating q and k of ``t`` tokens moves: both read and written, one float32 table row per token."""
    return 2 * t * (s.heads + s.kv_heads) * s.head_dim * dt.itemsize + t * s.head_dim * 4


def _rope(s, dev, dt, g):
    cache = cos_sin_cache(ROPE_POSITIONS, s.head_dim, device=dev)
    for t in s.tokens:
        q = _randn(g, t, s.heads, s.head_dim, device=dev, dtype=dt)
        k = _randn(g, t, s.kv_heads, s.head_dim, device=dev, dtype=dt)
        positions = torch.randint(0, ROPE_POSITIONS, (t,), generator=g).to(dev)
        yield Case("rope", f"T={t} H={s.heads}/{s.kv_heads}", (q, k, positions, cache), bytes=_rope_bytes(s, t, dt))


def paged(s: Shapes, lengths, dev, dt, g, extra_blocks: int = 0):
    """Caches (of ``dt``) holding ``lengths`` tokens per sequence in randomly placed blocks, and the tables."""
    bs = s.block_size
    per_seq = [-(-n // bs) for n in lengths]
    num_blocks = sum(per_seq) + extra_blocks + 1
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[start:start + n]
        start += n
    k_cache = _randn(g, num_blocks, bs, s.kv_heads, s.head_dim, device=dev, dtype=dt)
    v_cache = _randn(g, num_blocks, bs, s.kv_heads, s.head_dim, device=dev, dtype=dt)
    return k_cache, v_cache, tables.to(dev)


def _cache_label(dt, cache_dt) -> str:
    return "" if cache_dt == dt else f" {spec.dtype_name(cache_dt)} cache"


def _cache_write(s, t: int, dev, dt, g, cache_dt) -> tuple:
    """``(key, value, k_cache, v_cache, slots)``: ``t`` tokens' keys and values of ``dt``, caches of ``cache_dt``
    with room for them, and ``t`` distinct random slots."""
    k_cache, v_cache, _ = paged(s, [t], dev, cache_dt, g)
    slots = torch.randperm(k_cache.shape[0] * s.block_size, generator=g)[:t].to(dev)
    key = _randn(g, t, s.kv_heads, s.head_dim, device=dev, dtype=dt)
    value = _randn(g, t, s.kv_heads, s.head_dim, device=dev, dtype=dt)
    return key, value, k_cache, v_cache, slots


def _reshape_and_cache(s, dev, dt, g, cache_dt):
    for t in s.tokens:
        key, value, k_cache, v_cache, slots = _cache_write(s, t, dev, dt, g, cache_dt)
        yield Case("reshape_and_cache", f"T={t}{_cache_label(dt, cache_dt)}", (key, value, k_cache, v_cache, slots),
                   bytes=2 * t * s.kv_heads * s.head_dim * (dt.itemsize + cache_dt.itemsize))


def _decode(s, dev, dt, g, cache_dt):
    for batch, context in s.decode:
        k_cache, v_cache, tables = paged(s, [context] * batch, dev, cache_dt, g)
        q = _randn(g, batch, s.heads, s.head_dim, device=dev, dtype=dt)
        lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        kv_bytes = 2 * batch * context * s.kv_heads * s.head_dim * cache_dt.itemsize
        yield Case("attention_decode", f"B={batch} ctx={context}{_cache_label(dt, cache_dt)}",
                   (q, k_cache, v_cache, tables, lens), bytes=kv_bytes, flops=4 * batch * s.heads * context * s.head_dim)


def _prefill(s, dev, dt, g, cache_dt):
    for seqs, new, prefix in s.prefill:
        q = _randn(g, seqs * new, s.heads, s.head_dim, device=dev, dtype=dt)
        cu_q = torch.arange(0, seqs + 1, dtype=torch.int32, device=dev) * new
        cu_k = torch.arange(0, seqs + 1, dtype=torch.int32, device=dev) * (new + prefix)
        # Causal pairs per head: new queries over prefix + a triangle.
        pairs = seqs * (new * prefix + new * (new + 1) // 2)
        flops = 4 * pairs * s.heads * s.head_dim
        lengths = dict(max_seqlen_q=new, max_seqlen_k=new + prefix)  # as the engine passes them (tile choice)
        if prefix == 0 and cache_dt == dt:
            k = _randn(g, seqs * new, s.kv_heads, s.head_dim, device=dev, dtype=dt)
            v = _randn(g, seqs * new, s.kv_heads, s.head_dim, device=dev, dtype=dt)
            yield Case("attention_prefill", f"B={seqs} L={new}", (q, k, v, cu_q, cu_k), lengths, flops=flops)
        else:  # (an engine with an FP8 cache reads every key from it, a prompt's first chunk's too)
            k_cache, v_cache, tables = paged(s, [new + prefix] * seqs, dev, cache_dt, g)
            yield Case("attention_prefill", f"B={seqs} L={new} prefix={prefix}{_cache_label(dt, cache_dt)}",
                       (q, None, None, cu_q, cu_k),
                       dict(k_cache=k_cache, v_cache=v_cache, block_tables=tables, **lengths), flops=flops)


def _rope_and_cache(s, dev, dt, g, cache_dt):
    cache = cos_sin_cache(ROPE_POSITIONS, s.head_dim, device=dev)
    for t in s.tokens:
        k, v, k_cache, v_cache, slots = _cache_write(s, t, dev, dt, g, cache_dt)
        q = _randn(g, t, s.heads, s.head_dim, device=dev, dtype=dt)
        positions = torch.randint(0, ROPE_POSITIONS, (t,), generator=g).to(dev)
        cached = t * s.kv_heads * s.head_dim * (dt.itemsize + 2 * cache_dt.itemsize)  # (v read; k and v written)
        yield Case("rope_and_cache", f"T={t} H={s.heads}/{s.kv_heads}{_cache_label(dt, cache_dt)}",
                   (q, k, v, positions, cache, k_cache, v_cache, slots), bytes=_rope_bytes(s, t, dt) + cached)


def _rope_cache_attention_decode(s, dev, dt, g, cache_dt):
    cache = cos_sin_cache(max(ROPE_POSITIONS, *(context for _, context in s.decode)), s.head_dim, device=dev)
    for batch, context in s.decode:
        k_cache, v_cache, tables = paged(s, [context] * batch, dev, cache_dt, g)
        last = context - 1  # each row's new token: the last position of its table
        slots = tables[:, last // s.block_size].long() * s.block_size + last % s.block_size
        q = _randn(g, batch, s.heads, s.head_dim, device=dev, dtype=dt)
        k = _randn(g, batch, s.kv_heads, s.head_dim, device=dev, dtype=dt)
        v = _randn(g, batch, s.kv_heads, s.head_dim, device=dev, dtype=dt)
        positions = torch.full((batch,), last, dtype=torch.int64, device=dev)
        lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        kv_bytes = 2 * batch * context * s.kv_heads * s.head_dim * cache_dt.itemsize
        yield Case("rope_cache_attention_decode", f"B={batch} ctx={context}{_cache_label(dt, cache_dt)}",
                   (q, k, v, positions, cache, k_cache, v_cache, slots, tables, lens), bytes=kv_bytes,
                   flops=4 * batch * s.heads * context * s.head_dim)


def _argmax(s, dev, dt, g):
    for t in (t for t in s.tokens if t <= 256):
        x = _randn(g, t, s.vocab, device=dev, dtype=dt)
        yield Case("argmax", f"B={t} V={s.vocab}", (x,), bytes=t * s.vocab * dt.itemsize)


def _sample(s, dev, dt, g):
    for t in (t for t in s.tokens if t <= 256):
        x = _randn(g, t, s.vocab, device=dev, dtype=dt, scale=3)
        temperature = torch.full((t,), 0.8, device=dev)
        top_k = torch.full((t,), 50, dtype=torch.int32, device=dev)
        top_p = torch.full((t,), 0.9, device=dev)
        yield Case("sample", f"B={t} V={s.vocab} top-k/top-p", (x, temperature), dict(top_k=top_k, top_p=top_p),
                   bytes=t * s.vocab * dt.itemsize)
        yield Case("sample", f"B={t} V={s.vocab} top-p", (x, temperature), dict(top_p=top_p),
                   bytes=t * s.vocab * dt.itemsize)


_BUILDERS = {
    "embedding": _embedding, "linear": _linear, "linear_fp8": _linear_fp8, "add_rms_norm_linear": _add_rms_norm_linear,
    "silu_and_mul_linear": _silu_and_mul_linear, "add": _binary("add"), "mul": _binary("mul"),
    "rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm, "silu_and_mul": _gated("silu_and_mul"),
    "gelu_and_mul": _gated("gelu_and_mul"), "softmax": _softmax, "rope": _rope,
    "reshape_and_cache": _reshape_and_cache, "attention_decode": _decode, "attention_prefill": _prefill,
    "rope_and_cache": _rope_and_cache, "rope_cache_attention_decode": _rope_cache_attention_decode,
    "argmax": _argmax, "sample": _sample,
}
OPS = tuple(_BUILDERS)
CACHE_OPS = ("reshape_and_cache", "attention_decode", "attention_prefill", "rope_and_cache",
             "rope_cache_attention_decode")  # builders taking the cache's dtype (the paged kernels)
