"""``make`` and ``jit``: bind an arrangement and an application into a callable kernel."""

from __future__ import annotations

import functools
import hashlib
import inspect

from ninefold.dsl.kernel import Kernel, Param
from ninefold.dsl.symbol import Symbol
from ninefold.dsl.tensor import Tensor


def _clone_source(tensor: Tensor, name: str) -> Tensor:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"make: tensors must be ninefold.dsl.Tensor, got {type(tensor).__name__} for {name!r}")
    if not tensor.is_source:
        raise TypeError(f"make: tensors must be plain Tensor(...) parameters, got an arranged tensor for {name!r}")
    shape = [None if s.__class__.__name__ == "SizeOf" else s for s in tensor._shape]
    return Tensor(
        shape=shape,
        dtype=tensor.dtype,
        other=tensor.other,
        shape_options=tensor._shape_options,
        constexpr=tensor.constexpr or None,
        value=tensor.value,
        name=name,
    )


def _default_symbols(func) -> dict:
    """Anonymous symbols that are defaults of ``func``'s keyword parameters, named after them."""
    names = {}
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return names
    for param in signature.parameters.values():
        if isinstance(param.default, Symbol) and param.default.name is None:
            names.setdefault(param.default, param.name)
    return names


def _source_text(func) -> str:
    if isinstance(func, functools.partial):
        return _source_text(func.func) + repr(sorted(func.keywords.items(), key=lambda kv: kv[0])) + repr(func.args)
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        return getattr(func, "__qualname__", repr(func))


def _check_name(name, what):
    if name is not None and (not isinstance(name, str) or not name.isidentifier()):
        raise ValueError(f"{what}={name!r}: a kernel name must be a Python identifier (it names the generated code)")


def _check_caller(caller):
    if caller not in (None, "torch"):
        raise ValueError(f"caller={caller!r}: ninefold.dsl kernels are called with torch tensors (caller='torch')")


def make(
    arrangement,
    application,
    tensors,
    *,
    num_warps=None,
    num_stages=None,
    max_num_configs=None,
    name=None,
    kernel_name=None,
    caller=None,
):
    """Make a kernel from an ``arrangement``, an ``application`` and the symbolic ``tensors``.

    ``arrangement(*tensors)`` returns the arranged tensors (one per application parameter);
    ``application`` is the serial code of one program. ``num_warps``/``num_stages`` fix those
    launch options (otherwise tuned); ``max_num_configs`` caps how many configurations the tuner
    tries. ``kernel_name`` (or ``name``) names the kernel; ``caller`` is accepted for NineToothed
    compatibility and must be ``"torch"`` if given.
    """
    _check_caller(caller)
    _check_name(name, "name")
    _check_name(kernel_name, "kernel_name")
    name = name or kernel_name
    tensors = tuple(tensors)
    app_params = list(inspect.signature(application).parameters)
    if len(app_params) != len(tensors):
        raise ValueError(
            f"make: application {application.__name__} takes {len(app_params)} parameters "
            f"{tuple(app_params)}, but {len(tensors)} tensors were given"
        )
    sources = [_clone_source(t, n) for t, n in zip(tensors, app_params)]
    arranged = arrangement(*sources)
    if isinstance(arranged, Tensor):
        arranged = (arranged,)
    arranged = tuple(arranged)
    if len(arranged) != len(tensors):
        raise ValueError(f"make: arrangement returned {len(arranged)} tensors for {len(tensors)} parameters")
    params = []
    for name_, source, arranged_ in zip(app_params, sources, arranged):
        if not isinstance(arranged_, Tensor):
            raise TypeError(f"make: arrangement returned {type(arranged_).__name__} for {name_!r}, expected a Tensor")
        if arranged_.source is not source:
            raise ValueError(f"make: the arranged tensor for {name_!r} is made from another parameter's tensor")
        params.append(Param(name_, arranged_.source, arranged_))
    key = hashlib.sha256(
        (_source_text(arrangement) + _source_text(application) + repr([_spec(t) for t in tensors])).encode()
    ).hexdigest()
    return Kernel(
        name or application.__name__,
        params,
        application,
        symbol_names=_default_symbols(arrangement),
        num_warps=num_warps,
        num_stages=num_stages,
        max_num_configs=max_num_configs,
        identity=key,
    )


def _spec(tensor):
    return (tensor.ndim, repr(tensor.shape), repr(tensor.dtype), repr(tensor.other), repr(tensor._shape_options), tensor.constexpr, repr(tensor.value))


def jit(func=None, *, num_warps=None, num_stages=None, max_num_configs=None, kernel_name=None, caller=None):
    """Decorator form: parameters annotated with arranged tensors, the body is the application."""
    _check_caller(caller)
    _check_name(kernel_name, "kernel_name")

    def wrap(func):
        signature = inspect.signature(func, eval_str=True)
        params = []
        for name, param in signature.parameters.items():
            arranged = param.annotation
            if not isinstance(arranged, Tensor):
                raise TypeError(f"jit: parameter {name!r} of {func.__name__} must be annotated with a Tensor")
            params.append(Param(name, arranged.source, arranged))
        key = hashlib.sha256(_source_text(func).encode()).hexdigest()
        return Kernel(
            kernel_name or func.__name__,
            params,
            func,
            symbol_names={},
            num_warps=num_warps,
            num_stages=num_stages,
            max_num_configs=max_num_configs,
            identity=key,
        )

    return wrap(func) if func is not None else wrap
