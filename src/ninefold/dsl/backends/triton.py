"""The ``triton`` backend: generated Triton code launched on the tensors' device."""

from __future__ import annotations

import os

import torch

from ninefold.dsl import aot
from ninefold.dsl.backends import gluon, triton_startup
from ninefold.dsl.backends.launch import argument_values, grid_size, prepare
from ninefold.dsl.backends.triton_codegen import _implied_strides, descriptor

DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "i1",
}
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3


def check(kernel, bound):
    """The tensors must be on a device Triton drives and of a dtype it supports."""
    for p in bound.tensor_params():
        value = bound.values[p.name]
        if value.dtype not in DTYPES:
            accepted = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
            raise TypeError(f"kernel {kernel.name}: argument {p.name} has dtype {value.dtype}; the triton backend runs {accepted}")
        if value.device.type == "cpu" and not interpreting():
            raise ValueError(
                f"kernel {kernel.name}: backend 'triton' needs GPU tensors; {p.name} is on cpu "
                "(use backend='cpu' or backend='interpret')"
            )


def interpreting() -> bool:
    """Whether Triton runs under its interpreter (``TRITON_INTERPRET=1``): cpu tensors, no timing."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _env_key(kernel, bound):
    return (bound.device, tuple(bound.env.get(leaf) for leaf in kernel.call_leaves()), _dtypes(kernel, bound))


def _dtypes(kernel, bound):
    return tuple(v.dtype for v in bound.values.values() if isinstance(v, torch.Tensor))


def run(kernel, bound):
    """Tune (or take the cached tuning), then launch."""
    launch(kernel, bound, _config(kernel, bound))


def _config(kernel, bound):
    check(kernel, bound)
    # the fa3 schedule's applicability (alignment, sizes that tiles overhang) is part of what a choice rests on
    key = ("config",) + _env_key(kernel, bound) + (gluon.applies(kernel, bound),)
    config = kernel._cache.get(key)
    if config is None:
        free = [s for s in kernel.meta_symbols if s not in bound.env]
        if free or kernel.num_warps is None or kernel.num_stages is None:
            from ninefold.dsl.tuning import candidates, tune

            config = candidates(kernel, bound)[0] if interpreting() else tune(kernel, bound)
        else:
            config = {"meta": {}, "num_warps": kernel.num_warps, "num_stages": kernel.num_stages}
        kernel._cache[key] = config
    return config


def launcher(kernel, bound, args):
    """A function of the call's positional ``args`` that repeats this call's launch.

    Everything that depends only on shapes, strides, dtypes, devices and scalar values (the
    generated function, the grid, the argument list around the tensors, the launch options) is
    fixed here, so a warm call (:meth:`Kernel.__call__` finds it by :func:`kernel.call_key`)
    costs a list copy and the launch: on CUDA, of the compiled kernel itself (see
    ``_compiled_runner``), elsewhere (the interpreter) through ``function[grid]``.
    """
    config = _config(kernel, bound)
    if config.get("schedule") == "fa3":
        return gluon.launcher(kernel, bound, config, args)
    function, grid, template, num_warps, num_stages = _entry(kernel, bound, config)
    if grid == 0:
        return _nothing
    positions = {p.name: i for i, p in enumerate(p for p in kernel.params if p.passed)}
    values, slots, descriptors = [], [], []
    for kind, payload in template:
        if kind is None:
            values.append(payload)
            continue
        if kind == "descriptor":  # rebuilt per call around the call's tensor (the box is fixed)
            name, block, rows = payload
            descriptors.append((len(values), positions[name], block, rows))
            values.append(None)
            continue
        if kind == "scalar" and not isinstance(args[positions[payload]], (bool, int, float)):
            return None  # a 0-dim tensor given for a scalar: the slow path converts it
        slots.append((len(values), positions[payload]))
        values.append(None)
    run = function[(grid,)]
    options = {"num_warps": num_warps, "num_stages": num_stages}
    device = bound.device
    scratch = _makes_descriptors(function)
    if scratch:
        device_allocator()

    def fill(out, args):
        for i, j, block, rows in descriptors:
            out[i] = descriptor(args[j], block, rows)

    if device.type != "cuda":
        def launch_here(args):
            out = values.copy()
            for i, j in slots:
                out[i] = args[j]
            if descriptors:
                fill(out, args)
            run(*out, **options)

        return launch_here
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_device
    first = values.copy()
    for i, j in slots:
        first[i] = args[j]
    if descriptors:
        fill(first, args)
    direct = [_compiled_runner(function, first, grid, options, index)]

    def launch_on_device(args):
        out = values.copy()
        for i, j in slots:
            out[i] = args[j]
        if descriptors:
            fill(out, args)
        if scratch:
            device_allocator()  # (per call: Triton's allocator is per thread)
        with _null() if current() == index else torch.cuda.device(index):
            if direct[0] is not None:
                runner, stream = direct[0]
                try:
                    runner(*out, stream=stream(index))
                    return
                except Exception:  # the launcher refused the arguments: use Triton's own path from now on
                    direct[0] = None
            run(*out, **options)

    return launch_on_device


def _compiled_runner(function, values, grid, options, index):
    """``(runner, current_stream)`` launching the compiled kernel of this call without Triton's
    per-call argument binding and cache lookup, or None where this Triton is not known to launch
    that way (before 3.3 the launcher took only the non-constexpr arguments).

    The key that finds the launcher fixes everything Triton specializes on (integer values,
    pointer alignment), so the compiled kernel is the one ``function[grid](...)`` would pick.
    """
    import triton
    from triton.runtime import driver

    try:
        version = tuple(int(part) for part in triton.__version__.split(".")[:2])
        if version < (3, 3) or os.environ.get("NINEFOLD_DSL_TRITON_LAUNCH") == "jit":
            return None
        if len(values) != len(function.arg_names):
            return None
        with torch.cuda.device(index):
            compiled = function.warmup(*values, grid=(grid,), **options)
            # the launcher takes one argument per signature entry (constexprs included since 3.3)
            if compiled is None or len(getattr(compiled.src, "signature", ())) != len(values):
                return None
            return compiled[(grid, 1, 1)], driver.active.get_current_stream
    except Exception:  # any mismatch with this Triton's internals: launch through function[grid]
        return None


def _nothing(args):
    return None


def launch(kernel, bound, config):
    """Launch with ``config`` (``meta`` values by symbol name, ``num_warps``, ``num_stages``).

    Everything but the tensors and scalars is computed once per sizes, strides and config.
    """
    if config.get("schedule") == "fa3":
        return gluon.launch(kernel, bound, config)
    function, grid, template, num_warps, num_stages = _entry(kernel, bound, config)
    if grid == 0:
        return
    args = _arguments(template, bound)
    if _makes_descriptors(function):
        device_allocator()
    with torch.cuda.device(bound.device) if bound.device.type == "cuda" else _null():
        function[(grid,)](*args, num_warps=num_warps, num_stages=num_stages)


def _makes_descriptors(function) -> bool:
    """Whether the generated function makes TMA descriptors on the device (needs an allocator)."""
    return "make_tensor_descriptor" in getattr(function, "src", "")


def _arguments(template, bound):
    """The launch arguments: the call's tensors and scalars in the template, descriptors built."""
    out = []
    for kind, payload in template:
        if kind == "descriptor":
            name, block, rows = payload
            out.append(descriptor(bound.values[name], block, rows))
        else:
            out.append(bound.values[payload] if kind else payload)
    return out


