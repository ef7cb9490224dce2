"""Token selection: ``argmax`` and ``sample`` (temperature, top-k, top-p, min-p, seeded rows).

``sample`` never synchronises with the host on GPUs: it draws with the exponential race
(``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` picks ``i`` with probability ``p_i``), using each
row's own generator where one is given.
"""

from __future__ import annotations

import torch

from ninefold.ops import spec
from ninefold.ops.dispatch import Operator
from ninefold.ops.registry import register


def _argmax_key(x, dim=-1):
    spec.tensor("argmax", "x", x, min_ndim=1)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise spec.OpError(f"argmax: dim must be an int in [{-x.dim()}, {x.dim() - 1}], got {dim!r}")
    n = x.shape[dim]
    if n == 0:
        raise spec.OpError(f"argmax: dimension {dim} of x is empty (shape {tuple(x.shape)})")
    return x.device, x.dtype, (spec.pow2(x.numel() // n), n)


def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Index of the largest value along ``dim`` (int64; the first one on ties)."""
    return _ARGMAX.call(x, dim)


def _row_param(name, value, b, device, floating: bool) -> None:
    op = "sample"
    if value is None:
        return
    spec.tensor(op, name, value, ndim=1)
    if floating:
        spec.floating(op, name, value)
    else:
        spec.integer(op, name, value)
    spec.shape(op, name, value, (b,), " (one value per row)")
    if value.device != device:
        raise spec.OpError(f"{op}: {name} is on {value.device} but logits is on {device}")


def _row_values(name, value, valid, accepted: str) -> None:
    if value is None:
        return
    bad = ~valid(value.double())
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise spec.OpError(f"sample: {name}[{row}] is {value[row].item()!r}; accepted: {accepted}")


def _sample_key(logits, temperature, top_k=None, top_p=None, min_p=None, generators=None):
    op = "sample"
    spec.tensor(op, "logits", logits, ndim=2)
    b, v = logits.shape
    if v == 0:
        raise spec.OpError("sample: logits has an empty vocabulary dimension")
    spec.tensor(op, "temperature", temperature)
    _row_param("temperature", temperature, b, logits.device, True)
    _row_param("top_k", top_k, b, logits.device, False)
    _row_param("top_p", top_p, b, logits.device, True)
    _row_param("min_p", min_p, b, logits.device, True)
    if generators is not None:
        if not isinstance(generators, (list, tuple)) or len(generators) != b:
            raise spec.OpError(f"sample: generators must be None or a list of {b} torch.Generator | None, "
                               f"got {type(generators).__name__} of length {len(generators) if hasattr(generators, '__len__') else '?'}")
        for i, g in enumerate(generators):
            if g is not None and not isinstance(g, torch.Generator):
                raise TypeError(f"sample: generators[{i}] must be a torch.Generator or None, got {type(g).__name__}")
            if g is not None and g.device.type != logits.device.type:
                raise spec.OpError(f"sample: generators[{i}] is a {g.device} generator but logits is on {logits.device}")
    filters = (top_k is not None, top_p is not None, min_p is not None, generators is not None)
    return logits.device, logits.dtype, (spec.pow2(b), v), filters


def _sample_values(logits, temperature, top_k=None, top_p=None, min_p=None, generators=None) -> None:
    if logits.device.type == "cpu":  # (on GPUs reading the values would synchronise)
        _row_values("temperature", temperature, lambda t: (t >= 0) & t.isfinite(), "finite and >= 0 (0 = greedy)")
        _row_values("top_p", top_p, lambda p: (p > 0) & (p <= 1), "in (0, 1] (1 = off)")
        _row_values("min_p", min_p, lambda p: (p >= 0) & (p <= 1), "in [0, 1] (0 = off)")


def sample(logits: torch.Tensor, temperature: torch.Tensor, *, top_k: torch.Tensor | None = None,
           top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None,
           generators: list | None = None) -> torch.Tensor:
    """Draw one token per row of logits ``[B, V]``; returns int64 ``[B]``.

    Per row: ``temperature`` (0 = greedy, the argmax of the logits), then ``top_k`` (keep the
    k most likely; <= 0 = off), then ``top_p`` (keep the smallest most-likely set whose mass,
    renormalised after top-k, reaches p; 1 = off), then ``min_p`` (drop tokens whose probability
    is below ``min_p`` times the largest; 0 = off). ``generators[i]`` makes row ``i`` reproducible.
    Tokens tied with the k-th largest, or with the last token of the top-p set, are kept with it (as
    transformers and vLLM keep top-k's ties; vLLM cuts top-p's by sorted position), so which tokens a filter
    keeps never depends on an order of ties. vLLM's V1 sampler applies min-p before top-k/top-p; this order
    is its V0 sampler's.
    """
    return _SAMPLE.call(logits, temperature, top_k, top_p, min_p, generators)


_ARGMAX = Operator("argmax", argmax, _argmax_key)
_SAMPLE = Operator("sample", sample, _sample_key, _sample_values)

@register("argmax", "vendor")
def _argmax_torch(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        # torch's CPU argmax of 16-bit floats is not vectorised: 178 us for a row of 49152 bfloat16 against 49 us
        # widened first (exact, so the same index, ties and NaN included)
        return x.float().argmax(dim)
    return torch.argmax(x, dim)


def _filter_sorted(sorted_x: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """``sorted_x`` (each row largest first) with the tokens outside top-k, then top-p, set to -inf."""
    v = sorted_x.shape[1]
    if top_k is not None:  # every token at or above the k-th largest (ties with it kept, as transformers does)
        k = top_k.long()
        k = torch.where(k <= 0, v, k.clamp(max=v))
        sorted_x = sorted_x.masked_fill(sorted_x < sorted_x.gather(1, k[:, None] - 1), float("-inf"))
    if top_p is not None:
        p = top_p.float()
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove = (mass_before >= p[:, None]) & (p < 1)[:, None]
        remove[:, 0] = False
        edge = sorted_x.masked_fill(remove, float("inf")).amin(dim=-1, keepdim=True)  # the last token kept
        sorted_x = sorted_x.masked_fill(sorted_x < edge, float("-inf"))  # and every token tied with it
    return sorted_x


def _exponential(shape, device, generators) -> torch.Tensor:
    noise = torch.empty(shape, device=device, dtype=torch.float32).exponential_()
    if generators is not None:
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


_MAX_ROUNDS = 64  # rejection rounds of the CPU's top-p draw before it takes the largest token


def _uniforms(rows: int, generators) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row (the row's generator where given), on the CPU."""
    u = torch.rand(rows, dtype=torch.float64)
    if generators is not None:
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, dtype=torch.float64, generator=g)
    return u


def _draw_by_inverse_cdf(x: torch.Tensor, lowest: torch.Tensor | None, top_p, generators) -> torch.Tensor:
    """Rows of ``x`` (``_scaled`` logits: each row's largest 0, or all -inf; CPU) drawn with one uniform each and
    the cumulative sum of their weights, among tokens with ``x >= lowest`` (None: all); with top-p, a draw outside
    the nucleus (the mass above it reaches p) becomes the row's pivot and the row draws again above it: rejection,
    exact for the nucleus. Cheaper on the CPU than sorting rows or drawing noise for every token."""
    b = x.shape[0]
    weights = x.exp()  # (an all -inf row, nothing allowed, weighs nothing)
    total = weights.sum(dim=-1, dtype=torch.float64) if top_p is not None else None
    pivot = torch.full((b,), float("-inf"))
    tokens = torch.empty(b, dtype=torch.int64)
    todo = torch.arange(b)
    for round_ in range(_MAX_ROUNDS):
        everyone = len(todo) == b
        xs, ws = (x, weights) if everyone else (x[todo], weights[todo])
        allowed = ws
        if lowest is not None:
            allowed = allowed * (xs >= (lowest if everyone else lowest[todo])[:, None])
        if round_ > 0:
            allowed = allowed * (xs > pivot[todo, None])
        cdf = allowed.cumsum(dim=-1, dtype=torch.float64)
        gens = None if generators is None else [generators[i] for i in todo.tolist()]
        # (below the row's total, so the first column whose cumulative weight exceeds it has a weight of its own)
        last = cdf[:, -1]
        target = torch.minimum(_uniforms(len(todo), gens) * last, torch.nextafter(last, torch.zeros_like(last)))
        drawn = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=x.shape[1] - 1)
        if not bool((last > 0).all()):
            drawn = torch.where(last > 0, drawn, xs.argmax(dim=-1))  # nothing allowed (all -inf): as argmax
        if top_p is None:
            return drawn
        x_drawn = xs.gather(1, drawn[:, None])
        above = (ws * (xs > x_drawn)).sum(dim=-1, dtype=torch.float64)
        inside = above < top_p[todo].double() * total[todo]
        tokens[todo[inside]] = drawn[inside]
        pivot[todo[~inside]] = x_drawn.squeeze(1)[~inside]
        todo = todo[~inside]
        if len(todo) == 0:
            return tokens
    tokens[todo] = x[todo].argmax(dim=-1)  # (not seen: the largest token is always in the nucleus)
    return tokens


