"""The ``cpu`` backend: one run of the application for all programs at once.

The grid dimensions become the leading dimensions of every torch tensor in the run. A tile read
is a strided view of the source when its index map is affine and in bounds, a view of a padded
copy (padded with ``other``) when only the source's bounds are crossed, and a gather otherwise.
Writes mirror that (view copy, padded round trip, scatter).
"""

from __future__ import annotations

import ast
import itertools
import math

import torch

from ninefold.dsl import language
from ninefold.dsl.compiler.access import analyze
from ninefold.dsl.compiler.frontend import NF
from ninefold.dsl.expr import StrideOf, affine, binary, conjunction, evaluate, interval
from ninefold.dsl.kernel import level_shapes

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8, torch.int16, torch.bool)
TORCH_OPS = {"min": torch.minimum, "max": torch.maximum}
LOOP_COST = 100_000
PROGRAM_COST = 256
MAX_CONFIGS = 4096


def run(kernel, bound):
    """Run ``kernel`` on cpu tensors."""
    for p in bound.tensor_params():
        value = bound.values[p.name]
        if value.dtype not in DTYPES:
            raise TypeError(
                f"kernel {kernel.name}: argument {p.name} has dtype {value.dtype}; the cpu backend runs "
                f"{', '.join(str(d).replace('torch.', '') for d in DTYPES)}"
            )
        if value.device.type != "cpu":
            raise ValueError(f"kernel {kernel.name}: backend 'cpu' needs cpu tensors; {p.name} is on {value.device}")
    meta = choose_meta(kernel, bound)
    bound = kernel.finish(bound, meta)
    function = _compiled(kernel)
    program = Program(kernel, bound)
    previous = language.BATCH.ndim, language.BATCH.shape
    language.BATCH.ndim, language.BATCH.shape = len(bound.grid), bound.grid
    try:
        with torch.no_grad():
            function(program, *[bound.values[p.name] if p.is_scalar else None for p in kernel.params])
    finally:
        language.BATCH.ndim, language.BATCH.shape = previous


def choose_meta(kernel, bound, gpu=False) -> dict:
    """Meta symbols not given by the caller: the configuration touching the fewest elements.

    With ``gpu``, only configurations whose tiles hold at most 16384 elements (a default for
    compiling without timing, as AOT does).
    """
    free = [s for s in kernel.meta_symbols if s not in bound.env]
    if not free:
        return {}
    key = ("meta", gpu, tuple(sorted((kernel.leaf_name(k), v) for k, v in bound.env.items() if not isinstance(k, StrideOf))))
    if key not in kernel._cache:
        kernel._cache[key] = _choose_meta(kernel, bound, free, gpu)
    return kernel._cache[key]


def _choose_meta(kernel, bound, free, gpu):
    best, best_cost = None, None
    choices = [list(reversed(s.candidates())) for s in free]
    if gpu:
        choices = [[c for c in cs if c <= 128] or cs[-1:] for cs in choices]
    for values in itertools.islice(itertools.product(*choices), MAX_CONFIGS):
        env = dict(bound.env)
        env.update(zip(free, values))
        try:
            cost = 0
            for p in bound.tensor_params():
                shapes = level_shapes(p.arranged, env)
                cost += math.prod(s for shape in shapes for s in shape)
                if len(shapes) > 2:
                    cost += LOOP_COST * math.prod(shapes[1])
                if gpu:
                    cost += PROGRAM_COST * math.prod(shapes[0])
        except (ZeroDivisionError, ValueError):
            continue
        if best_cost is None or cost < best_cost:
            best, best_cost = values, cost
    if best is None:
        best = [c[-1] for c in choices]
    return dict(zip(free, best))


def _compiled(kernel):
    if "cpu" not in kernel._cache:
        tree = _BatchSubscripts().visit(_copy(kernel.app.tree))
        ast.fix_missing_locations(tree)
        module = ast.Module([tree], type_ignores=[])
        namespace = dict(kernel.app.namespace)
        namespace["range"] = _range
        exec(compile(module, f"<ninefold cpu: {kernel.name}>", "exec"), namespace)
        kernel._cache["cpu"] = namespace[tree.name]
    return kernel._cache["cpu"]


def _range(*args):
    """``range`` whose bounds may be per-program tensors (then the loop runs to their maximum)."""
    return range(*[int(a.max().item()) if isinstance(a, torch.Tensor) else int(a) for a in args])


def _copy(tree):
    return ast.parse(ast.unparse(tree)).body[0]


class _BatchSubscripts(ast.NodeTransformer):
    """``v[i]`` on a value becomes ``_nf.subscript(v, i)`` (which skips the grid dimensions)."""

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if isinstance(node.ctx, ast.Load):
            call = ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), "subscript", ast.Load()), [node.value, node.slice], [])
            return ast.copy_location(call, node)
        return node


