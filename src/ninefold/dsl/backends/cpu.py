"""The ``cpu`` backend: one run of the application for all programs at once.

The grid dimensions become the trailing dimensions of every torch tensor in the run. A tile read
is a strided view of the source when its index map is affine and in bounds, a view of a padded
copy (padded with ``other``) when only the source's bounds are crossed, and a gather otherwise.
Writes mirror that (view copy, padded round trip, scatter).
"""

from __future__ import annotations

import ast
import itertools
import math
import types

import torch

from ninefold.dsl import language
from ninefold.dsl.compiler.access import analyze
from ninefold.dsl.compiler.frontend import NF, parse
from ninefold.dsl.expr import StrideOf, affine, binary, conjunction, evaluate, interval
from ninefold.dsl.kernel import level_shapes
from ninefold.dsl.tuning import written_params

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8, torch.int16, torch.bool)
TORCH_OPS = {"min": torch.minimum, "max": torch.maximum}
LOOP_COST = 100_000
CHUNK_BYTES = 4 << 20
MAX_CHUNKS = 32
MAX_CPU_BLOCK = 1024
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
    scalars = [_scalar_argument(p, bound.values[p.name]) if p.is_scalar else None for p in kernel.params]
    previous = language.BATCH.ndim, language.BATCH.shape
    try:
        with torch.no_grad():
            for start, stop in _chunks(kernel, bound):
                program.set_chunk(start, stop)
                language.BATCH.ndim, language.BATCH.shape = len(bound.grid), program.local_grid
                function(program, *scalars)
    finally:
        language.BATCH.ndim, language.BATCH.shape = previous


def _scalar_argument(param, value):
    """A run-time (not constexpr) number as the 0-dim tensor Triton makes of it (int32, int64 where it
    does not fit, float32), so that arithmetic on it follows tensor rules (``//`` and ``%`` truncate)."""
    if param.source.constexpr or isinstance(value, bool):
        return value
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float32)
    for dtype in (torch.int32, torch.int64):
        info = torch.iinfo(dtype)
        if info.min <= value <= info.max:
            return torch.tensor(value, dtype=dtype)
    return value