def _scaled(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``logits / t`` (``t`` ``[B, 1]``) in float32, each row's largest logit taken off first; a new tensor.

    Taken off first, a tiny temperature sends the smaller logits to -inf (the greedy limit) instead of
    overflowing several of them to +inf. A row holding +inf logits (a float16 model's overflow) becomes 0
    at those and -inf elsewhere, so a draw picks among them alike; a row with nothing allowed stays -inf.
    """
    x = logits.float()
    top = x.amax(dim=-1, keepdim=True)
    shift = torch.where(top.isfinite(), top, 0.0)
    x = (x - shift if x is logits else x.sub_(shift)).div_(t)  # (the caller's logits intact)
    overflowed = top == float("inf")
    if x.device.type != "cpu" or bool(overflowed.any()):  # (reading the flag is free only on the CPU)
        x = torch.where(overflowed, torch.where(logits == float("inf"), 0.0, float("-inf")), x)
    return x


def _greedy_and_divisor(temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with temperature 0 (greedy), and each row's divisor ``[B, 1]`` (1 for the greedy rows)."""
    temp = temperature.float()
    greedy = temp <= 0
    return greedy, torch.where(greedy, 1.0, temp)[:, None]


@register("sample", "vendor")
def _sample_torch(logits, temperature, top_k, top_p, min_p, generators):
    if logits.device.type == "cpu":
        return _sample_cpu(logits, temperature, top_k, top_p, min_p, generators)
    return _sample_by_race(logits, temperature, top_k, top_p, min_p, generators)


def _sample_cpu(logits, temperature, top_k, top_p, min_p, generators):
    """Each row by the route its own top_k picks, so that a seeded row's token does not depend on the rows
    beside it: rows with top-k by the exponential race over their sorted logits, the others by the inverse
    CDF (no sort and no noise per token: a uniform per row and the rows' cumulative weights)."""
    # skipping filters idle in every row (a host read, free on the CPU) changes no row's draw
    top_k = None if top_k is None or not bool((top_k > 0).any()) else top_k
    top_p = None if top_p is None or not bool((top_p < 1).any()) else top_p
    min_p = None if min_p is None or not bool((min_p > 0).any()) else min_p
    if top_k is None:
        return _sample_by_inverse_cdf(logits, temperature, top_p, min_p, generators)
    with_top_k = top_k > 0
    if bool(with_top_k.all()):
        return _sample_by_race(logits, temperature, top_k, top_p, min_p, generators)
    by_race, by_cdf = with_top_k.nonzero().squeeze(1), (~with_top_k).nonzero().squeeze(1)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    tokens[by_race] = _sample_by_race(*_rows(by_race, logits, temperature, top_k, top_p, min_p, generators))
    tokens[by_cdf] = _sample_by_inverse_cdf(*_rows(by_cdf, logits, temperature, top_p, min_p, generators))
    return tokens


def _rows(index: torch.Tensor, *args) -> list:
    """Per-row arguments (tensors, lists of generators, None) restricted to the rows at ``index``."""
    picked = []
    for arg in args:
        if isinstance(arg, (list, tuple)):
            arg = [arg[i] for i in index.tolist()]
        elif arg is not None:
            arg = arg[index]
        picked.append(arg)
    return picked


def _sample_by_inverse_cdf(logits, temperature, top_p, min_p, generators):
    greedy, t = _greedy_and_divisor(temperature)
    x = _scaled(logits, t)
    lowest = None
    if min_p is not None:
        lowest = torch.where(min_p > 0, x.amax(dim=-1) + torch.log(min_p.float().clamp_min(1e-30)), float("-inf"))
    drawn = _draw_by_inverse_cdf(x, lowest, top_p, generators)
    return torch.where(greedy, _argmax_torch(logits, -1), drawn) if bool(greedy.any()) else drawn


def _sample_by_race(logits, temperature, top_k, top_p, min_p, generators):
    greedy, t = _greedy_and_divisor(temperature)
    order = None
    if top_k is None and top_p is None:
        x = _scaled(logits, t)
    else:
        # Top-k and top-p need each row largest first. Dividing by a row's (positive) temperature keeps its order,
        # so the logits are sorted as they come (a bfloat16 model's: 16-bit keys, half the radix passes of float32)
        # and the token is drawn in that order, then mapped back through ``order`` (no scatter of the whole row).
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        # top-k compares the logits themselves (divided by t, distinct logits can round to one value)
        x = _filter_sorted(_scaled(_filter_sorted(sorted_logits.float(), top_k, None), t), None, top_p)
    if min_p is not None:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p.float()[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    noise = _exponential(x.shape, x.device, generators)
    if order is not None:  # each token keeps its column's noise: a row draws the same token on either path
        noise = noise.gather(1, order)
    drawn = (x - noise.log_()).argmax(dim=-1)
    if order is not None:
        drawn = order.gather(1, drawn[:, None]).squeeze(1)
    return torch.where(greedy, _argmax_torch(logits, -1), drawn)
