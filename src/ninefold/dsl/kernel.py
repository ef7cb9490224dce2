"""The kernel object: parameters, symbols, argument checking and dispatch to a backend."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

from ninefold.dsl.compiler.frontend import normalize
from ninefold.dsl.expr import BinOp, Const, Expr, SizeOf, StrideOf, evaluate
from ninefold.dsl.symbol import Symbol
from ninefold.dsl.tensor import Tensor, level_index_vars, resolve

BACKENDS = ("cpu", "triton", "interpret")
# Names a symbol cannot have: the call's own parameters (``kernel(*args, backend=None, **symbols)``).
RESERVED_SYMBOL_NAMES = ("self", "backend")


@dataclass
class Param:
    """One kernel parameter: its source tensor and its arrangement."""

    name: str
    source: Tensor
    arranged: Tensor

    @property
    def is_scalar(self) -> bool:
        return self.source.ndim == 0

    @property
    def passed(self) -> bool:
        """Whether the caller passes it (a constexpr scalar with a value is fixed)."""
        return not (self.is_scalar and self.source.constexpr and self.source.value is not None)


@dataclass
class Bound:
    """A call's arguments, checked: values by parameter name and numbers for every leaf."""

    kernel: Kernel
    values: dict
    env: dict
    device: torch.device
    backend: str
    grid: tuple = ()
    meta: dict = field(default_factory=dict)

    def tensor_params(self):
        return [p for p in self.kernel.params if not p.is_scalar]


def ordered_leaves(exprs) -> list:
    """Leaves of the expressions in first-seen (left to right) order."""
    seen, out = set(), []

    def go(node):
        if isinstance(node, BinOp):
            go(node.a)
            go(node.b)
        elif isinstance(node, Expr) and not isinstance(node, Const) and node not in seen:
            seen.add(node)
            out.append(node)

    for e in exprs:
        go(e)
    return out


