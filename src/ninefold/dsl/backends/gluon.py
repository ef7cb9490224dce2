"""The ``fa3`` schedule of the triton backend: flash-attention-form applications lowered to Gluon on sm_90.

The tuner offers ``{"schedule": "fa3", ...}`` configurations (see :func:`configs`) beside the Triton
ones where :func:`reason` finds none missing; it times them all and keeps the fastest. A configuration
fixes the pipeline depth (``num_stages``), whether the two consumer warpgroups take turns (``pingpong``) and
the launch order (``group``: heads visited together, 0 for one head's query blocks after another); the tuner
times three of them. ``NINEFOLD_DSL_GLUON=0`` keeps every kernel on Triton.
"""

from __future__ import annotations

import functools
import os

import torch

from ninefold.dsl.backends.gluon_codegen import BLOCK_M, MAXNREG, generate
from ninefold.dsl.backends.gluon_values import Unsupported
from ninefold.dsl.backends.launch import grid_size
from ninefold.dsl.backends.triton_codegen import _implied_strides, collapsible, specialize
from ninefold.dsl.cache import load_module
from ninefold.dsl.compiler.online_softmax import form_of
from ninefold.dsl.expr import evaluate
from ninefold.dsl.symbol import Symbol

NUM_WARPS = 4  # the default partition (consumer 0); the producer and consumer 1 are workers of 1 and 4 warps
BLOCK_N = (128, 64)


def enabled() -> bool:
    return os.environ.get("NINEFOLD_DSL_GLUON", "1") != "0"


def _gluon_available() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


def _meta(kernel, bound, block_n):
    """The meta values that make the query tile ``BLOCK_M`` rows and the key tile ``block_n`` rows (None when
    the caller fixed other sizes or the tile sizes are not meta symbols)."""
    form = form_of(kernel)
    meta = {}
    for param, middle, size in ((form.query, 0, BLOCK_M), (form.key, 1, block_n)):
        levels = kernel.param(param).arranged.levels()
        rows = levels[1 + middle]._shape[0] if len(levels) > 1 + middle else None
        if isinstance(rows, Symbol) and rows.meta and rows not in bound.env:
            if meta.get(kernel.symbol_names[rows], size) != size:
                return None
            meta[kernel.symbol_names[rows]] = size
            continue
        try:
            value = int(evaluate(rows, {**bound.env, **_symbols(kernel, meta)}))
        except Exception:  # noqa: BLE001  (a size the call does not fix)
            return None
        if value != size:
            return None
    return meta


def _symbols(kernel, meta):
    names = {kernel.symbol_names[s]: s for s in kernel.meta_symbols}
    return {names[n]: v for n, v in meta.items()}


def in_form(kernel) -> bool:
    """Whether ``kernel``'s application is in the flash-attention form (cached on the kernel)."""
    return not isinstance(form_of(kernel), str)


def applies(kernel, bound) -> bool:
    """Whether the ``fa3`` schedule can run this call (cheap where the kernel is not in the form or the device
    is not sm_90)."""
    return bound.device.type == "cuda" and in_form(kernel) and reason(kernel, bound) is None


def _block_n(kernel, bound):
    """The key tile's rows for this call: 128, or 64 where the caller fixed that (None: neither)."""
    return next((n for n in BLOCK_N if _meta(kernel, bound, n) is not None), None)


def reason(kernel, bound) -> str | None:
    """Why the ``fa3`` schedule cannot run this call (None: it can); cached per what it depends on."""
    tensors = tuple((n, tuple(v.shape), v.stride(), v.dtype, v.data_ptr() % 16 == 0)
                    for n, v in bound.values.items() if isinstance(v, torch.Tensor))
    scalars = tuple((p.name, bound.values.get(p.name)) for p in kernel.params if p.is_scalar and p.source.constexpr)
    key = ("fa3_reason", enabled(), bound.device, tensors, scalars,
           tuple(bound.env.get(leaf) for leaf in kernel.call_leaves()))
    if key not in kernel._cache:
        kernel._cache[key] = _reason(kernel, bound)
    return kernel._cache[key]


