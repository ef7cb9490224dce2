"""The shared first half of the GEMM tuners (``cublaslt``, ``cutlass``): every candidate kernel run once
against ``F.linear`` and, where it ran and agrees, made into a timed step over rotating weights.

A candidate that raises one of the kernel's errors, or whose result is off by more than ``TOLERANCE``
(relative to the largest output), is left out with a warning naming it and the shape: a tuner must never
pick a kernel that is wrong on this card, and the caller learns why one it expected is missing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from ninefold.ops import timing

VENDOR = "vendor"  # the baseline every candidate is timed against: torch's F.linear (cuBLAS)
TOLERANCE = 2e-2


def checked_runs(kernel: str, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                 offered: Iterable[tuple[str, object]], call: Callable, errors: type[Exception] | tuple,
                 *, quiet: Callable[[Exception], bool] = lambda e: False,
                 progress: bool = True) -> tuple[dict[str, Callable], dict[str, object]]:
    """``(runs, found)`` for the product of an ``[m, k]`` input and ``[n, k]`` weights: ``runs`` maps
    ``VENDOR`` and every candidate that passed to a no-argument timed step, ``found`` each passing name to
    its candidate. ``offered`` yields ``(name, candidate)``; ``call(x, weight, out, candidate)`` runs one;
    ``errors`` are the exceptions meaning "this candidate cannot run", silent where ``quiet(error)``."""
    from tqdm import tqdm

    offered = list(offered)
    x = torch.randn(m, k, device=device, dtype=dtype)
    rotation = timing.RotatingWeights(n, k, dtype, device)
    first = rotation.weights[0]
    want = F.linear(x, first).float()
    scale = max(want.abs().max().item(), 1e-6)
    out = torch.empty(m, n, device=device, dtype=dtype)
    runs = {VENDOR: rotation.step(lambda w: F.linear(x, w))}
    found = {}
    for name, candidate in tqdm(offered, desc=f"{kernel} linear M={m} N={n} K={k}", unit="candidate",
                                disable=not progress, leave=False):
        try:
            call(x, first, out, candidate)
        except errors as e:
            if not quiet(e):
                warnings.warn(f"{kernel} {name} failed at M={m} N={n} K={k}: {e}; not used", stacklevel=3)
            continue
        err = (out.float() - want).abs().max().item() / scale
        if not err <= TOLERANCE:
            warnings.warn(f"{kernel} {name} disagrees with F.linear at M={m} N={n} K={k} (relative error "
                          f"{err:.3g}); not used", stacklevel=3)
            continue
        found[name] = candidate
        runs[name] = rotation.step(lambda w, c=candidate: call(x, w, out, c))
    return runs, found
