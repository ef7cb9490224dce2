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
    device = torch.cuda.get_device_name(bound.device) if bound.device.type == "cuda" else str(bound.device)
    parts.append(f"device={device}")
    parts.append(f"triton={triton.__version__}")
    return "|".join(parts)


def source_hash(kernel) -> str:
    if "source_hash" not in kernel._cache:
        kernel._cache["source_hash"] = hashlib.sha256(kernel.source.encode()).hexdigest()[:24]
    return kernel._cache["source_hash"]


def candidates(kernel, bound, sm_count=132) -> list[dict]:
    """Configurations worth timing, best guesses first."""
    from ninefold.dsl.backends.triton_codegen import accesses
    from ninefold.dsl.compiler.access import analyze

    free = [s for s in kernel.meta_symbols if s not in bound.env]
    largest = max([max(v.shape, default=1) for v in bound.values.values() if isinstance(v, torch.Tensor)], default=1)
    choices = [[c for c in s.candidates() if c <= max(_pow2(largest), s.lower_bound or 1)] or s.candidates()[:1] for s in free]
    scored = []
    for values in itertools.islice(itertools.product(*choices), 4096):
        env = dict(bound.env)
        env.update(zip(free, values))
        try:
            tiles = []
            for name, n in accesses(kernel):
                access = analyze(kernel.param(name).arranged, n, name)
                tiles.append(math.prod(_pow2(int(evaluate(s, env))) for s in access.tile_shape))
            first = next(p for p in bound.tensor_params())
            programs = math.prod(int(evaluate(s, env)) for s in first.arranged._shape)
        except (ZeroDivisionError, ValueError, StopIteration):
            continue
        biggest = max(tiles, default=1)
        if biggest > MAX_TILE_ELEMENTS:
            continue
        scored.append(((programs < 2 * sm_count, -biggest, -math.prod(values), values), values, biggest))
    scored.sort(key=lambda item: item[0])
    metas = [(dict(zip((kernel.symbol_names[s] for s in free), values)), biggest) for _, values, biggest in scored]
    metas = metas or [({}, 0)]
    loops = any(isinstance(node, ast.For) for node in ast.walk(kernel.app.tree))
    stages = [kernel.num_stages] if kernel.num_stages else ([3, 4] if loops else [3])
    limit = kernel.max_num_configs or DEFAULT_MAX_CONFIGS
    out = []
    for meta, biggest in metas:
        warps = [kernel.num_warps] if kernel.num_warps else [8 if biggest >= LARGE_TILE else 4]
        for w, st in itertools.product(warps, stages):
            out.append({"meta": meta, "num_warps": w, "num_stages": st})
        if len(out) >= limit:
            break
    return out[:limit]


def written_params(kernel) -> set:
    """Names of the parameters the application stores to."""
    names = set()
    for node in ast.walk(kernel.app.tree):
        if is_nf_call(node, "store"):
            names.add(node.args[0].value)
    return names


def tune(kernel, bound) -> dict:
    """The best configuration for this call's bucket (timed once, then read from the cache)."""
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
    if len(configs) == 1:
        best = configs[0]
    else:
        best = _time(kernel, bound, configs, launch)
    data = read_json(path)
    data[key] = best
    write_json(path, data)
    _MEMO[(path, key)] = best
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
    import triton.testing
    from tqdm import tqdm

    _compile_in_parallel(kernel, bound, configs)
    saved = {n: bound.values[n].clone() for n in written_params(kernel)}
    timings = []
    for config in tqdm(configs, desc=f"ninefold.dsl: tuning {kernel.name}", leave=False):
        try:
            launch(kernel, bound, config)
            ms = triton.testing.do_bench(lambda config=config: launch(kernel, bound, config), warmup=5, rep=20)
        except Exception:  # configurations that do not compile or do not fit are skipped
            continue
        timings.append((ms, config))
    for name, value in saved.items():
        bound.values[name].copy_(value)
    if not timings:
        raise RuntimeError(f"kernel {kernel.name}: no configuration compiled; tried {configs}")
    return min(timings, key=lambda item: item[0])[1]