def _reason(kernel, bound) -> str | None:
    if not enabled():
        return "NINEFOLD_DSL_GLUON=0"
    if bound.device.type != "cuda" or torch.cuda.get_device_capability(bound.device)[0] != 9:
        return "not an sm_90 CUDA device (the schedule uses Hopper's wgmma)"
    if not _gluon_available():
        return "this Triton has no Gluon Hopper module"
    from ninefold.dsl.backends.triton import tma_ready  # (that module imports this one)

    form = form_of(kernel)
    if isinstance(form, str):
        return f"not in the flash-attention form: {form}"
    if not tma_ready(bound):
        return "a tensor that TMA cannot read (16-byte aligned, unit last stride, other strides multiples of 16 bytes)"
    if any(isinstance(v, torch.Tensor) and v.numel() >= 2**31 for v in bound.values.values()):
        return "a tensor of 2**31 elements or more"
    block_n = _block_n(kernel, bound)
    if block_n is None:
        return f"the caller fixed tile sizes other than BLOCK_M={BLOCK_M}, BLOCK_N in {BLOCK_N}"
    try:
        _generated(kernel, bound, {"schedule": "fa3", "meta": _meta(kernel, bound, block_n)})
    except Unsupported as error:
        return str(error)
    return None


def configs(kernel, bound) -> list[dict]:
    """The ``fa3`` configurations the tuner times for this call (none where :func:`reason` objects)."""
    if reason(kernel, bound) is not None:
        return []
    meta = _meta(kernel, bound, _block_n(kernel, bound))
    # ping-pong won every H100 run (session 29), in groups of 8 or 4 heads or row-major (once, at 8k tokens);
    # without it never did (still generated when asked for): each candidate costs a compile in the first call
    return [{"schedule": "fa3", "meta": meta, "num_warps": NUM_WARPS, "num_stages": 2, "pingpong": True, "group": group}
            for group in (8, 4, 0)]


def _finished(kernel, bound, config):
    return kernel.finish(bound, _symbols(kernel, config.get("meta", {})))


def _generated(kernel, bound, config):
    finished = _finished(kernel, bound, config)
    spec = specialize(kernel, finished.env)
    collapse = tuple((n, collapsible(v)) for n, v in sorted(finished.values.items())
                     if isinstance(v, torch.Tensor) and v.dim() > 1)
    generated = generate(kernel, finished, spec, collapse, stages=config.get("num_stages", 2),
                         pingpong=config.get("pingpong", True), group=config.get("group", 8))
    return generated, finished


def entry(kernel, bound, config):
    """``(function, grid, generated, finished)`` for this call and ``config`` (cached on the kernel)."""
    key = ("fa3", bound.device, tuple(bound.env.get(leaf) for leaf in kernel.call_leaves()),
           tuple((p.name, bound.values[p.name]) for p in kernel.params if p.is_scalar and p.source.constexpr),
           tuple(str(v.dtype) for v in bound.values.values() if isinstance(v, torch.Tensor)),
           repr(sorted((k, repr(v)) for k, v in config.items())))
    cached = kernel._cache.get(key)
    if cached is None:
        generated, finished = _generated(kernel, bound, config)
        module = load_module(generated.source, generated.key)
        cached = (getattr(module, generated.function_name), grid_size(finished), generated, finished)
        kernel._cache[key] = cached
    return cached


@functools.lru_cache(maxsize=64)
def _shared_layout(block, dtype):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype])


