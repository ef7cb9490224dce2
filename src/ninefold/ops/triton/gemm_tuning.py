"""Measured configurations of the split-K GEMM (``ninefold.ops.triton.gemm``), per shape.

For one (device, dtype, M rounded up to 16, N, K, bias or not) the tuner times every candidate (tile
shape x split of K x pipeline depth, chosen so the launch covers the SMs one to four times, each with
pointer and, on sm_90+, TMA loads) and
cuBLAS, each over rotating copies of the weight so it streams from memory as in a model step, and
keeps the fastest; a candidate whose result differs from cuBLAS's is dropped with a warning. Results
persist in ``$NINEFOLD_CACHE_DIR/ops/gemm-<fingerprint>.json`` (the fingerprint of
``ninefold.ops.tuning``), so a second process pays nothing.

Tuning runs only where it is asked for (``with autotune():``, as ``bench.decode_gemm`` does, or
``NINEFOLD_GEMM_AUTOTUNE=1``); an untuned shape elsewhere runs cuBLAS, so a prefill chunk of an odd
size never stalls a step to tune. ``forced(cfg)`` pins one configuration (tests,
sweeps).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from ninefold.ops import timing
from ninefold.ops.choice_cache import ChoiceCache

VENDOR = "vendor"
# (block_m, block_n, block_k, num_warps, num_stages): the shapes that won or came second somewhere in
# the H200 sweep of the Llama-3-8B decode layers (64x256 and 128x256 tiles never did).
TILES = (
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 4, 3),
    (128, 128, 64, 8, 4),
)
SPLITS = (1, 2, 3, 4, 6, 7, 8)  # those dividing K's steps
MIN_K_STEPS = 4  # each split runs at least this many BLOCK_K steps

measured: dict = {}  # this process's tuning runs: shape key -> {candidate: us}, fastest first
_forced: list[dict] = []


def bucket(m: int) -> int:
    """Rows are tuned in multiples of 16 (the sizes the engine captures decode graphs at); a tuning is valid
    for any row count up to its bucket."""
    return -(-m // 16) * 16


def candidates(m: int, n: int, k: int, sms: int, tma: bool = False) -> list[dict]:
    """Configurations worth timing for an ``[m, k] x [n, k]^T`` product on a card with ``sms`` SMs
    (each twice with ``tma``: pointer loads and TMA loads)."""
    out = []
    for bm, bn, bk, warps, stages in TILES:
        if bm > 2 * bucket(m) or bk > k:
            continue
        tiles = -(-m // bm) * -(-n // bn)
        for split in SPLITS:
            steps = -(-k // bk)
            if steps % split or (split > 1 and (steps // split < MIN_K_STEPS or tiles * split > 4 * sms)):
                continue
            if split == 1 or tiles < 2 * sms:
                for loads in (False, True) if tma else (False,):
                    out.append({"block_m": bm, "block_n": bn, "block_k": bk, "split_k": split,
                                "num_warps": warps, "num_stages": stages, "tma": loads})
    return out


def tma_available(device: torch.device) -> bool:
    """Whether TMA candidates apply: a CUDA card of compute capability 9.0+ and a Triton with host
    tensor descriptors."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


CACHE = ChoiceCache("gemm", "NINEFOLD_GEMM_AUTOTUNE")
autotune = CACHE.autotune  # inside ``with autotune():`` untuned shapes are tuned on their first call


def _key(device_name: str, dtype: torch.dtype, m: int, n: int, k: int, has_bias: bool) -> str:
    return f"{device_name}|{str(dtype).removeprefix('torch.')}|{bucket(m)}|{n}|{k}|{int(has_bias)}"


@contextlib.contextmanager
def forced(cfg: dict | str):
    """Use ``cfg`` (a configuration dict, or ``"vendor"``) for every call inside this block."""
    _forced.append(cfg)
    try:
        yield
    finally:
        _forced.pop()