def _chunks(kernel, bound):
    """Ranges of the first grid dimension run together: about CHUNK_BYTES of tiles at a time."""
    if not bound.grid:
        return [(0, 1)]
    per_program = 0
    for p in bound.tensor_params():
        shapes = level_shapes(p.arranged, bound.env)
        per_program += math.prod(s for shape in shapes[1:] for s in shape) * bound.values[p.name].element_size()
    rows = max(1, math.prod(bound.grid[1:]))
    total = per_program * rows * bound.grid[0]
    target = max(CHUNK_BYTES, total // MAX_CHUNKS)
    step = max(1, target // max(per_program * rows, 1))
    return [(start, min(start + step, bound.grid[0])) for start in range(0, bound.grid[0], step)]


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
    """The cheapest configuration of ``free`` whose squeezed dimensions are 1 (the last candidates if none)."""
    best, best_cost = None, None
    if gpu:
        choices = [[c for c in reversed(s.candidates()) if c <= 128] or s.candidates()[:1] for s in free]
    else:  # the bounds are GPU tuning ranges; on cpu larger tiles mean fewer, larger torch ops
        choices = [_cpu_candidates(s) for s in free]
    for values in itertools.islice(itertools.product(*choices), MAX_CONFIGS):
        env = dict(bound.env)
        env.update(zip(free, values))
        try:
            cost = 0
            for p in bound.tensor_params():
                if any(evaluate(size, env) != 1 for size, _ in kernel._requires.get(p.name, ())):
                    raise ValueError("a squeezed dimension is not 1 with these blocks")
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


def _cpu_candidates(symbol):
    lo = symbol.lower_bound or 1
    values, v = [], 1
    while v <= max(MAX_CPU_BLOCK, lo):
        if v >= lo:
            values.append(v)
        v *= 2
    return list(reversed(values))


def _compiled(kernel):
    if "cpu" not in kernel._cache:
        kernel._cache["cpu"] = _batched(kernel.app.tree, kernel.app.namespace, kernel.name, {})
    return kernel._cache["cpu"]


def _batched(tree, namespace, label, done):
    """Compile ``tree`` with batch-aware subscripts and shapes; plain helper functions it calls too."""
    tree = _BatchSubscripts().visit(_copy(tree))
    ast.fix_missing_locations(tree)
    namespace = dict(namespace)
    namespace["range"] = _range
    namespace.setdefault(NF, VALUE_OPS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            value = namespace.get(node.id)
            if isinstance(value, types.FunctionType) and not (value.__module__ or "").startswith("ninefold.dsl"):
                if value not in done:
                    done[value] = None  # recursion guard; functions without source are called as they are
                    try:
                        helper_tree, helper_namespace, _ = parse(value)
                    except TypeError:
                        continue
                    done[value] = _batched(helper_tree, helper_namespace, value.__name__, done)
                if done[value] is not None:
                    namespace[node.id] = done[value]
    exec(compile(ast.Module([tree], type_ignores=[]), f"<ninefold cpu: {label}>", "exec"), namespace)
    return namespace[tree.name]


def _range(*args):
    """``range`` outside a ``for`` header: bounds that are per-program tensors run to their maximum."""
    return range(*[int(a.max().item()) if isinstance(a, torch.Tensor) else int(a) for a in args])


# Per-program masks of the enclosing loops whose bounds differ between programs (None: all run).
_ACTIVE: list = []


# Functions Triton's tensors also carry as members (``x.sum(axis=1)``, ``x.exp()``), where the language has them.
TENSOR_MEMBERS = frozenset(n for n in ("sum", "max", "min", "argmax", "argmin", "exp", "exp2", "log", "log2", "sqrt",
                                       "rsqrt", "sigmoid", "abs", "erf", "tanh", "trans", "cumsum", "ravel")
                           if hasattr(language, n))


def _integer_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and not value.dtype.is_floating_point and value.dtype != torch.bool


def _copy(tree):
    return ast.parse(ast.unparse(tree)).body[0]


class _BatchSubscripts(ast.NodeTransformer):
    """``v[i]`` on a value becomes ``_nf.subscript(v, i)`` (which skips the grid dimensions).

    ``for j in range(...)`` becomes ``for j in _nf.loop(...)``: when the bounds are per-program
    values that differ, programs outside their own bounds keep their variables (every assignment
    in the body is blended with the previous value) and their stores.
    """

    def visit_For(self, node):
        self.generic_visit(node)
        call = node.iter
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "range" and not call.keywords:
            node.iter = ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), "loop", ast.Load()), call.args, [])
            node.body = [_Blend().visit(stmt) for stmt in node.body]
        return node

    def visit_If(self, node):
        self.generic_visit(node)
        node.test = ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), "condition", ast.Load()), [node.test], [])
        return node

    def visit_While(self, node):
        """``while test:`` becomes ``for _nf_while_iteration in _nf.repeat_while(lambda: test):``, which runs
        until the test fails in every program; the programs whose test has failed keep their variables
        and stores."""
        self.generic_visit(node)
        test = ast.Lambda(_no_arguments(), node.test)
        repeat = ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), "repeat_while", ast.Load()), [test], [])
        body = [_Blend().visit(stmt) for stmt in node.body]
        return ast.copy_location(ast.For(ast.Name("_nf_while_iteration", ast.Store()), repeat, body, node.orelse), node)

    def visit_IfExp(self, node):
        """``a if test else b`` becomes ``_nf.if_exp(test, lambda: a, lambda: b)`` (a choice per program)."""
        self.generic_visit(node)
        branches = [ast.Lambda(_no_arguments(), branch) for branch in (node.body, node.orelse)]
        call = ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), "if_exp", ast.Load()), [node.test, *branches], [])
        return ast.copy_location(call, node)

    def visit_BinOp(self, node):
        self.generic_visit(node)
        method = {ast.FloorDiv: "floordiv", ast.Mod: "mod"}.get(type(node.op))
        if method is None:
            return node
        call = ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), method, ast.Load()), [node.left, node.right], [])
        return ast.copy_location(call, node)

    def visit_AugAssign(self, node):
        # ``t += v`` rebinds ``t`` (Triton values are immutable); torch's in-place op would also change
        # every other name bound to the same tensor, or the loaded tile it came from.
        self.generic_visit(node)
        if not isinstance(node.target, ast.Name):
            return node
        value = ast.BinOp(ast.Name(node.target.id, ast.Load()), node.op, node.value)
        return ast.copy_location(ast.Assign([ast.Name(node.target.id, ast.Store())], value, lineno=node.lineno), node)

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if isinstance(node.ctx, ast.Load) and node.attr in ("shape", "ndim", "T"):
            call = ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), f"value_{node.attr}", ast.Load()), [node.value], [])
            return ast.copy_location(call, node)
        if isinstance(node.ctx, ast.Load) and node.attr in TENSOR_MEMBERS:
            call = ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), "member", ast.Load()),
                            [node.value, ast.Constant(node.attr)], [])
            return ast.copy_location(call, node)
        return node

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if isinstance(node.ctx, ast.Load):
            call = ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), "subscript", ast.Load()), [node.value, node.slice], [])
            return ast.copy_location(call, node)
        return node