def warm(kernel, bound, config):
    """Compile ``config`` without launching it (the tuner compiles its candidates in parallel)."""
    if config.get("schedule") == "fa3":
        return gluon.warm(kernel, bound, config)
    function, grid, template, num_warps, num_stages = _entry(kernel, bound, config)
    args = _arguments(template, bound)
    with torch.cuda.device(bound.device) if bound.device.type == "cuda" else _null():
        function.warmup(*args, grid=(max(grid, 1),), num_warps=num_warps, num_stages=num_stages)


def _tma_mode(kernel, config):
    """``Kernel.tma`` or the configuration's ``"tma"``: False, True (boxes) or ``"rows"``."""
    mode = config.get("tma", getattr(kernel, "tma", False))
    return "rows" if mode == "rows" else bool(mode)


def tma_ready(bound) -> bool:
    """Whether TMA descriptors can read this call's tensors: 16-byte aligned, unit last stride,
    other strides multiples of 16 bytes (size-1 dimensions aside), on a CUDA device of compute
    capability 9 or more (or under the interpreter)."""
    for value in bound.values.values():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if value.device.type == "cuda" and torch.cuda.get_device_capability(value.device) < (9, 0):
            return False
        if value.device.type not in ("cuda", "cpu") or value.data_ptr() % 16 or value.stride(-1) != 1:
            return False
        if any(n != 1 and (s * value.element_size()) % 16 for n, s in zip(value.shape[:-1], value.stride()[:-1])):
            return False
    return True