def descriptor(tensor, rows, block):
    """A Gluon TMA descriptor of ``tensor`` read as ``[size_0 * ... * size_rows, size_last]`` rows."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape = [tensor.numel() // tensor.shape[-1], tensor.shape[-1]]
    strides = [_implied_strides(tensor)[rows], 1]
    return TensorDescriptor(tensor, shape, strides, list(block), _shared_layout(tuple(block), tensor.dtype))


def _values(generated, finished, values):
    out = []
    for _, kind, payload in generated.arguments:
        if kind == "descriptor":
            param, rows, block = payload
            out.append(descriptor(values[param], rows, block))
        elif kind == "leaf":
            out.append(int(finished.env[payload]))
        else:
            out.append(values[payload])
    return out


def launch(kernel, bound, config):
    """Run the call with an ``fa3`` configuration."""
    function, grid, generated, finished = entry(kernel, bound, config)
    if grid == 0:
        return
    args = _values(generated, finished, bound.values)
    with torch.cuda.device(bound.device):
        function[(grid,)](*args, num_warps=NUM_WARPS, maxnreg=MAXNREG)


def warm(kernel, bound, config):
    """Compile an ``fa3`` configuration without launching it."""
    function, grid, generated, finished = entry(kernel, bound, config)
    args = _values(generated, finished, bound.values)
    with torch.cuda.device(bound.device):
        function.warmup(*args, grid=(max(grid, 1),), num_warps=NUM_WARPS, maxnreg=MAXNREG)


def launcher(kernel, bound, config, args):
    """A function of the call's positional ``args`` repeating this call's launch (descriptors rebuilt)."""
    function, grid, generated, finished = entry(kernel, bound, config)
    if grid == 0:
        return lambda args: None
    positions = {p.name: i for i, p in enumerate(p for p in kernel.params if p.passed)}
    for _, kind, payload in generated.arguments:
        if kind == "scalar" and not isinstance(args[positions[payload]], (bool, int, float)):
            return None
    from ninefold.dsl.backends.triton import _compiled_runner

    run = function[(grid,)]
    index = bound.device.index if bound.device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_device
    options = {"num_warps": NUM_WARPS, "maxnreg": MAXNREG}
    # the compiled kernel launched directly, without Triton's per-call binding (as the Triton path does)
    direct = [_compiled_runner(function, _values(generated, finished, bound.values), grid, options, index)]

    def launch_here(values):
        if direct[0] is not None:
            runner, stream = direct[0]
            try:
                runner(*values, stream=stream(index))
                return
            except Exception:  # the launcher refused the arguments: Triton's own path from now on
                direct[0] = None
        run(*values, **options)

    def launch_fa3(args):
        values = _values(generated, finished, {name: args[i] for name, i in positions.items()})
        if current() == index:
            launch_here(values)
            return
        with torch.cuda.device(index):
            launch_here(values)

    return launch_fa3


def compile_for_target(kernel, args, kwargs=None, target="cuda:90", config=None):
    """Compile the ``fa3`` form of ``kernel`` for ``args`` (example tensors, any device) without a GPU;
    ``(compiled, generated)``. Raises ``Unsupported`` where the schedule does not apply."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    bound = kernel.bind(tuple(args), dict(kwargs or {}), backend="triton")
    form = form_of(kernel)
    if isinstance(form, str):
        raise Unsupported(form)
    block_n = _block_n(kernel, bound)
    if block_n is None:
        raise Unsupported(f"the caller fixed tile sizes other than BLOCK_M={BLOCK_M}, BLOCK_N in {BLOCK_N}")
    meta = _meta(kernel, bound, block_n)
    config = {"schedule": "fa3", "meta": meta, "num_stages": 2, **(config or {})}
    generated, finished = _generated(kernel, bound, config)
    module = load_module(generated.source, generated.key)
    function = getattr(module, generated.function_name)
    signature = {}
    for (name, kind, _payload), value in zip(generated.arguments, _values(generated, finished, finished.values)):
        if kind == "descriptor":
            signature[name] = mangle_type(value)
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, bool):
            signature[name] = "i1"
        else:
            signature[name] = "i32"
    backend, arch = target.split(":")
    source = GluonASTSource(function, signature, {})
    compiled = triton.compile(source, target=GPUTarget(backend, int(arch), 32),
                              options={"num_warps": NUM_WARPS, "maxnreg": MAXNREG})
    return compiled, generated