def _no_arguments():
    return ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])


class _Blend(ast.NodeTransformer):
    """``x = e`` / ``x op= e`` become ``x = _nf.blend(e, <x if bound>)``, and ``a, (b, c) = e``
    becomes ``a, (b, c) = _nf.blend_each(e, (<a>, (<b>, <c>)))`` (nested loops do their own)."""

    def visit_For(self, node):
        return node

    def visit_FunctionDef(self, node):
        return node

    def visit_Assign(self, node):
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            node.value = _blend_call(node.value, node.targets[0].id)
        elif len(node.targets) == 1 and _names_only(node.targets[0]):
            previous = _previous_values(node.targets[0])
            node.value = ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), "blend_each", ast.Load()),
                                  [node.value, previous], [])
        return node

    def visit_AugAssign(self, node):
        if not isinstance(node.target, ast.Name):
            return node
        name = node.target.id
        value = ast.BinOp(ast.Name(name, ast.Load()), node.op, node.value)
        return ast.copy_location(ast.Assign([ast.Name(name, ast.Store())], _blend_call(value, name), lineno=node.lineno), node)


def _names_only(target) -> bool:
    """A tuple/list target made of plain names only (nested allowed; no starred, item or attribute)."""
    return isinstance(target, (ast.Tuple, ast.List)) and all(
        isinstance(e, ast.Name) or _names_only(e) for e in target.elts)


def _previous_values(target):
    """The current values of a tuple target's names, in its shape: ``(locals().get('a'), (...))``."""
    return ast.Tuple([_previous_values(e) if isinstance(e, (ast.Tuple, ast.List)) else
                      ast.Call(ast.Attribute(ast.Call(ast.Name("locals", ast.Load()), [], []), "get", ast.Load()),
                               [ast.Constant(e.id)], []) for e in target.elts], ast.Load())


def _blend_call(value, name):
    previous = ast.Call(ast.Attribute(ast.Call(ast.Name("locals", ast.Load()), [], []), "get", ast.Load()), [ast.Constant(name)], [])
    return ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), "blend", ast.Load()), [value, previous], [])