WS_MAX_STAGES = 2


def check_ws_stages(kernel, num_stages):
    """Warp specialization only with ``num_stages <= WS_MAX_STAGES``: on an H200 under Triton 3.6, the
    warp-specialized attention returned NaN with 3 and 4 stages (DSL and hand-written alike; session 5)."""
    if num_stages > WS_MAX_STAGES:
        raise ValueError(
            f"kernel {kernel.name}: warp_specialize with num_stages={num_stages}; accepted: num_stages <= "
            f"{WS_MAX_STAGES} (Triton's sm_90 warp-specialized code computed NaN with 3-4 stages on an H200)"
        )


def ws_ready(bound) -> bool:
    """Whether the warp-specialized form can run this call: Triton >= 3.4 (``tl.make_tensor_descriptor``
    and ``tl.range(warp_specialize=)``), and every size-1 dimension's stride the one a contiguous layout
    of the later dimensions implies (the kernel builds the ``[rows, ...]`` view from the strides)."""
    import triton.language as tl

    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    for value in bound.values.values():
        if isinstance(value, torch.Tensor) and value.dim() > 1 and list(value.stride()) != _implied_strides(value):
            return False
    return True


def device_allocator():
    """Kernels that make TMA descriptors on the device need global scratch memory at launch, which
    Triton takes from ``triton.set_allocator``: set a torch one where none is set (in this thread)."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _entry(kernel, bound, config):
    key = ("launch", repr(sorted(config.get("meta", {}).items())), config.get("num_warps"), config.get("num_stages"))
    key += (config.get("persistent", getattr(kernel, "persistent", False)), repr(sorted((kernel.cache_hints or {}).items())))
    grouped = bool(config.get("grouped", getattr(kernel, "grouped", True)))
    hoist = bool(config.get("hoist", getattr(kernel, "hoist", False)))
    key += (grouped, hoist)
    ws = bool(config.get("ws", getattr(kernel, "warp_specialize", False)))
    if ws:
        check_ws_stages(kernel, kernel.num_stages or config.get("num_stages") or DEFAULT_NUM_STAGES)
    tma = "rows" if ws else _tma_mode(kernel, config)
    tma = tma if tma and tma_ready(bound) else False  # otherwise pointer loads (the launch key holds the alignment)
    ws = ws and tma == "rows" and ws_ready(bound)  # otherwise the plain loop
    key += (tma,) + (("ws",) if ws else ())
    key += _env_key(kernel, bound)
    entry = kernel._cache.get(key)
    if entry is None:
        if not interpreting():
            triton_startup.install()  # before Triton's first compile-cache lookup in this process
        aot.COUNTS["jit_prepared"] += 1
        names = {kernel.symbol_names[s]: s for s in kernel.meta_symbols}
        meta = {names[n]: v for n, v in config.get("meta", {}).items() if n in names}
        finished = kernel.finish(bound, meta)
        persistent = bool(config.get("persistent", getattr(kernel, "persistent", False)))
        generated, function = prepare(
            kernel, finished, interpret=interpreting(), persistent=persistent and not ws, tma=tma, grouped=grouped,
            hoist=hoist, ws=ws,
        )
        if ws:
            device_allocator()
        template = [
            (kind, payload) if kind in ("pointer", "scalar")
            else (kind, (payload[0], value.block_shape, payload[2])) if kind == "descriptor" else (None, value)
            for (_, kind, payload, _), value in zip(generated.arguments, argument_values(generated, finished))
        ]
        num_warps = kernel.num_warps or config.get("num_warps") or DEFAULT_NUM_WARPS
        num_stages = kernel.num_stages or config.get("num_stages") or DEFAULT_NUM_STAGES
        grid = grid_size(finished)
        if persistent and not ws:
            grid = min(grid, _sm_count(bound.device))
        entry = (function, grid, template, num_warps, num_stages)
        kernel._cache[key] = entry
    return entry


_SM_COUNTS: dict = {}


def _sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (a persistent launch starts one program per SM)."""
    if device not in _SM_COUNTS:
        cuda = device.type == "cuda"
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    return _SM_COUNTS[device]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def signature(generated, finished) -> tuple[dict, dict]:
    """Triton ``ASTSource`` signature and constexprs for a call (for ``triton.compile``)."""
    sig, constexprs = {}, {}
    for (name, kind, _, constexpr), value in zip(generated.arguments, argument_values(generated, finished)):
        if constexpr:
            sig[name] = "constexpr"
            constexprs[name] = value
        elif kind == "descriptor":
            sig[name] = f"tensordesc<{DTYPES[value.base.dtype]}[{', '.join(str(n) for n in value.block_shape)}]>"
        elif kind == "pointer":
            sig[name] = "*" + DTYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            sig[name] = "fp32"
    return sig, constexprs