def choice(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, has_bias: bool) -> dict | None:
    """The configuration to run (``None``: cuBLAS), tuning it first when allowed and not yet known."""
    if _forced:
        cfg = _forced[-1]
        return None if cfg == VENDOR else cfg
    if device.type != "cuda":
        return None
    from ninefold.ops.dispatch import device_model

    key = _key(device_model(device), dtype, m, n, k, has_bias)
    known = CACHE.choices().get(key)
    if known is None:
        if not CACHE.autotune_on() or torch.cuda.is_current_stream_capturing():
            return None
        known = tune(m, n, k, dtype, device, has_bias)["choice"]
    return None if known == VENDOR else known


def tune(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, has_bias: bool = False,
         progress: bool = True) -> dict:
    """Time every candidate and cuBLAS for this shape, remember the fastest, and return
    ``{"choice": cfg or "vendor", "times_us": {...}}``."""
    from tqdm import tqdm
    from triton.runtime.errors import OutOfResources

    from ninefold.ops.dispatch import device_model
    from ninefold.ops.triton import gemm

    mb = bucket(m)
    x = torch.randn(mb, k, device=device, dtype=dtype)
    rotation = timing.RotatingWeights(n, k, dtype, device)
    weights = rotation.weights
    bias = torch.randn(n, device=device, dtype=dtype) * 0.1 if has_bias else None
    want = F.linear(x, weights[0], bias).float()
    count = gemm.counters(device)
    rotating = rotation.step

    def time_config(cfg: dict, repeats: int) -> float:
        out = torch.empty(mb, n, device=device, dtype=dtype)
        return timing.measure(rotating(lambda w: gemm.launch(x, w, bias, out, cfg, count)), device, repeats=repeats)

    times = {VENDOR: timing.measure(rotating(lambda w: F.linear(x, w, bias)), device, repeats=10)}
    results = {}
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    todo = candidates(mb, n, k, sms, tma=tma_available(device))
    for cfg in tqdm(todo, desc=f"tuning linear M={mb} N={n} K={k}", unit="cfg", disable=not progress, leave=False):
        name = describe(cfg)
        y = torch.empty(mb, n, device=device, dtype=dtype)
        try:
            gemm.launch(x, weights[0], bias, y, cfg, count)
        except OutOfResources:  # a tile shape the card cannot hold: skip it
            continue
        err = (y.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        if not err <= 2e-2:
            warnings.warn(f"split-K GEMM {name} disagrees with cuBLAS at M={mb} N={n} K={k} "
                          f"(relative error {err:.3g}); not used", stacklevel=2)
            continue
        times[name] = time_config(cfg, repeats=5)
        results[name] = cfg
    finalists = sorted(results, key=times.get)[:3]
    for name in finalists:
        times[name] = time_config(results[name], repeats=20)
    best = min([VENDOR, *finalists], key=times.get)
    picked = VENDOR if best == VENDOR else results[best]
    key = _key(device_model(device), dtype, mb, n, k, has_bias)
    CACHE.store(key, picked)
    measured[key] = {name: round(t, 3) for name, t in sorted(times.items(), key=lambda item: item[1])}
    return {"choice": picked, "times_us": measured[key]}


def measured_times(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                   has_bias: bool = False) -> dict | None:
    """What this process's tuning run of the shape measured (``{candidate: us}``, fastest first)."""
    from ninefold.ops.dispatch import device_model

    return measured.get(_key(device_model(device), dtype, m, n, k, has_bias))


def describe(cfg: dict) -> str:
    """A configuration in one line: ``128x128x64 split2 w8 s4``."""
    return (f"{cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} split{cfg['split_k']} "
            f"w{cfg['num_warps']} s{cfg['num_stages']}{' tma' if cfg.get('tma') else ''}")


def forget() -> None:
    """Drop the in-memory choices (the file is re-read on the next call)."""
    CACHE.forget()