class ValueOps:
    """How values (not parameters) are queried in a cpu run: the grid dimensions are left out."""

    def loop(self, *bounds):
        """``range(*bounds)`` where bounds may be per-program tensors: from the smallest start to the
        largest stop; while some programs are outside their own range, their mask is active."""
        if not any(isinstance(b, torch.Tensor) for b in bounds):
            yield from range(*[int(b) for b in bounds])
            return
        start, stop, step = (0, bounds[0], 1) if len(bounds) == 1 else (*bounds, 1)[:3]
        if isinstance(step, torch.Tensor):
            raise ValueError("range(): a step that differs between programs is not supported by the cpu backend")
        step = int(step)
        if step <= 0:
            raise ValueError(f"range(): the cpu backend runs positive steps per program, got {step}")
        lo = int(start.min().item()) if isinstance(start, torch.Tensor) else int(start)
        hi = int(stop.max().item()) if isinstance(stop, torch.Tensor) else int(stop)
        for j in range(lo, hi, step):
            active = torch.as_tensor(j < stop) & torch.as_tensor(j >= start)
            if isinstance(start, torch.Tensor) and step != 1:
                active = active & ((j - start) % step == 0)
            _ACTIVE.append(None if bool(active.all()) else active)
            try:
                yield j
            finally:
                _ACTIVE.pop()

    def active(self):
        """The mask of the programs that run the current loop iteration (None: all of them)."""
        masks = [m for m in _ACTIVE if m is not None]
        if not masks:
            return None
        mask = masks[0]
        for m in masks[1:]:
            mask = mask & m
        return mask

    def blend(self, value, previous):
        """``value`` for the running programs, ``previous`` for the others."""
        mask = self.active() if _ACTIVE else None
        if mask is None or previous is None:
            return value
        if not isinstance(value, torch.Tensor) and not isinstance(previous, torch.Tensor):
            value = torch.as_tensor(value)
        return torch.where(mask, value, previous)

    def blend_each(self, values, previous: tuple):
        """``blend`` for each element of a tuple assignment (``previous`` holds the targets' values
        in the target's shape)."""
        values = tuple(values)
        if len(values) != len(previous):
            raise ValueError(f"cannot unpack {len(values)} values into {len(previous)} targets")
        return tuple(self.blend_each(v, p) if isinstance(p, tuple) else self.blend(v, p)
                     for v, p in zip(values, previous))

    def condition(self, value):
        """An ``if`` test: per-program tensors must agree across the programs run together."""
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            first = value.reshape(-1)[0]
            if not bool((value == first).all()):
                raise ValueError(
                    "an `if` on a value that differs between programs is not supported by the cpu backend "
                    "(all programs run together); use nl.where"
                )
            return bool(first)
        return bool(value)

    def repeat_while(self, test):
        """The iterations of ``while test():``: while some program's test holds, with the programs
        whose test has failed (or that an enclosing loop has left) masked out as in ``loop``."""
        while True:
            value = test()
            if not isinstance(value, torch.Tensor) or value.numel() == 1:
                running = bool(value)
                mask = None
            else:
                _check_per_program(value, "a `while` test")
                running_programs = value.to(torch.bool)
                enclosing = self.active()
                if enclosing is not None:
                    running_programs = running_programs & enclosing
                running = bool(running_programs.any())
                mask = None if bool(running_programs.all()) else running_programs
            if not running:
                return
            _ACTIVE.append(mask)
            try:
                yield
            finally:
                _ACTIVE.pop()

    def if_exp(self, test, body, orelse):
        """``body() if test else orelse()``; a test that differs between programs picks per program
        (both branches are computed then, as ``nl.where`` does)."""
        if isinstance(test, torch.Tensor) and test.numel() > 1:
            _check_per_program(test, "the test of `a if test else b`")
            if not bool((test == test.reshape(-1)[0]).all()):
                chosen, other = body(), orelse()
                if not isinstance(chosen, torch.Tensor) and not isinstance(other, torch.Tensor):
                    chosen = torch.as_tensor(chosen)
                return torch.where(test.to(torch.bool), chosen, other)
            test = test.reshape(-1)[0]
        return body() if test else orelse()

    @staticmethod
    def floordiv(a, b):
        """``a // b``: on integer tensors truncated toward zero, as in Triton (C); Python's otherwise."""
        if _integer_tensor(a) or _integer_tensor(b):
            return torch.div(torch.as_tensor(a), b, rounding_mode="trunc")
        return a // b

    @staticmethod
    def mod(a, b):
        """``a % b``: on tensors (integer or float) with the dividend's sign, as in Triton (C's ``fmod``);
        Python's on plain numbers (Triton's constexprs)."""
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return torch.fmod(torch.as_tensor(a), b)
        return a % b

    def value_shape(self, value):
        """``v.shape`` of a value: its tile shape (the grid dimensions left out)."""
        return tuple(value.shape[: value.ndim - language.BATCH.ndim]) if isinstance(value, torch.Tensor) else value.shape

    @staticmethod
    def value_T(value):
        """``v.T`` of a value: its tile transposed (the grid dimensions stay where they are)."""
        return language.trans(value) if isinstance(value, torch.Tensor) else value.T

    @staticmethod
    def member(value, name):
        """``v.name`` for the functions Triton's tensors carry as members (``x.sum(axis=1)``): the
        language's function bound to a tile value, so it works on the tile, not on the whole batch."""
        return (lambda *args, **kwargs: getattr(language, name)(value, *args, **kwargs)) \
            if isinstance(value, torch.Tensor) else getattr(value, name)

    def value_ndim(self, value):
        return value.ndim - language.BATCH.ndim if isinstance(value, torch.Tensor) else value.ndim

    def subscript(self, value, index):
        if isinstance(value, torch.Tensor):
            index = index if isinstance(index, tuple) else (index,)
            if any(i is Ellipsis for i in index):
                used = sum(i is not None and i is not Ellipsis for i in index)
                at = next(n for n, i in enumerate(index) if i is Ellipsis)
                fill = (slice(None),) * (value.ndim - language.BATCH.ndim - used)
                index = index[:at] + fill + index[at + 1 :]
            return value[index + (Ellipsis,)]
        return value[index]