def compile_for_target(
    kernel, args, kwargs=None, target="cuda:90", num_warps=DEFAULT_NUM_WARPS, num_stages=DEFAULT_NUM_STAGES, spec=None,
    assumptions=None, tma=False, ws=False,
):
    """Compile the kernel for ``args`` (example tensors, any device) to ``target`` without a GPU.

    ``spec`` is the mask specialization (default: the one for these sizes). ``assumptions`` maps
    generated argument names to ``"one"`` (compiled as the constant 1, as Triton's JIT does with
    integers equal to 1) or ``"divisible"`` (a multiple of 16; pointers: 16-byte aligned), the
    specializations the JIT path would make for this call (see ``ninefold.dsl.aot.assumptions``).
    ``tma`` generates the descriptor loads (``Kernel.tma``: True, or ``"rows"``); ``ws`` (or
    ``Kernel.warp_specialize``) the warp-specialized dot loop with descriptors made in the kernel.

    Returns ``(compiled, generated, finished_bound)``; ``compiled.asm`` holds ``cubin``/``ptx``.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bound = kernel.bind(tuple(args), dict(kwargs or {}), backend="triton")
    from ninefold.dsl.backends.cpu import choose_meta

    triton_startup.install()

    finished = kernel.finish(bound, choose_meta(kernel, bound, gpu=True))
    ws = bool(ws or getattr(kernel, "warp_specialize", False))
    if ws:
        check_ws_stages(kernel, num_stages)
    generated, function = prepare(
        kernel, finished, spec, tma="rows" if ws else tma, grouped=getattr(kernel, "grouped", True),
        hoist=getattr(kernel, "hoist", False), ws=ws,
    )
    backend, arch = target.split(":")
    sig, constexprs = signature(generated, finished)
    attrs = {}
    names = list(sig)
    for name, kind in (assumptions or {}).items():
        if kind == "one":
            sig[name], constexprs[name] = "constexpr", 1
        elif kind == "divisible":
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
        else:
            raise ValueError(f"compile_for_target: assumption {kind!r} for {name}; accepted: 'one', 'divisible'")
    source = ASTSource(function, sig, constexprs, attrs)
    compiled = triton.compile(source, target=GPUTarget(backend, int(arch), 32), options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled, generated, finished


__all__ = ["run", "launch", "compile_for_target", "signature", "grid_size"]