class Kernel:
    """A compiled-on-demand kernel: call it with torch tensors (and symbol values as keywords)."""

    def __init__(self, name, params, application, symbol_names, num_warps, num_stages, max_num_configs, identity):
        self.name = name
        self.params = list(params)
        self.application_func = application
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.max_num_configs = max_num_configs
        self.identity = identity
        self._source_names = {id(p.source): p.name for p in self.params}
        exprs = []
        self._requires = {}
        for p in self.params:
            if p.is_scalar:
                continue
            source_index, conditions, requires = resolve(p.arranged, level_index_vars(p.arranged))
            self._requires[p.name] = requires
            exprs += [*source_index, *conditions, *[s for lv in p.arranged.levels() for s in lv._shape]]
            exprs += [size for size, _ in requires]
        self.symbols: list[Symbol] = []
        self.symbol_names: dict = {}
        taken = {p.name for p in self.params}
        counter = 0
        for leaf in ordered_leaves(exprs):
            if isinstance(leaf, SizeOf) and id(leaf.tensor) not in self._source_names:
                raise ValueError(f"kernel {name}: the arrangement uses the size of a tensor that is not a parameter ({leaf})")
            if isinstance(leaf, Symbol) and leaf not in self.symbol_names:
                symbol_name = leaf.name or symbol_names.get(leaf)
                while symbol_name is None or (leaf.name is None and symbol_name in taken):
                    symbol_name, counter = f"BLOCK_SIZE_{counter}", counter + 1
                if symbol_name in RESERVED_SYMBOL_NAMES:
                    raise ValueError(
                        f"kernel {name}: a symbol is named {symbol_name!r}, which the kernel call takes for itself; "
                        f"rename the symbol (reserved: {', '.join(RESERVED_SYMBOL_NAMES)})"
                    )
                taken.add(symbol_name)
                self.symbol_names[leaf] = symbol_name
                self.symbols.append(leaf)
        self._size_symbols = _size_symbols(self.params, exprs)
        self.app = normalize(application, [p.name for p in self.params if not p.is_scalar])
        self._cache: dict = {}
        self._launchers: dict = {}  # call_key(...) -> prebuilt launch (see backends.triton.launcher)
        self.persistent = False  # triton backend: one program per SM looping over the tiles
        self.grouped = True  # triton backend: dot-in-loop kernels visit the last two grid dims in groups (L2 reuse)
        self.hoist = False  # triton backend, with tma: a loop iteration's descriptor loads first in its body
        self.tma = False  # triton backend: box-shaped tiles read through TMA descriptors (experimental)
        # triton backend, sm_90: the one dot loop warp-specialized (producer + two consumer warpgroups),
        # tiles read through TMA descriptors made in the kernel ("rows" mode); needs 4 warps
        self.warp_specialize = False
        # triton backend: {"load": eviction policy of every load ("evict_first", "evict_last"),
        # "store": cache modifier of every store (".cs" streams past L2, ".wb", ".cg", ".wt")}
        self.cache_hints: dict | None = None

    # ------------------------------------------------------------------ naming
    def leaf_name(self, leaf) -> str:
        """The identifier of a leaf in generated code."""
        if isinstance(leaf, Symbol):
            return self.symbol_names[leaf]
        if isinstance(leaf, SizeOf):
            kind = "stride" if isinstance(leaf, StrideOf) else "size"
            return f"{self._source_names[id(leaf.tensor)]}_{kind}_{leaf.dim}"
        raise KeyError(f"no name for {leaf!r}")

    def call_leaves(self) -> list:
        """Every size, stride and symbol leaf a call binds (a fixed order, for cache keys)."""
        if "call_leaves" not in self._cache:
            leaves = list(self.symbols)
            for p in self.params:
                if not p.is_scalar:
                    leaves += [SizeOf(p.source, d) for d in range(p.source.ndim)]
                    leaves += [StrideOf(p.source, d) for d in range(p.source.ndim)]
            self._cache["call_leaves"] = leaves
        return self._cache["call_leaves"]

    def param(self, name) -> Param:
        return next(p for p in self.params if p.name == name)

    @property
    def meta_symbols(self) -> list[Symbol]:
        return [s for s in self.symbols if s.meta]

    @property
    def keyword_symbols(self) -> list[Symbol]:
        return [s for s in self.symbols if not s.meta]

    def __repr__(self):
        return f"Kernel({self.name}({', '.join(p.name for p in self.params)}))"

    # ------------------------------------------------------------------ calling
    def __call__(self, *args, backend=None, **kwargs):
        key = call_key(args, kwargs, backend)
        launch = self._launchers.get(key)
        if launch is not None:
            return launch(args)
        bound = self.bind(args, kwargs, backend)
        aot = sys.modules.get("ninefold.dsl.aot")  # registered artifacts exist only once it is imported
        if aot is not None and aot._REGISTERED and bound.backend == "triton" and bound.device.type == "cuda":
            launch = aot.launcher(self, args, kwargs)
            if launch is not None:
                if key is not None:
                    self._launchers[key] = launch
                return launch(args)
        module = _backend(bound.backend)
        result = module.run(self, bound)
        make_launcher = getattr(module, "launcher", None)
        if make_launcher is not None and key is not None:
            launch = make_launcher(self, bound, args)
            if launch is not None:
                if len(self._launchers) >= MAX_LAUNCHERS:
                    self._launchers.clear()
                self._launchers[key] = launch
        return result

    @property
    def source(self) -> str:
        """Generated Triton source for a generic specialization (every mask kept)."""
        from ninefold.dsl.backends.triton_codegen import generate, specialize

        return generate(self, specialize(self, None)).source

    def bind(self, args, kwargs, backend=None) -> Bound:
        """Check the arguments against the parameters; raises TypeError/ValueError naming the culprit."""
        passed = [p for p in self.params if p.passed]
        if len(args) != len(passed):
            raise TypeError(
                f"kernel {self.name} takes {len(passed)} positional arguments "
                f"({', '.join(p.name for p in passed)}), got {len(args)}"
            )
        values, env, devices = {}, {}, {}
        for p in self.params:
            if not p.passed:
                values[p.name] = p.source.value
                continue
            value = args[passed.index(p)]
            if p.is_scalar:
                if isinstance(value, torch.Tensor):
                    if value.ndim != 0:
                        raise ValueError(f"kernel {self.name}: argument {p.name} is a scalar parameter, got a tensor of shape {tuple(value.shape)}")
                    value = value.item()
                if not isinstance(value, (bool, int, float)):
                    raise TypeError(f"kernel {self.name}: argument {p.name} must be a number (0-dim parameter), got {type(value).__name__}")
                values[p.name] = value
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"kernel {self.name}: argument {p.name} must be a torch.Tensor, got {type(value).__name__}")
            if value.ndim != p.source.ndim:
                raise ValueError(
                    f"kernel {self.name}: argument {p.name} has {value.ndim} dims (shape {tuple(value.shape)}), "
                    f"expected {p.source.ndim}"
                )
            for dim, size in enumerate(p.source._shape):
                if isinstance(size, Const) and size.value != value.shape[dim]:
                    raise ValueError(
                        f"kernel {self.name}: argument {p.name} has size {value.shape[dim]} in dim {dim}, expected {size.value}"
                    )
                env[SizeOf(p.source, dim)] = int(value.shape[dim])
                env[StrideOf(p.source, dim)] = int(value.stride(dim))
            if p.source.dtype is not None and value.dtype != p.source.dtype:
                raise TypeError(f"kernel {self.name}: argument {p.name} has dtype {value.dtype}, expected {p.source.dtype}")
            values[p.name] = value
            devices[p.name] = value.device
        if len(set(devices.values())) > 1:
            listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
            raise ValueError(f"kernel {self.name}: tensors on mixed devices ({listing}); expected one device")
        device = next(iter(devices.values()), torch.device("cpu"))
        names = {self.symbol_names[s]: s for s in self.symbols}
        for key, value in kwargs.items():
            if key not in names:
                accepted = ", ".join(names) or "none"
                raise TypeError(f"kernel {self.name}: unexpected keyword argument {key!r} (accepted: {accepted}, backend)")
            env[names[key]] = self._keyword_value(key, names[key], value)
        missing = [self.symbol_names[s] for s in self.keyword_symbols if s not in env]
        if missing:
            raise TypeError(f"kernel {self.name}: missing keyword argument(s) {', '.join(missing)}")
        self._check_symbolic_sizes(values, env)
        backend = backend or os.environ.get("NINEFOLD_DSL_BACKEND") or ("cpu" if device.type == "cpu" else "triton")
        if backend not in BACKENDS:
            raise ValueError(f"kernel {self.name}: backend={backend!r} is not one of {BACKENDS}")
        return Bound(self, values, env, device, backend)

    def _keyword_value(self, key, symbol, value) -> int:
        """The int value of keyword ``key`` for ``symbol``, checked against what the symbol declares."""
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"kernel {self.name}: keyword {key} must be an int, got {type(value).__name__} {value!r}")
        value = int(value)
        if symbol.meta:
            if value < 1:
                raise ValueError(f"kernel {self.name}: keyword {key} is a block size and must be a positive int, got {value}")
            if symbol.power_of_two and value & (value - 1):
                raise ValueError(
                    f"kernel {self.name}: keyword {key} is a block size and must be a power of two "
                    f"(1, 2, 4, ...), got {value}; a Symbol made with power_of_two=False takes any positive size"
                )
            return value  # a meta symbol's bounds are the tuner's search range, not a limit on the caller
        lower, upper = symbol.lower_bound, symbol.upper_bound
        if (lower is not None and value < lower) or (upper is not None and value > upper):
            accepted = f"{'-inf' if lower is None else lower}..{'inf' if upper is None else upper}"
            raise ValueError(f"kernel {self.name}: keyword {key}={value} is out of its symbol's bounds; accepted: {accepted}")
        if symbol in self._size_symbols and value < 1:
            raise ValueError(f"kernel {self.name}: keyword {key} is a size in the arrangement and must be >= 1, got {value}")
        return value

    def _check_symbolic_sizes(self, values, env, known_only=True):
        """Every source size given as a symbolic expression (``Tensor(shape=(N,))``) must equal the
        argument's size; with ``known_only``, expressions of meta symbols not yet chosen are skipped."""
        for p in self.params:
            if p.is_scalar:
                continue
            for dim, size in enumerate(p.source._shape):
                if isinstance(size, (Const, SizeOf)) or (known_only and not size.leaves() <= env.keys()):
                    continue
                expected = evaluate(size, env)
                actual = values[p.name].shape[dim]
                if expected != actual:
                    named = ", ".join(f"{self.leaf_name(leaf)}={env[leaf]}" for leaf in sorted(size.leaves(), key=self.leaf_name))
                    raise ValueError(
                        f"kernel {self.name}: argument {p.name} has size {actual} in dim {dim}, but its shape "
                        f"declares {size} there, which is {expected} ({named})"
                    )

    def finish(self, bound: Bound, meta: dict) -> Bound:
        """Fix the meta symbols, check the squeezes and that all outermost shapes agree; sets the grid."""
        env = dict(bound.env)
        for symbol, value in meta.items():
            env.setdefault(symbol, value)
        self._check_symbolic_sizes(bound.values, env, known_only=False)
        grid, first = None, None
        for p in bound.tensor_params():
            for size, message in self._requires[p.name]:
                actual = evaluate(size, env)
                if actual != 1:
                    raise ValueError(f"kernel {self.name}: argument {p.name}: {message}, but it is {actual} for these sizes")
            shape = tuple(int(evaluate(s, env)) for s in p.arranged._shape)
            if grid is None:
                grid, first = shape, p.name
            elif shape != grid:
                raise ValueError(
                    f"kernel {self.name}: outermost shapes of the arranged parameters disagree: "
                    f"{first} {grid} but {p.name} {shape}"
                )
        return Bound(self, bound.values, env, bound.device, bound.backend, grid or (), {s: env[s] for s in self.meta_symbols})