def _check_per_program(value, what):
    """``value`` must hold one number per program (no tile dimensions) to steer control flow."""
    if value.ndim > language.BATCH.ndim:
        raise ValueError(
            f"{what} is a tile of shape {tuple(value.shape[: value.ndim - language.BATCH.ndim])}; control flow "
            "takes one value per program (reduce the tile, or select elementwise with nl.where)"
        )


VALUE_OPS = ValueOps()


class Program(ValueOps):
    """The ``_nf`` object of a cpu run: loads, stores and shape queries of the parameters.

    The run may be split into chunks of programs along the first grid dimension (so that the
    temporaries of one chunk stay in cache); ``set_chunk`` selects the programs of the next pass.
    """

    def __init__(self, kernel, bound):
        self.kernel = kernel
        self.bound = bound
        self.grid = bound.grid
        self.g = len(bound.grid)
        self._plans: dict = {}
        self._windows: dict = {}
        tensors = {p.name: bound.values[p.name] for p in bound.tensor_params()}
        # For each parameter, the written parameters (itself included) whose memory may be its memory.
        self._written_over = {
            name: {w for w in written_params(kernel) if w == name or _may_overlap(tensor, tensors[w])}
            for name, tensor in tensors.items()
        }
        self.set_chunk(0, bound.grid[0] if bound.grid else 1)

    def set_chunk(self, start, stop):
        self.chunk = (start, stop)
        self.local_grid = ((stop - start,) + tuple(self.grid[1:])) if self.g else ()
        self._windows = {}

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

    def offsets(self, name, index, dim):
        plan = self._plan(name, len(index))
        access = plan.access
        env = self._env(plan, index, torch_vars=True)
        if dim is None:
            value = sum(
                evaluate(e, env, TORCH_OPS) * self.bound.values[name].stride(d) for d, e in enumerate(access.source_index)
            )
        else:
            value = evaluate(access.source_index[dim % len(access.source_index)], env, TORCH_OPS)
        full = [*plan.tile_shape, *self.local_grid]
        value = torch.as_tensor(value).expand(full) if not isinstance(value, torch.Tensor) else value.expand(full)
        expr = access.source_index[dim % len(access.source_index)] if dim is not None else None
        keep = [d for d, var in enumerate(access.tile_vars) if expr is None or var in expr.leaves()]
        index_ = tuple(slice(None) if d in keep else 0 for d in range(len(plan.tile_shape))) + (Ellipsis,)
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
            env.update(plan.torch_vars(self.chunk))
        return env

    def load(self, name, index):
        plan = self._plan(name, len(index))
        source = self.bound.values[name]
        env = self._env(plan, index, plan.kind == "gather")
        if plan.kind == "gather":
            return plan.gather(source, env, self.chunk)
        if plan.kind == "view":
            tile = plan.view(source, env, self.chunk)
        else:
            key = (name, len(index))
            if key not in self._windows:
                self._windows[key] = plan.window(source, self.chunk)
            window, lo = self._windows[key]
            tile = plan.view(window, env, self.chunk, lo)
        # A view of memory the application also stores to (through this parameter or another one passed
        # the same or an overlapping tensor) would change under a value read before the store: loads are
        # values, as in Triton.
        return tile.clone() if self._written_over[name] else tile

    def store(self, name, index, value):
        plan = self._plan(name, len(index))
        target = self.bound.values[name]
        full = [*plan.tile_shape, *self.local_grid]
        mask = self.active() if _ACTIVE else None
        if mask is not None:  # inside a loop some programs have finished: they keep what is there
            value = torch.where(mask, value, self.load(name, index))
        value = torch.as_tensor(value, dtype=target.dtype) if not isinstance(value, torch.Tensor) else value.to(target.dtype)
        if value.ndim > len(full):
            raise ValueError(f"store to {name}: value has {value.ndim - self.g} tile dims, the tile {plan.tile_shape} has {len(plan.tile_shape)}")
        value = value.reshape((1,) * (len(full) - value.ndim) + tuple(value.shape)) if value.ndim < len(full) else value
        value = value.expand(full)
        self._windows = {key: w for key, w in self._windows.items() if name not in self._written_over[key[0]]}
        env = self._env(plan, index, plan.kind == "gather")
        if plan.kind == "view":
            plan.write_view(target, env, self.chunk, value)
        elif plan.kind == "padded":
            window, lo = plan.window(target, self.chunk, fill=not plan.covers(self.chunk))
            plan.write_view(window, env, self.chunk, value, lo)
            plan.write_back(target, window, lo)
        else:
            plan.scatter(target, env, self.chunk, value)


