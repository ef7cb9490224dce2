"""Auto-tuning of meta symbols, ``num_warps`` and ``num_stages`` for the triton backend.

Results persist in ``$NINEFOLD_CACHE_DIR/dsl/tuning/<source hash>.json``, keyed by the dtypes, a
shape bucket (sizes rounded up to powers of two, contiguity), the keyword symbols, the device name
and the Triton version, so a second process pays nothing.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import math
import os

import torch

from ninefold.dsl.cache import cache_dir, read_json, write_json
from ninefold.dsl.compiler.frontend import is_nf_call
from ninefold.dsl.expr import evaluate

DEFAULT_MAX_CONFIGS = 6
MAX_TILE_ELEMENTS = 32768
LARGE_TILE = 16384
_MEMO: dict = {}
TIMINGS = "timings"  # the tuning file's entry holding every candidate's measurement per key


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tuning_key(kernel, bound) -> str:
    """Everything that invalidates a tuning result, except the kernel source (the file name)."""
    import triton

    parts = []
    for p in kernel.params:
        value = bound.values[p.name]
        if isinstance(value, torch.Tensor):
            contiguous = "c" if value.is_contiguous() else "s"
            parts.append(f"{p.name}:{str(value.dtype).replace('torch.', '')}:{'x'.join(str(_pow2(s)) for s in value.shape)}{contiguous}")
        elif p.source.constexpr:
            parts.append(f"{p.name}={value!r}")
    for s in kernel.symbols:
        if s in bound.env:
            parts.append(f"{kernel.symbol_names[s]}={bound.env[s]}")
        elif s.meta:  # kernels that differ only in these bounds share the source hash
            parts.append(f"{kernel.symbol_names[s]}:{s.lower_bound}-{s.upper_bound}")
    # what the caller fixed at make() and the code-generation switches: kernels that differ only in these share
    # the generic source's hash, and a configuration tuned for one must not serve the other
    parts.append(f"options=w{kernel.num_warps},s{kernel.num_stages},n{kernel.max_num_configs}")
    switches = ("persistent", "grouped", "hoist", "tma", "warp_specialize")
    parts.append("switches=" + "".join(str(int(bool(getattr(kernel, name)))) for name in switches)
                 + (f",{sorted(kernel.cache_hints.items())}" if kernel.cache_hints else ""))
    device = torch.cuda.get_device_name(bound.device) if bound.device.type == "cuda" else str(bound.device)
    parts.append(f"device={device}")
    from ninefold.dsl.backends import gluon

    parts.append(f"fa3={gluon.applies(kernel, bound)}")  # False also where NINEFOLD_DSL_GLUON=0
    parts.append(f"triton={triton.__version__}")
    return "|".join(parts)


def source_hash(kernel) -> str:
    if "source_hash" not in kernel._cache:
        kernel._cache["source_hash"] = hashlib.sha256(kernel.source.encode()).hexdigest()[:24]
    return kernel._cache["source_hash"]


def candidates(kernel, bound, sm_count=132) -> list[dict]:
    """Configurations worth timing, best guesses first, pruned by the call's shapes.

    Kernels that accumulate ``dot`` products in a loop get Hopper-style matmul configurations
    (large output tiles with 8 warps and 3-4 stages, also in the persistent form; half-size tiles
    with 3-4 stages), limited by shared memory; other kernels get tiles near ``TARGET_TILE`` elements with 4 or 8 warps.
    """
    from ninefold.dsl.backends.triton_codegen import _dot_in_loop

    free = [s for s in kernel.meta_symbols if s not in bound.env]
    largest = max([max(v.shape, default=1) for v in bound.values.values() if isinstance(v, torch.Tensor)], default=1)
    choices = [[c for c in s.candidates() if c <= max(_pow2(largest), s.lower_bound or 1)] or s.candidates()[:1] for s in free]
    shapes = []
    for values in itertools.islice(itertools.product(*choices), 4096):
        shape = _tile_sizes(kernel, bound, dict(zip(free, values)))
        if shape is not None and max((n for _, n, _ in shape[0]), default=1) <= MAX_TILE_ELEMENTS:
            shapes.append((values, *shape))
    names = [kernel.symbol_names[s] for s in free]
    if _dot_in_loop(kernel):
        out = _dot_configs(kernel, names, shapes, sm_count)
    else:
        out = _plain_configs(kernel, names, shapes, sm_count)
    limit = kernel.max_num_configs or (DOT_MAX_CONFIGS if _dot_in_loop(kernel) else DEFAULT_MAX_CONFIGS)
    out = out[:limit] or [{"meta": {}, "num_warps": kernel.num_warps or 4, "num_stages": kernel.num_stages or 3}]
    if _dot_in_loop(kernel) and tma_candidates_apply(kernel, bound):
        # after the pointer-load configurations (on a tie the tuner keeps the earlier one): the first
        # configuration of each of the first TMA_CONFIGS tile shapes with TMA loads (each iteration's
        # tiles requested at its top), in the grouped and in the row-major launch order (H200 sweep,
        # attention: 128x128 gains most in the grouped order, 64x64 in the row-major one)
        firsts = {}
        for c in out:
            if not c.get("persistent"):
                firsts.setdefault(repr(sorted(c["meta"].items())), c)
        chosen = list(firsts.values())[:TMA_CONFIGS]
        out += [dict(c, tma="rows", hoist=True) for c in chosen] + [dict(c, tma="rows", hoist=True, grouped=False) for c in chosen]
        if ws_candidates_apply(kernel, bound):
            # opt-in: the same tile shapes warp-specialized (4 warps asked for: a producer and two
            # consumer warpgroups), 2 stages (3-4 computed NaN on the H200; the tuner does not check
            # results, so a candidate must be right by construction)
            out += [dict(c, tma="rows", ws=True, num_warps=4, num_stages=2) for c in chosen]
    if bound.device.type == "cuda":
        from ninefold.dsl.backends import gluon

        out += gluon.configs(kernel, bound)  # flash-attention-form applications on sm_90 (Gluon, FA3's schedule)
    return out


def ws_tuning_enabled() -> bool:
    """Whether the tuner also times warp-specialized candidates: only with ``NINEFOLD_DSL_TUNE_WS=1``
    (off by default: on the H200 they lost to the two-loop attention, see docs/perf/dsl.md)."""
    return os.environ.get("NINEFOLD_DSL_TUNE_WS", "0") == "1"


def ws_candidates_apply(kernel, bound) -> bool:
    """Warp-specialized candidates (``Kernel.warp_specialize``) for this call: where TMA candidates
    apply, the application has exactly one loop with a ``dot`` (what Triton's sm_90 pass takes),
    Triton can make descriptors on the device, and the kernel does not fix another number of warps."""
    from ninefold.dsl.backends.triton import ws_ready
    from ninefold.dsl.backends.triton_codegen import dot_loops

    if not ws_tuning_enabled() or getattr(kernel, "warp_specialize", False) or kernel.num_warps not in (None, 4):
        return False
    return dot_loops(kernel) == 1 and ws_ready(bound)




TMA_CONFIGS = 4


def tma_tuning_enabled() -> bool:
    """Whether the tuner also times TMA-descriptor loads (``NINEFOLD_DSL_TUNE_TMA``: on unless "0")."""
    return os.environ.get("NINEFOLD_DSL_TUNE_TMA", "1") != "0"


def tma_candidates_apply(kernel, bound) -> bool:
    """TMA candidates (``Kernel.tma = "rows"``) for this call: enabled, the kernel's own ``tma``
    unset, a CUDA device of compute capability >= 9 whose tensors TMA can read, and a tensor of
    three or more dimensions whose leading dimensions read as one (the case where the descriptors
    replace the most index arithmetic)."""
    from ninefold.dsl.backends.triton import tma_ready
    from ninefold.dsl.backends.triton_codegen import collapsible

    if not tma_tuning_enabled() or getattr(kernel, "tma", False) or bound.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(bound.device) < (9, 0) or not tma_ready(bound):
        return False
    return any(isinstance(v, torch.Tensor) and v.dim() >= 3 and collapsible(v) for v in bound.values.values())


DOT_MAX_CONFIGS = 9
TARGET_TILE = 4096
SHARED_MEMORY = 200 * 1024
STAGE_BYTES = 40 * 1024


def _tile_sizes(kernel, bound, meta):
    """``([(param, padded elements, bytes)], programs)`` of every access for these meta values."""
    from ninefold.dsl.backends.triton_codegen import accesses
    from ninefold.dsl.compiler.access import analyze

    env = dict(bound.env)
    env.update(meta)
    try:
        tiles = []
        for name, n in accesses(kernel):
            access = analyze(kernel.param(name).arranged, n, name)
            elements = math.prod(_pow2(int(evaluate(s, env))) for s in access.tile_shape)
            value = bound.values[name]
            size = value.element_size() if isinstance(value, torch.Tensor) else 4
            tiles.append((name, elements, elements * size if n else 0))
        first = next(p for p in bound.tensor_params())
        programs = math.prod(int(evaluate(s, env)) for s in first.arranged._shape)
    except (ZeroDivisionError, ValueError, StopIteration):
        return None
    return tiles, programs


def _config(names, values, warps, stages, kernel, persistent=False):
    config = {
        "meta": dict(zip(names, values)),
        "num_warps": kernel.num_warps or warps,
        "num_stages": kernel.num_stages or stages,
    }
    if persistent:
        config["persistent"] = True
    return config


def _dot_configs(kernel, names, shapes, sm_count):
    """Output-tile area (the largest tile not walked in the loop) decides warps and stages."""
    ranked = []
    for values, tiles, programs in shapes:
        area = max((n for _, n, b in tiles if not b), default=1)
        walked = [n for _, n, b in tiles if b] or [1]
        stage = sum(b for _, _, b in tiles)
        # square-ish operand tiles first (more products per byte loaded), then ~STAGE_BYTES per stage
        key = (programs < sm_count, -min(programs, sm_count), -area, max(walked) / min(walked), abs(math.log2(max(stage, 1) / STAGE_BYTES)))
        ranked.append((key + (-math.prod(values),), values, area, stage))
    ranked.sort(key=lambda item: item[0])
    out, per_area = [], {}
    for _, values, area, stage in ranked:
        if per_area.get(area, 0) >= 2:
            continue
        per_area[area] = per_area.get(area, 0) + 1
        if area >= 32768:  # H200 sweep: persistent 128x256x64 w8 s3 reached 97-100% of cuBLAS
            options = [(8, 3, "persistent"), (8, 3), (8, 4)]
        elif area >= 16384:
            options = [(8, 3), (8, 4), (4, 4)]
        else:
            options = [(4, 3), (4, 4)]
        for warps, stages, *persistent in options:
            if stage * (kernel.num_stages or stages) <= SHARED_MEMORY:
                out.append(_config(names, values, warps, stages, kernel, bool(persistent)))
    return _unique(out)


def _plain_configs(kernel, names, shapes, sm_count):
    """Tiles near ``TARGET_TILE`` elements (enough programs to fill the card first), 4-8 warps."""
    ranked = []
    for values, tiles, programs in shapes:
        biggest = max((n for _, n, _ in tiles), default=1)
        ranked.append(((programs < 2 * sm_count, abs(math.log2(biggest / TARGET_TILE)), -biggest), values, biggest))
    ranked.sort(key=lambda item: item[0])
    loops = any(isinstance(node, ast.For) for node in ast.walk(kernel.app.tree))
    stages = 3 if not loops else 4
    out = []
    if not ranked:
        ranked = [((), (), 1)]
    for _, values, biggest in ranked:
        if biggest >= 4 * LARGE_TILE:
            warps = [16, 8]
        elif biggest >= LARGE_TILE:
            warps = [8, 16]
        elif biggest >= 2048:
            warps = [4, 8]
        else:
            warps = [4]
        for w in warps[: 1 if len(ranked) > 2 else 2]:
            out.append(_config(names, values, w, stages, kernel))
    return _unique(out)


def _unique(configs):
    out = []
    for config in configs:
        if config not in out:
            out.append(config)
    return out


def written_params(kernel) -> frozenset:
    """Names of the parameters the application stores to (computed once per kernel)."""
    names = getattr(kernel, "_written_params", None)
    if names is None:
        names = kernel._written_params = frozenset(
            node.args[0].value for node in ast.walk(kernel.app.tree) if is_nf_call(node, "store"))
    return names


def tune(kernel, bound) -> dict:
    """The best configuration for this call's bucket (timed once, then read from the cache).

    A choice measured with a large scatter (a GPU busy with other work: see ``timing.steady``) is
    used by this process but not written to the cache, so the next process measures again.
    """
    from ninefold.dsl.backends.triton import launch

    path = cache_dir("tuning") / f"{source_hash(kernel)}.json"
    key = tuning_key(kernel, bound)
    if (path, key) in _MEMO:
        return _MEMO[(path, key)]
    stored = read_json(path).get(key)
    if stored is not None:
        _MEMO[(path, key)] = stored
        return stored
    sm_count = torch.cuda.get_device_properties(bound.device).multi_processor_count if bound.device.type == "cuda" else 132
    configs = candidates(kernel, bound, sm_count)
    timings, keep = [], True
    if len(configs) == 1:
        best = configs[0]
    else:
        best, timings = _time(kernel, bound, configs, launch)
        if timings:
            from ninefold.dsl.timing import steady

            keep = steady(timings, [t["config"] for t in timings].index(best))
    _MEMO[(path, key)] = best
    if not keep:  # measured on a busy GPU: good for this process, not worth keeping
        return best
    data = read_json(path)
    data[key] = best
    if timings:  # what the choice rests on (``python -m ninefold.bench.dsl`` reports it)
        data.setdefault(TIMINGS, {})[key] = timings
    write_json(path, data)
    return best


def _compile_in_parallel(kernel, bound, configs):
    """Compile every candidate at once (Triton releases the GIL for much of a compile)."""
    from concurrent.futures import ThreadPoolExecutor

    from ninefold.dsl.backends.triton import warm

    def one(config):
        try:
            warm(kernel, bound, config)
        except Exception:  # the timing loop reports or skips what does not compile
            pass

    with ThreadPoolExecutor(max_workers=max(1, min(len(configs), os.cpu_count() or 1))) as pool:
        list(pool.map(one, configs))


def _time(kernel, bound, configs, launch):
    """Time every candidate and return ``(best, timings)``.

    On GPUs: device time of cold-L2 calls in interleaved rounds with a noise-aware choice (see
    :mod:`ninefold.dsl.timing`); elsewhere (the interpreter never times) the first that runs.
    """
    from tqdm import tqdm

    from ninefold.dsl import timing

    _compile_in_parallel(kernel, bound, configs)
    saved = {n: bound.values[n].clone() for n in written_params(kernel)}
    runnable = []
    for config in configs:
        try:
            launch(kernel, bound, config)
        except Exception:  # configurations that do not compile or do not fit are skipped
            continue
        runnable.append(config)
    if not runnable:
        raise RuntimeError(f"kernel {kernel.name}: no configuration compiled; tried {configs}")
    if bound.device.type != "cuda" or len(runnable) == 1:
        best, timings = runnable[0], []
    else:
        fns = [lambda config=config: launch(kernel, bound, config) for config in runnable]
        with tqdm(total=len(fns) * timing.ROUNDS, desc=f"ninefold.dsl: tuning {kernel.name}", leave=False) as bar:
            samples = timing.sample(fns, bound.device, progress=bar)
        index, summary = timing.choose(samples)
        best = runnable[index]
        timings = [dict(s, config=c) for s, c in zip(summary, runnable)]
    for name, value in saved.items():
        bound.values[name].copy_(value)
    return best, timings