MAX_LAUNCHERS = 4096
_Tensor = torch.Tensor
_environ = os.environ


def call_key(args, kwargs, backend):
    """What a warm call's launch depends on: shapes, strides, dtypes, devices, 16-byte alignment,
    scalar values, keywords and the backend choice (None when an argument is of a kind the key
    cannot hold)."""
    key = [backend, _environ.get("NINEFOLD_DSL_BACKEND"), _environ.get("TRITON_INTERPRET")]
    for a in args:
        if isinstance(a, _Tensor):  # Triton specializes pointers on 16-byte alignment
            key.append((a.shape, a.stride(), a.dtype, a.device, a.data_ptr() & 15 == 0))
        elif a.__class__ in (int, float, bool):
            key.append((a.__class__, a))
        else:
            return None
    if kwargs:
        key.append(tuple(kwargs.items()))
    return tuple(key)


def _size_symbols(params, exprs) -> frozenset:
    """The symbols an arrangement uses as a size: a dimension of a level below the outermost (a tile
    size) or a divisor (a stride); a source size (``Tensor(shape=(N,))``) may be 0."""
    found = set()
    for p in params:
        for level in p.arranged.levels()[1:]:
            found.update(s for s in level._shape if isinstance(s, Symbol))
    stack = list(exprs)
    while stack:
        node = stack.pop()
        if isinstance(node, BinOp):
            if node.op in ("//", "%") and isinstance(node.b, Symbol):
                found.add(node.b)
            stack += [node.a, node.b]
    sources = {s for p in params for size in p.source._shape for s in size.leaves() if isinstance(s, Symbol)}
    return frozenset(found - sources)


def level_shapes(arranged: Tensor, env) -> list[tuple[int, ...]]:
    """Concrete shapes of every level."""
    return [tuple(int(evaluate(s, env)) for s in level._shape) for level in arranged.levels()]


def _backend(name):
    if name == "cpu":
        from ninefold.dsl.backends import cpu

        return cpu
    if name == "triton":
        from ninefold.dsl.backends import triton

        return triton
    from ninefold.dsl.backends import interpret

    return interpret