class Program:
    """The ``_nf`` object of a cpu run: loads, stores and shape queries of the parameters."""

    def __init__(self, kernel, bound):
        self.kernel = kernel
        self.bound = bound
        self.grid = bound.grid
        self.g = len(bound.grid)
        self._plans: dict = {}
        self._padded: dict = {}

    # ----------------------------------------------------------------- queries
    def shape(self, name, index):
        levels = self.kernel.param(name).arranged.levels()
        depth = 2 if index else 1
        if depth >= len(levels):
            return ()
        return tuple(int(evaluate(s, self.bound.env)) for s in levels[depth]._shape)

    def source_shape(self, name):
        return tuple(self.bound.values[name].shape)

    def dtype(self, name):
        value = self.bound.values[name]
        return value.dtype if isinstance(value, torch.Tensor) else torch.float32

    def subscript(self, value, index):
        if isinstance(value, torch.Tensor):
            index = index if isinstance(index, tuple) else (index,)
            return value[(slice(None),) * self.g + index]
        return value[index]

    def offsets(self, name, index, dim):
        plan = self._plan(name, len(index))
        access = plan.access
        env = self._env(plan, index, torch_vars=True)
        if dim is None:
            value = sum(
                evaluate(e, env, TORCH_OPS) * self.bound.values[name].stride(d) for d, e in enumerate(access.source_index)
            )
        else:
            value = evaluate(access.source_index[dim], env, TORCH_OPS)
        full = [*self.grid, *plan.tile_shape]
        value = torch.as_tensor(value).expand(full) if not isinstance(value, torch.Tensor) else value
        keep = [d for d, var in enumerate(access.tile_vars) if dim is None or var in access.source_index[dim].leaves()]
        value = value.expand([*value.shape[: self.g], *value.shape[self.g :]]) if value.ndim == len(full) else value.expand(full)
        index_ = (slice(None),) * self.g + tuple(slice(None) if d in keep else 0 for d in range(len(plan.tile_shape)))
        return value[index_]

    # ----------------------------------------------------------------- access plans
    def _plan(self, name, n):
        key = (name, n)
        if key not in self._plans:
            self._plans[key] = _Plan(self, name, analyze(self.kernel.param(name).arranged, n, name))
        return self._plans[key]

    def _env(self, plan, index, torch_vars):
        env = dict(self.bound.env)
        for var, value in zip(plan.access.middle_vars, index):
            env[var] = _int(value, plan.name)
        if torch_vars:
            env.update(plan.torch_vars)
        return env

    def load(self, name, index):
        plan = self._plan(name, len(index))
        source = self.bound.values[name]
        if plan.kind == "view":
            return plan.view(source, self._env(plan, index, False))
        if plan.kind == "padded":
            key = name
            if key not in self._padded:
                self._padded[key] = plan.pad(source)
            return plan.view(self._padded[key], self._env(plan, index, False))
        return plan.gather(source, self._env(plan, index, True))

    def store(self, name, index, value):
        plan = self._plan(name, len(index))
        target = self.bound.values[name]
        full = [*self.grid, *plan.tile_shape]
        value = torch.as_tensor(value, dtype=target.dtype) if not isinstance(value, torch.Tensor) else value.to(target.dtype)
        if value.ndim > len(full):
            raise ValueError(f"store to {name}: value has {value.ndim - self.g} tile dims, the tile {plan.tile_shape} has {len(plan.tile_shape)}")
        value = value.reshape((1,) * (len(full) - value.ndim) + tuple(value.shape)) if value.ndim < len(full) else value
        value = value.expand(full)
        self._padded.pop(name, None)
        if plan.kind == "view":
            plan.write_view(target, self._env(plan, index, False), value)
        elif plan.kind == "padded":
            padded = plan.pad(target, fill=not plan.covers())
            plan.write_view(padded, self._env(plan, index, False), value)
            target.copy_(padded[tuple(slice(lo, lo + s) for lo, s in zip(plan.pad_lo, target.shape))])
        else:
            plan.scatter(target, self._env(plan, index, True), value)


def _int(value, name):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}[...]: a middle-level index must be the same for all programs on the cpu backend")
        value = value.item()
    return int(value)