def _may_overlap(a, b) -> bool:
    """Whether the memory spans of tensors ``a`` and ``b`` intersect."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t):
        extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()

    (a_start, a_stop), (b_start, b_stop) = span(a), span(b)
    return a_start < b_stop and b_start < a_stop


def _unflip(offset, sizes, strides):
    """Positive strides for ``as_strided`` (an arrangement may walk a dimension backwards):
    the new offset and strides, and the dimensions to flip."""
    flipped = [d for d, st in enumerate(strides) if st < 0]
    if not flipped:
        return offset, strides, flipped
    strides = list(strides)
    for d in flipped:
        offset += strides[d] * (sizes[d] - 1)
        strides[d] = -strides[d]
    return offset, strides, flipped


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
        self.env = env
        self.other = access.top.source.other
        self.grid = program.grid
        self.g = program.g
        self.tile_shape = tuple(int(evaluate(s, env)) for s in access.tile_shape)
        self.middle_shape = tuple(int(evaluate(s, env)) for s in access.middle_level._shape) if access.middle_level is not None else ()
        self.variables = (*access.tile_vars, *access.grid_vars)
        self.first_grid = len(access.tile_vars)  # position of the chunked grid dimension
        sizes = (*self.tile_shape, *self.grid)
        self.sizes = sizes
        live = [c for c in access.conditions if interval(c, self.ranges((0, self.grid[0] if self.grid else 1))) != (1, 1)]
        self.mask = conjunction(live)
        tensor = bound.values[name]
        self.source_shape = tuple(tensor.shape)
        affines = [affine(e, set(self.variables) | set(access.middle_vars), env) for e in access.source_index]
        self.kind = "gather"
        if all(a is not None for a in affines) and not any(s == 0 for s in sizes):
            self.affines = affines
            bounds_only = set()
            for d, e in enumerate(access.source_index):
                bounds_only.add(binary(">=", e, 0))
                bounds_only.add(binary("<", e, access.top.source._shape[d]))
            if not live:
                self.kind = "view"
            elif all(c in bounds_only for c in live):
                self.kind = "padded"

    def ranges(self, chunk):
        """Interval of every variable for the programs of ``chunk``."""
        ranges = {leaf: (val, val) for leaf, val in self.env.items() if isinstance(val, int)}
        for d, (v, n) in enumerate(zip(self.variables, self.sizes)):
            ranges[v] = (chunk[0], chunk[1] - 1) if d == self.first_grid and self.g else (0, n - 1)
        ranges.update({v: (0, max(n - 1, 0)) for v, n in zip(self.access.middle_vars, self.middle_shape)})
        return ranges

    def local_sizes(self, chunk):
        if not self.g:
            return tuple(self.sizes)
        return self.tile_shape + (chunk[1] - chunk[0],) + tuple(self.grid[1:])

    def torch_vars(self, chunk):
        sizes = self.local_sizes(chunk)
        rank = len(sizes)
        out = {}
        for d, (v, n) in enumerate(zip(self.variables, sizes)):
            start = chunk[0] if d == self.first_grid and self.g else 0
            out[v] = torch.arange(start, start + n).reshape([n if i == d else 1 for i in range(rank)])
        return out

    # views -------------------------------------------------------------
    def _geometry(self, tensor, env, chunk, lo=None):
        if not hasattr(self, "_coefs"):
            self._consts = [const for const, _ in self.affines]
            self._coefs = [[coefs.get(v, 0) for _, coefs in self.affines] for v in self.variables]
            self._middle = [[coefs.get(m, 0) for _, coefs in self.affines] for m in self.access.middle_vars]
        strides = tensor.stride()
        offset = tensor.storage_offset()
        middle = [env[m] for m in self.access.middle_vars]
        for d, const in enumerate(self._consts):
            shift = const - (lo[d] if lo is not None else 0)
            if self.g:
                shift += self._coefs[self.first_grid][d] * chunk[0]
            for row, value in zip(self._middle, middle):
                shift += row[d] * value
            offset += shift * strides[d]
        var_strides = [sum(c * st for c, st in zip(row, strides)) for row in self._coefs]
        return offset, list(self.local_sizes(chunk)), var_strides

    def view(self, tensor, env, chunk, lo=None):
        # A dimension of stride 0 (an expanded input, an arrangement's expand) keeps its size: a
        # reduction over it must see every repeat.
        offset, sizes, strides = self._geometry(tensor, env, chunk, lo)
        offset, strides, flipped = _unflip(offset, sizes, strides)
        out = tensor.as_strided(sizes, strides, offset)
        return out.flip(flipped) if flipped else out

    def write_view(self, tensor, env, chunk, value, lo=None):
        offset, sizes, strides = self._geometry(tensor, env, chunk, lo)
        # Every element of a stride-0 dimension is one memory location: the last one written wins.
        sizes = [1 if st == 0 else n for n, st in zip(sizes, strides)]
        value = value[tuple(slice(-1, None) if st == 0 else slice(None) for st in strides)]
        offset, strides, flipped = _unflip(offset, sizes, strides)
        tensor.as_strided(sizes, strides, offset).copy_(value.flip(flipped) if flipped else value)

    def window(self, tensor, chunk, fill=True):
        """The box of ``tensor`` this chunk touches, padded with ``other``, and its first index."""
        ranges = self.ranges(chunk)
        spans = [interval(e, ranges) for e in self.access.source_index]
        lo = tuple(a for a, _ in spans)
        shape = [b - a + 1 for a, b in spans]
        out = torch.empty(shape, dtype=tensor.dtype)
        inside = [(max(a, 0), min(b, n - 1)) for (a, b), n in zip(spans, tensor.shape)]
        if fill:
            other = 0 if self.other is None else self.other
            if any(a > b for a, b in inside):
                out.fill_(other)
                return out, lo
            out[tuple(slice(a - low, b - low + 1) for (a, b), low in zip(inside, lo))] = tensor[tuple(slice(a, b + 1) for a, b in inside)]
            for d, ((a, b), low, n) in enumerate(zip(inside, lo, shape)):
                head = (slice(None),) * d
                if a - low:
                    out[head + (slice(0, a - low),)] = other
                if b - low + 1 < n:
                    out[head + (slice(b - low + 1, None),)] = other
        return out, lo

    def write_back(self, target, window, lo):
        inside = [(max(low, 0), min(low + w - 1, n - 1)) for low, w, n in zip(lo, window.shape, target.shape)]
        if any(a > b for a, b in inside):
            return
        target[tuple(slice(a, b + 1) for a, b in inside)] = window[tuple(slice(a - low, b - low + 1) for (a, b), low in zip(inside, lo))]

    def covers(self, chunk) -> bool:
        """Whether this chunk's tiles write every in-bounds element of their box (no initial copy needed)."""
        if self.access.middle_vars:
            return False
        sizes = self.local_sizes(chunk)
        used: set = set()
        for _, coefs in self.affines:
            terms = sorted((c, sizes[self.variables.index(v)]) for v, c in coefs.items() if c)
            if any(v in used for v in coefs if coefs[v]) or any(c < 0 for c, _ in terms):
                return False
            used |= {v for v in coefs if coefs[v]}
            span = 0
            for coef, n in terms:
                if coef > span + 1:
                    return False
                span += coef * (n - 1)
        return True

    # gathers -----------------------------------------------------------
    def _offsets(self, tensor, env):
        offsets = 0
        for d, e in enumerate(self.access.source_index):
            offsets = offsets + evaluate(e, env, TORCH_OPS) * tensor.stride(d)
        mask = evaluate(self.mask, env, TORCH_OPS)
        offsets = torch.as_tensor(offsets, dtype=torch.int64)
        return offsets, mask

    def gather(self, tensor, env, chunk):
        # A tile dimension that neither the offsets nor the mask read (an arrangement's expand) broadcasts
        # in them: the tile still has its full size there, as a reduction over it must see every repeat.
        sizes = self.local_sizes(chunk)
        offsets, mask = self._offsets(tensor, env)
        flat = _flat(tensor)
        other = 0 if self.other is None else self.other
        if flat.numel() == 0:  # an empty source: every element is masked
            return torch.full(sizes, other, dtype=tensor.dtype)
        if isinstance(mask, torch.Tensor):
            safe = torch.where(mask, offsets, 0)
            values = flat[safe]
            return torch.where(mask, values, torch.tensor(other, dtype=values.dtype)).expand(sizes)
        if not mask:
            return torch.full(sizes, other, dtype=tensor.dtype)
        return flat[offsets].expand(sizes)

    def scatter(self, tensor, env, chunk, value):
        full = self.local_sizes(chunk)
        offsets, mask = self._offsets(tensor, env)
        offsets = offsets.expand(full)
        flat = _flat(tensor)
        if isinstance(mask, torch.Tensor):
            mask = mask.expand(full)
            flat[offsets[mask]] = value[mask]
        elif mask:
            flat[offsets.reshape(-1)] = value.reshape(-1)


def _flat(tensor):
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if n > 0)
    if tensor.numel() == 0:
        span = 0
    return tensor.as_strided((span,), (1,), tensor.storage_offset())