class _Plan:
    """How one access pattern of one parameter is read and written in this call."""

    def __init__(self, program, name, access):
        self.name = name
        self.access = access
        bound = program.bound
        env = bound.env
        self.other = access.top.source.other
        self.grid = program.grid
        self.g = program.g
        self.tile_shape = tuple(int(evaluate(s, env)) for s in access.tile_shape)
        middle_shape = tuple(int(evaluate(s, env)) for s in access.middle_level._shape) if access.middle_level is not None else ()
        variables = (*access.grid_vars, *access.tile_vars)
        sizes = (*self.grid, *self.tile_shape)
        ranges = {v: (0, n - 1) for v, n in zip(variables, sizes)}
        ranges.update({v: (0, max(n - 1, 0)) for v, n in zip(access.middle_vars, middle_shape)})
        ranges.update({leaf: (val, val) for leaf, val in env.items() if isinstance(val, int)})
        self.full = sizes
        rank = len(sizes)
        self.torch_vars = {
            v: torch.arange(n).reshape([n if i == d else 1 for i in range(rank)]) for d, (v, n) in enumerate(zip(variables, sizes))
        }
        live = [c for c in access.conditions if interval(c, ranges) != (1, 1)]
        self.mask = conjunction(live)
        tensor = bound.values[name]
        self.source_shape = tuple(tensor.shape)
        affines = [affine(e, set(variables) | set(access.middle_vars), env) for e in access.source_index]
        self.kind = "gather"
        if all(a is not None for a in affines) and not any(s == 0 for s in sizes):
            self.affines = affines
            bounds_only = set()
            for d, e in enumerate(access.source_index):
                bounds_only.add(binary(">=", e, 0))
                bounds_only.add(binary("<", e, access.top.source._shape[d]))
            if not live:
                self.kind = "view"
                self.pad_lo = (0,) * len(affines)
            elif all(c in bounds_only for c in live):
                self.kind = "padded"
                spans = [interval(e, ranges) for e in access.source_index]
                self.pad_lo = tuple(max(0, -lo) for lo, _ in spans)
                self.pad_hi = tuple(max(0, hi - (n - 1)) for (_, hi), n in zip(spans, self.source_shape))

    # views -------------------------------------------------------------
    def _geometry(self, tensor, env):
        strides = tensor.stride()
        offset = tensor.storage_offset()
        var_strides = []
        variables = (*self.access.grid_vars, *self.access.tile_vars)
        for d, (const, coefs) in enumerate(self.affines):
            offset += (const + self.pad_lo[d]) * strides[d]
            for m in self.access.middle_vars:
                offset += coefs.get(m, 0) * env[m] * strides[d]
        for v in variables:
            var_strides.append(sum(coefs.get(v, 0) * strides[d] for d, (_, coefs) in enumerate(self.affines)))
        return offset, var_strides

    def view(self, tensor, env):
        offset, strides = self._geometry(tensor, env)
        sizes = [1 if st == 0 else n for n, st in zip(self.full, strides)]
        return tensor.as_strided(sizes, strides, offset)

    def write_view(self, tensor, env, value):
        offset, strides = self._geometry(tensor, env)
        sizes = [1 if st == 0 else n for n, st in zip(self.full, strides)]
        value = value[tuple(slice(-1, None) if st == 0 else slice(None) for st in strides)]
        tensor.as_strided(sizes, strides, offset).copy_(value)

    def pad(self, tensor, fill=True):
        """A contiguous copy of ``tensor`` with ``other`` around it (borders left empty unless ``fill``)."""
        shape = [lo + n + hi for lo, n, hi in zip(self.pad_lo, tensor.shape, self.pad_hi)]
        out = torch.empty(shape, dtype=tensor.dtype)
        center = tuple(slice(lo, lo + n) for lo, n in zip(self.pad_lo, tensor.shape))
        if fill:
            out[center] = tensor
            other = 0 if self.other is None else self.other
            for d, (lo, n, hi) in enumerate(zip(self.pad_lo, tensor.shape, self.pad_hi)):
                head = (slice(None),) * d
                if lo:
                    out[head + (slice(0, lo),)] = other
                if hi:
                    out[head + (slice(lo + n, None),)] = other
        return out

    def covers(self) -> bool:
        """Whether the tiles write every in-bounds element (so a padded write needs no initial copy)."""
        variables = (*self.access.grid_vars, *self.access.tile_vars)
        used: set = set()
        for d, (const, coefs) in enumerate(self.affines):
            terms = sorted((c, self.full[variables.index(v)]) for v, c in coefs.items() if c and v in variables)
            if const > 0 or any(v in used for v in coefs) or any(v in coefs for v in self.access.middle_vars):
                return False
            used |= set(coefs)
            reach = const
            for coef, n in terms:
                if coef <= 0 or coef > reach - const + 1:
                    return False
                reach += coef * (n - 1)
            if reach < self.source_shape[d] - 1:
                return False
        return True

    # gathers -----------------------------------------------------------
    def _offsets(self, tensor, env):
        offsets = 0
        for d, e in enumerate(self.access.source_index):
            offsets = offsets + evaluate(e, env, TORCH_OPS) * tensor.stride(d)
        mask = evaluate(self.mask, env, TORCH_OPS)
        offsets = torch.as_tensor(offsets, dtype=torch.int64)
        return offsets, mask

    def gather(self, tensor, env):
        offsets, mask = self._offsets(tensor, env)
        flat = _flat(tensor)
        if isinstance(mask, torch.Tensor):
            safe = torch.where(mask, offsets, 0)
            values = flat[safe]
            other = 0 if self.other is None else self.other
            return torch.where(mask, values, torch.tensor(other, dtype=values.dtype))
        if not mask:
            return torch.full(self.full, 0 if self.other is None else self.other, dtype=tensor.dtype)
        return flat[offsets]

    def scatter(self, tensor, env, value):
        offsets, mask = self._offsets(tensor, env)
        offsets = offsets.expand(self.full)
        flat = _flat(tensor)
        if isinstance(mask, torch.Tensor):
            mask = mask.expand(self.full)
            flat[offsets[mask]] = value[mask]
        elif mask:
            flat[offsets.reshape(-1)] = value.reshape(-1)


def _flat(tensor):
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if n > 0)
    if tensor.numel() == 0:
        span = 0
    return tensor.as_strided((span,), (1,), tensor.storage_offset())
