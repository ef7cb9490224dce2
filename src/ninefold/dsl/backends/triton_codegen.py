"""Generate Triton source from a kernel: the application's tree, lowered, printed once.

Each program decomposes ``tl.program_id(0)`` into the indices of the outermost level. A read of
a parameter becomes ``tl.load(ptr + offsets, mask=..., other=...)`` with the offsets and the mask
printed from the arrangement's index expressions; the tile's dimensions are ``tl.arange`` vectors
(padded to a power of two, which adds a mask term). Mask terms that the call's sizes prove always
true are left out, so the source depends on a *specialization* (which terms are live); it is
generated once per specialization and cached.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import math
import types
from dataclasses import dataclass, field

from ninefold.dsl import language
from ninefold.dsl.compiler.access import Middle, analyze
from ninefold.dsl.compiler.frontend import NF, is_language_module, is_nf_call, names_in
from ninefold.dsl.expr import (
    BinOp,
    Const,
    Expr,
    Index,
    SizeOf,
    StrideOf,
    binary,
    binop_ast,
    const_value,
    evaluate,
    interval,
    substitute,
)
from ninefold.dsl.symbol import Symbol

TL = "tl"
# Functions Triton lacks (or has only in libdevice, which its interpreter cannot run): emitted
# into the generated module when used.
PYTHON_INT = """
def python_int(value):
    data = getattr(getattr(value, "handle", None), "data", value)
    return int(data.reshape(-1)[0]) if hasattr(data, "reshape") else int(data)
"""
MATH_HELPERS = {
    "tanh": """
@triton.jit
def tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1
""",
    "pow": """
@triton.jit
def pow(x, y):
    magnitude = tl.exp2(y * tl.log2(tl.abs(x)))
    integral = y == tl.floor(y)
    odd = integral & (y - 2 * tl.floor(y / 2) == 1)
    signed = tl.where(x < 0, tl.where(integral, tl.where(odd, -magnitude, magnitude), float("nan")), magnitude)
    return tl.where(y == 0, 1.0, signed)
""",
}
DTYPE_NAMES = set(language.DTYPES)


@dataclass
class Generated:
    """Generated Triton module text and how to call its kernel."""

    source: str
    function_name: str
    arguments: list  # (name, kind, payload, constexpr)
    key: str = ""
    padded: list = field(default_factory=list)


def _next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def accesses(kernel):
    """Every (parameter, number of indices) the application touches, in order."""
    out = []
    for node in ast.walk(kernel.app.tree):
        if is_nf_call(node) and node.func.attr in ("load", "store", "offsets"):
            key = (node.args[0].value, len(node.args[1].elts))
            if key not in out:
                out.append(key)
    return out


BIG = 1 << 62


def specialize(kernel, env) -> tuple:
    """Which mask terms are live for the sizes in ``env``.

    Without sizes (``env`` None) only the terms that hold for all non-negative sizes are dropped.
    """
    live = []
    for name, n in accesses(kernel):
        access = analyze(kernel.param(name).arranged, n, name)
        if env is None:
            terms = _mask_terms(access)
            ranges = {leaf: (0, BIG) for t in terms for leaf in t.leaves()}
            live.append(tuple(interval(t, ranges) != (1, 1) for t in terms))
            continue
        ranges = {leaf: (v, v) for leaf, v in env.items() if isinstance(v, int)}
        for v in access.grid_vars:
            ranges[v] = (0, int(evaluate(v.level._shape[v.dim], env)) - 1)
        if access.middle_level is not None:
            for m, size in zip(access.middle_vars, access.middle_level._shape):
                ranges[m] = (0, max(int(evaluate(size, env)) - 1, 0))
        for v in access.tile_vars:
            size = int(evaluate(v.level._shape[v.dim], env))
            ranges[v] = (0, _next_power_of_two(size) - 1)
        terms = _mask_terms(access)
        live.append(tuple(interval(t, ranges) != (1, 1) for t in terms))
    return tuple(live)


def _mask_terms(access):
    padded = tuple(binary("<", v, v.level._shape[v.dim]) for v in access.tile_vars if not _is_power_of_two(v.level._shape[v.dim]))
    return padded + tuple(c for c in access.conditions if not _unpadded_bound(c))


def _unpadded_bound(condition) -> bool:
    """``i < n`` for an index whose extent is ``n`` and is not padded: always true."""
    if not (isinstance(condition, BinOp) and condition.op == "<" and isinstance(condition.a, Index)):
        return False
    extent = condition.a.level._shape[condition.a.dim]
    return condition.b == extent and _is_power_of_two(extent)


def _is_power_of_two(size) -> bool:
    c = const_value(size)
    if c is not None:
        return c >= 1 and _next_power_of_two(int(c)) == c
    return isinstance(size, Symbol) and size.meta and size.power_of_two


class _Namer:
    """Names of leaves in the generated code; records which ones are used."""

    def __init__(self, kernel, taken=()):
        self.kernel = kernel
        self.used: dict = {}
        self.padded: dict = {}
        self.hoisted: dict = {}  # size-only expression -> (name, its AST)
        self.taken = set(taken)

    def leaf(self, leaf) -> str:
        name = self.kernel.leaf_name(leaf)
        self.used[name] = leaf
        return name

    def expr(self, expr, leaf_fn=None) -> ast.expr:
        """Print ``expr``; sizable subexpressions of sizes and symbols only become named values."""
        leaf_fn = leaf_fn or (lambda leaf: _name(self.leaf(leaf)))
        if isinstance(expr, BinOp):
            name = self.hoist(expr)
            if name is not None:
                return _name(name)
            return binop_ast(expr.op, self.expr(expr.a, leaf_fn), self.expr(expr.b, leaf_fn))
        return as_expr_ast(expr, leaf_fn)

    def hoist(self, expr):
        if expr in self.hoisted:
            return self.hoisted[expr][0]
        leaves = expr.leaves()
        if any(isinstance(leaf, (Index, Middle)) for leaf in leaves) or _operators(expr) < 2:
            return None
        value = as_expr_ast(expr, lambda leaf: _name(self.leaf(leaf)))
        n = len(self.hoisted)
        while f"extent_{n}" in self.taken:
            n += 1
        self.taken.add(f"extent_{n}")
        self.hoisted[expr] = (f"extent_{n}", value)
        return f"extent_{n}"


    def padded_size(self, size: Expr) -> ast.expr:
        """A power-of-two constexpr at least ``size`` (named when it needs computing at launch)."""
        c = const_value(size)
        if c is not None:
            return ast.Constant(_next_power_of_two(int(c)))
        if isinstance(size, Symbol) and size.meta and size.power_of_two:
            return ast.Name(self.leaf(size), ast.Load())
        if size not in self.padded:
            self.padded[size] = f"BLOCK_P2_{len(self.padded)}"
        return ast.Name(self.padded[size], ast.Load())


def _operators(expr) -> int:
    return 1 + _operators(expr.a) + _operators(expr.b) if isinstance(expr, BinOp) else 0


def _name(id_):
    return ast.Name(id_, ast.Load())


def _attr(value, *attrs):
    node = value if isinstance(value, ast.AST) else _name(value)
    for a in attrs:
        node = ast.Attribute(node, a, ast.Load())
    return node


def _call(func, *args, **kwargs):
    func = _name(func) if isinstance(func, str) else func
    return ast.Call(func, list(args), [ast.keyword(k, v) for k, v in kwargs.items()])


def _broadcast(node, dim, rank):
    if rank <= 1:
        return node
    index = [ast.Constant(None)] * rank
    index[dim] = ast.Slice()
    return ast.Subscript(node, ast.Tuple(index, ast.Load()), ast.Load())


class _Lowering(ast.NodeTransformer):
    """Replace ``_nf`` calls and language references by Triton code."""

    def __init__(self, kernel, spec, namer, tree=None, namespace=None, helpers=None, interpret=False, tma=False,
                 collapse=None, hoist=False, ws=False):
        self.interpret = interpret
        self.tma = tma
        self.hoist = hoist
        self.ws = ws  # the dot loop becomes tl.range(..., warp_specialize=True); descriptors made in the kernel
        self.collapse = dict(collapse or ())  # parameter name -> leading dims its strides let be read as one
        self.descriptors: dict = {}  # parameter name -> (collapsed dims r, box: tile size Expr or None per dim >= r)
        self.kernel = kernel
        self.spec = spec
        self.namer = namer
        self.order = accesses(kernel)
        self.math_helpers: set = set()
        self.padded_shapes = False  # inside the shape argument of nl.zeros / nl.full
        self.namespace = kernel.app.namespace if namespace is None else namespace
        tree = kernel.app.tree if tree is None else tree
        self.helpers = {} if helpers is None else helpers  # name -> Python function called by the code
        self.locals = {a.arg for a in tree.args.args}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.locals.add(node.id)

    # ----------------------------------------------------------------- expressions of accesses
    def render(self, expr, access, index_nodes, flat_tile=False):
        expr = substitute(expr, {v: 0 for v in access.grid_vars if const_value(v.level._shape[v.dim]) == 1})
        keep = None
        if flat_tile:
            keep = [v for v in access.tile_vars if v in expr.leaves()]
        rank = len(access.tile_vars) if keep is None or len(keep) != 1 else 1

        def leaf(node):
            if isinstance(node, Index):
                if node in access.grid_vars:
                    return _name(f"program_{node.dim}")
                arange = _call(_attr(TL, "arange"), ast.Constant(0), self.namer.padded_size(node.level._shape[node.dim]))
                return arange if rank == 1 and keep else _broadcast(arange, node.dim, rank)
            if isinstance(node, Middle):
                return copy.deepcopy(index_nodes[node.position])
            return _name(self.namer.leaf(node))

        return self.namer.expr(expr, leaf)

    def pointer_and_mask(self, name, index_nodes):
        n = len(index_nodes)
        access = analyze(self.kernel.param(name).arranged, n, name)
        offsets = Const(0)
        for d, e in enumerate(access.source_index):
            offsets = offsets + e * StrideOf(access.top.source, d)
        pointer = ast.BinOp(_name(f"{name}_ptr"), ast.Add(), self.render(offsets, access, index_nodes))
        terms = _mask_terms(access)
        live = self.spec[self.order.index((name, n))]
        kept = [t for t, keep in zip(terms, live) if keep]
        mask, seen, scalars = None, set(), []
        tile_vars = set(access.tile_vars)
        for t in kept:
            node = self.render(t, access, index_nodes)
            if ast.dump(node) in seen:
                continue
            seen.add(ast.dump(node))
            if self.interpret and tile_vars and not (t.leaves() & tile_vars):
                scalars.append(node)  # a condition on the program and middle indices alone
                continue
            mask = node if mask is None else ast.BinOp(mask, ast.BitAnd(), node)
        for node in scalars:
            if mask is None:  # no block term at all: the scalar conditions combine as usual
                mask = functools.reduce(lambda a, b: ast.BinOp(a, ast.BitAnd(), b), scalars)
                break
            # Triton's interpreter (3.9) rejects `scalar condition & block` as a mask: select instead
            mask = _call(_attr(TL, "where"), node, mask, ast.Constant(False))
        self._pointer_leaves = set(offsets.leaves())
        self._last_leaves = self._pointer_leaves.union(*(t.leaves() for t in kept))
        return pointer, mask, access

    def _full_tile(self, loaded, access, leaves):
        """``loaded`` (or a store's pointers) broadcast to the whole tile where some tile dimension reads no
        index (an expanded, stride-0 dimension): the pointer expression alone would give that dimension
        size 1, or be a scalar where it reads no tile index at all."""
        missing = [v for v in access.tile_vars if v not in leaves and const_value(v.level._shape[v.dim]) != 1]
        if not missing and (not access.tile_vars or any(v in leaves for v in access.tile_vars)):
            return loaded
        sizes = [self.namer.padded_size(v.level._shape[v.dim]) for v in access.tile_vars]
        return _call(_attr(TL, "broadcast_to"), loaded, ast.Tuple(sizes, ast.Load()))

    def descriptor_load(self, name, index_nodes):
        """``{name}_desc.load([...])`` reshaped to the tile, where the tile is a box of the source
        (each tile dimension walks one source dimension, in order, with unit steps) read with zero
        fill outside it; None where the access is not such a box (it stays a pointer load).

        In the ``"rows"`` mode the source dimensions up to the first one the tile walks (``r``)
        are read as one, through a descriptor of the ``[size_0 * ... * size_r, size_r+1, ...]``
        view, when the call's strides allow that view (``collapse[name] >= r``) and no tile can
        overhang dimensions ``0..r`` (their mask terms are dead for the call's sizes): the box is
        then the tile itself, with no reshape. Live conditions on the program and middle indices
        (a tile wholly outside the source) move the box past the view's last row, so it reads zeros.
        """
        access = analyze(self.kernel.param(name).arranged, len(index_nodes), name)
        if access.top.source.other not in (None, 0) or not access.tile_vars:
            return None
        mapping = _box_mapping(access)
        if mapping is None:
            return None
        starts = [substitute(e, {t: 0 for t in access.tile_vars}) for e in access.source_index]
        block = [access.tile_level._shape[mapping.index(d)] if d in mapping else None for d in range(len(starts))]
        rows, guard = self._collapse(name, access, mapping, index_nodes)
        if self.descriptors.setdefault(name, (rows, tuple(block[rows:]))) != (rows, tuple(block[rows:])):
            return None  # a second access of another shape: one descriptor per parameter
        if rows:
            source = access.top.source
            row = starts[0]
            for d in range(1, rows + 1):
                row = row * SizeOf(source, d) + starts[d]
            offsets = [self.render(row, access, index_nodes)]
            if guard is not None:
                total = Const(1)
                for d in range(rows + 1):
                    total = total * SizeOf(source, d)
                offsets[0] = _call(_attr(TL, "where"), guard, offsets[0], self.render(total, access, index_nodes))
            offsets += [self.render(e, access, index_nodes) for e in starts[rows + 1 :]]
        else:
            offsets = [self.render(e, access, index_nodes) for e in starts]
        loaded = _call(_attr(f"{name}_desc", "load"), ast.List(offsets, ast.Load()))
        shape = ast.Tuple([self.namer.padded_size(s) for s in access.tile_level._shape], ast.Load())
        if rows and len(access.tile_vars) == len(starts) - rows:
            return loaded  # the box is the tile
        return _call(_attr(TL, "reshape"), loaded, shape)

    def _collapse(self, name, access, mapping, index_nodes):
        """``(r, guard)`` for the ``"rows"`` mode (see ``descriptor_load``), ``(0, None)`` otherwise."""
        if self.tma != "rows" or not mapping or mapping[0] == 0:
            return 0, None
        rows = mapping[0]
        if self.collapse.get(name, 0) < rows:
            return 0, None
        terms = _mask_terms(access)
        live = self.spec[self.order.index((name, len(index_nodes)))]
        tile_dims = {t: mapping[i] for i, t in enumerate(access.tile_vars)}
        guard, seen = None, set()
        for term, keep in zip(terms, live):
            if not keep:
                continue
            dims = {tile_dims[leaf] for leaf in term.leaves() if leaf in tile_dims}
            if any(d <= rows for d in dims):
                return 0, None  # a tile may overhang a collapsed dimension: it would read the next rows
            if dims:
                continue  # past the rows: the descriptor's zero fill stands for it
            node = self.render(term, access, index_nodes)
            if ast.dump(node) not in seen:
                seen.add(ast.dump(node))
                guard = node if guard is None else ast.BinOp(guard, ast.BitAnd(), node)
        return rows, guard

    def visit_For(self, node):
        self.generic_visit(node)
        if self.hoist:
            node.body = _hoist_descriptor_loads(node.body)
        call = node.iter
        if self.interpret and isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "range":
            # Triton 3.6's interpreter hands scalars over as 1-element arrays, which range() rejects
            call.args = [_call("python_int", a) for a in call.args]
        if self.ws and _calls_dot(node) and isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "range":
            node.iter = _call(_attr(TL, "range"), *call.args, warp_specialize=ast.Constant(True))
        return node

    def _is_language_function(self, func, name) -> bool:
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id not in self.locals:
            return self.namespace.get(func.value.id) is language and func.attr == name
        if isinstance(func, ast.Name) and func.id not in self.locals:
            return self.namespace.get(func.id) is getattr(language, name)
        return False

    def _is_shape_function(self, func) -> bool:
        """``nl.zeros``/``nl.full``: their shape argument needs the padded (power-of-two) tile sizes."""
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id not in self.locals:
            return self.namespace.get(func.value.id) is language and func.attr in ("zeros", "full")
        if isinstance(func, ast.Name) and func.id not in self.locals:
            return self.namespace.get(func.id) in (language.zeros, language.full)
        return False

    def visit_Call(self, node):
        if not is_nf_call(node):
            if self._is_language_function(node.func, "dot") and not any(k.arg == "input_precision" for k in node.keywords):
                # torch multiplies float32 in IEEE precision by default; Triton would use TF32
                node.keywords.append(ast.keyword("input_precision", ast.Constant("ieee")))
            if self._is_shape_function(node.func) and node.args:
                outer, self.padded_shapes = self.padded_shapes, True
                node.args[0] = self.visit(node.args[0])
                self.padded_shapes = outer
                node.func = self.visit(node.func)
                node.args[1:] = [self.visit(a) for a in node.args[1:]]
                node.keywords = [self.visit(k) for k in node.keywords]
                return node
            self.generic_visit(node)
            return node
        method, name = node.func.attr, node.args[0].value
        index_nodes = [self.visit(e) for e in node.args[1].elts] if len(node.args) > 1 else []
        if method == "load" and self.tma:
            loaded = self.descriptor_load(name, index_nodes)
            if loaded is not None:
                return loaded
        if method == "load":
            pointer, mask, access = self.pointer_and_mask(name, index_nodes)
            offsets_and_mask = self._last_leaves
            tile_vars = set(access.tile_vars)
            if tile_vars & offsets_and_mask and not tile_vars & self._pointer_leaves:
                # the mask reads tile indices but the offsets none: Triton takes no block mask for a scalar pointer
                pointer = self._full_tile(pointer, access, self._pointer_leaves)
                offsets_and_mask = tile_vars
            kwargs = {}
            if mask is not None:
                kwargs["mask"] = mask
                other = access.top.source.other
                kwargs["other"] = ast.Constant(0 if other is None else other)
            hints = getattr(self.kernel, "cache_hints", None) or {}
            if hints.get("load"):
                kwargs["eviction_policy"] = ast.Constant(hints["load"])
            return self._full_tile(_call(_attr(TL, "load"), pointer, **kwargs), access, offsets_and_mask)
        if method == "store":
            pointer, mask, access = self.pointer_and_mask(name, index_nodes)
            # Triton broadcasts the value and the mask to the pointers' shape, never the pointers: a tile
            # dimension the offsets do not read needs them at its full size (its copies share an address).
            pointer = self._full_tile(pointer, access, self._pointer_leaves)
            value = self.visit(node.args[2])
            kwargs = {"mask": mask} if mask is not None else {}
            hints = getattr(self.kernel, "cache_hints", None) or {}
            if hints.get("store"):
                kwargs["cache_modifier"] = ast.Constant(hints["store"])
            return _call(_attr(TL, "store"), pointer, value, **kwargs)
        if method == "shape":
            levels = self.kernel.param(name).arranged.levels()
            depth = 2 if index_nodes else 1
            if depth >= len(levels):
                return ast.Tuple([], ast.Load())
            level = levels[depth]
            padded = self.padded_shapes and depth == len(levels) - 1
            sizes = [self.namer.padded_size(s) if padded else self.namer.expr(s) for s in level._shape]
            return ast.Tuple(sizes, ast.Load())
        if method == "source_shape":
            source = self.kernel.param(name).source
            return ast.Tuple([self.namer.expr(s) for s in source._shape], ast.Load())
        if method == "dtype":
            return _attr(f"{name}_ptr", "dtype", "element_ty")
        if method == "offsets":
            access = analyze(self.kernel.param(name).arranged, len(index_nodes), name)
            try:
                dim = ast.literal_eval(node.args[2])
            except ValueError:
                raise SyntaxError(f"{name}.offsets(dim): dim must be a constant int") from None
            if dim is None:
                total = Const(0)
                for d, e in enumerate(access.source_index):
                    total = total + e * StrideOf(access.top.source, d)
                return self._full_tile(self.render(total, access, index_nodes), access, total.leaves())
            return self.render(access.source_index[dim % len(access.source_index)], access, index_nodes, flat_tile=True)
        raise AssertionError(method)

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if isinstance(node.value, ast.Tuple):
            try:
                index = ast.literal_eval(node.slice)
            except ValueError:
                return node
            if isinstance(index, int) and -len(node.value.elts) <= index < len(node.value.elts):
                return node.value.elts[index]
        return node

    # ----------------------------------------------------------------- language and globals
    def visit_Attribute(self, node):
        base = node.value
        if isinstance(base, ast.Name) and base.id not in self.locals and base.id in self.namespace:
            if is_language_module(self.namespace[base.id]):
                return self.language_name(node.attr)
        self.generic_visit(node)
        return node

    def language_name(self, attr):
        if attr in MATH_HELPERS:
            self.math_helpers.add(attr)
            return _name(attr)
        if attr not in language.FUNCTIONS and attr not in DTYPE_NAMES:
            raise NotImplementedError(f"language.{attr} is not available in the triton backend")
        return _attr(TL, attr)

    def visit_Name(self, node):
        if not isinstance(node.ctx, ast.Load) or node.id in self.locals or node.id == NF:
            return node
        value = self.namespace.get(node.id)
        if value is None:
            return node
        if getattr(value, "__module__", None) == language.__name__ and callable(value):
            return self.language_name(node.id)
        if isinstance(value, (bool, int, float)):
            return ast.Constant(value)
        if isinstance(value, Symbol):
            return _name(self.namer.leaf(value))
        if isinstance(value, types.FunctionType):
            known = self.helpers.get(node.id)
            if known is not None and known is not value:
                raise NotImplementedError(f"two different helper functions are both called {node.id!r}")
            self.helpers[node.id] = value
        return node


def _calls_dot(node) -> bool:
    """Whether lowered code under ``node`` calls ``tl.dot``."""
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "dot"
        and isinstance(n.func.value, ast.Name) and n.func.value.id == TL
        for n in ast.walk(node)
    )


def dot_loops(kernel) -> int:
    """How many loops of the application (outermost ones, helpers not followed) contain a ``dot``."""
    count = 0

    def visit(node):
        nonlocal count
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.For, ast.While)):
                if any(isinstance(n, ast.Attribute) and n.attr == "dot" for n in ast.walk(child)):
                    count += 1
                continue
            visit(child)

    visit(kernel.app.tree)
    return count


def _device_descriptor(lowering, name, rows, block) -> ast.stmt:
    """``{name}_desc = tl.make_tensor_descriptor(...)``: the descriptor that ``descriptor`` would build
    on the host (the ``[size_0 * ... * size_rows, ...]`` view when ``rows``), made by the kernel."""
    source = lowering.kernel.param(name).source
    ndim = len(source._shape)
    shape = [SizeOf(source, d) for d in range(ndim)]
    if rows:
        total = shape[0]
        for d in range(1, rows + 1):
            total = total * shape[d]
        shape = [total] + shape[rows + 1 :]
    strides = [StrideOf(source, d) for d in range(rows, ndim - 1)]
    namer = lowering.namer
    return _assign(
        f"{name}_desc",
        _call(
            _attr(TL, "make_tensor_descriptor"), _name(f"{name}_ptr"),
            ast.List([namer.expr(e) for e in shape], ast.Load()),
            ast.List([namer.expr(e) for e in strides] + [ast.Constant(1)], ast.Load()),
            ast.List([ast.Constant(1) if b is None else namer.padded_size(b) for b in block], ast.Load()),
        ),
    )


def _is_descriptor_load(value) -> bool:
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "reshape" and value.args:
        value = value.args[0]  # tl.reshape(x_desc.load([...]), shape)
    return (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "load"
        and isinstance(value.func.value, ast.Name) and value.func.value.id.endswith("_desc")
    )


def _hoist_descriptor_loads(body: list) -> list:
    """Move ``t = x_desc.load([...])`` statements of a loop body to its top, where nothing before
    them in the body assigns a name their offsets read, nor reads or assigns ``t``: every tile of an
    iteration is then requested at once (one barrier for all of them, as hand-written TMA kernels
    do). Loads have no side effects, so the order of the reads does not matter otherwise."""
    hoisted, rest = [], []
    for stmt in body:
        if (
            isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and _is_descriptor_load(stmt.value)
        ):
            target = stmt.targets[0].id
            assigned, read = names_in(rest, ast.Store), names_in(rest, ast.Load)
            if not (names_in([stmt.value], ast.Load) & assigned) and target not in assigned | read:
                hoisted.append(stmt)
                continue
        rest.append(stmt)
    return hoisted + rest


def _helper_functions(kernel, spec, namer, lowering) -> list:
    """``@triton.jit`` versions of the plain Python functions the application calls (transitively)."""
    from ninefold.dsl.compiler.frontend import parse

    done, out = set(), []
    while set(lowering.helpers) - done:
        name = sorted(set(lowering.helpers) - done)[0]
        done.add(name)
        tree, namespace, _ = parse(lowering.helpers[name])
        sub = _Lowering(kernel, spec, namer, tree, namespace, lowering.helpers, interpret=lowering.interpret)
        tree = sub.visit(tree)
        lowering.math_helpers |= sub.math_helpers
        tree.name = name
        tree.decorator_list = [_attr("triton", "jit")]
        out.append(tree)
    return out


def as_expr_ast(expr, leaf_fn) -> ast.expr:
    return expr.to_ast(leaf_fn) if isinstance(expr, Expr) else ast.Constant(expr)


CACHE_HINTS = {"load": ("evict_first", "evict_last", "evict_normal"), "store": (".wb", ".cg", ".cs", ".wt")}


def _check_hints(kernel):
    for key, value in (getattr(kernel, "cache_hints", None) or {}).items():
        if key not in CACHE_HINTS or (value and value not in CACHE_HINTS[key]):
            raise ValueError(f"kernel {kernel.name}: cache_hints {key!r}={value!r}; accepted: {CACHE_HINTS}")


def generate(
    kernel, spec, wide=False, interpret=False, persistent=False, tma=False, collapse=(), grouped=True, hoist=False,
    ws=False,
) -> Generated:
    """Triton module source for ``kernel`` under ``spec`` (see :func:`specialize`).

    ``wide`` computes offsets in 64 bits (tensors spanning 2**31 elements or more).
    ``persistent`` makes each launched program loop over the programs ``program_id(0)``,
    ``+ num_programs(0)``, ... (a nest Triton flattens and pipelines across output tiles); the
    launch then starts at most one program per SM. ``tma`` reads the tiles that are boxes of their
    source through TMA descriptors built at launch (see ``_Lowering.descriptor_load``); ``"rows"``
    also reads leading dimensions as one where ``collapse`` (``(name, dims)`` pairs from
    :func:`collapsible`) and the mask specialization allow it. ``grouped`` False drops the grouped
    launch order of dot-in-loop kernels (see ``_program_indices``) for the row-major one; ``hoist``
    moves each loop iteration's descriptor loads to the top of its body (``_hoist_descriptor_loads``).
    ``ws`` (with ``tma``) marks the application's one loop with a ``dot`` ``tl.range(...,
    warp_specialize=True)`` and makes the descriptors in the kernel (``tl.make_tensor_descriptor``)
    instead of taking them as arguments: on sm_90 Triton's warp-specialization pass then gives the
    loop's loads to a producer warpgroup and splits the tiles' rows over two consumer warpgroups (it
    splits device-made descriptors only, and fails on a second loop with a ``dot``; see
    ``docs/perf/dsl.md``).
    """
    _check_hints(kernel)
    if ws and (not tma or persistent):
        raise ValueError(f"kernel {kernel.name}: warp_specialize needs TMA loads (tma) and no persistent launch")
    if ws and dot_loops(kernel) != 1:
        raise ValueError(
            f"kernel {kernel.name}: warp_specialize needs exactly one loop with a dot in the application, "
            f"it has {dot_loops(kernel)} (Triton's sm_90 pass takes one such loop per kernel)"
        )
    namer = _Namer(kernel)
    lowering = _Lowering(kernel, spec, namer, interpret=interpret, tma=tma, collapse=collapse, hoist=hoist, ws=ws)
    namer.taken |= lowering.locals
    tree = lowering.visit(copy.deepcopy(kernel.app.tree))
    made = [_device_descriptor(lowering, name, *lowering.descriptors[name]) for name in sorted(lowering.descriptors)] if ws else []
    body = []
    first = next((p for p in kernel.params if not p.is_scalar), None)
    grid_shape = first.arranged._shape if first is not None else ()
    if grid_shape:
        body += _program_indices(kernel, grid_shape, namer, wide, grouped)
    if persistent and grid_shape:
        total = None
        for size in grid_shape:
            term = namer.expr(size)
            total = term if total is None else ast.BinOp(total, ast.Mult(), term)
        start = body[0].value  # program = tl.program_id(0) (maybe widened)
        body[0] = _assign("program", _name("program_linear"))
        step = _call(_attr(TL, "num_programs"), ast.Constant(0))
        loop_range = _call(_attr(TL, "range"), start, total, step, flatten=ast.Constant(True))
        loop = ast.For(ast.Name("program_linear", ast.Store()), loop_range, body + tree.body, [], lineno=0)
        body = [_assign(name, value) for name, value in namer.hoisted.values()] + [loop]
    else:
        body = [_assign(name, value) for name, value in namer.hoisted.values()] + body + made + tree.body
    arguments = []
    for p in kernel.params:
        if p.is_scalar:
            if p.passed:
                arguments.append((p.name, "scalar", p.name, p.source.constexpr))
            else:
                body.insert(0, ast.Assign([ast.Name(p.name, ast.Store())], ast.Constant(p.source.value), lineno=0))
        else:
            arguments.append((f"{p.name}_ptr", "pointer", p.name, False))
            if p.name in lowering.descriptors and not ws:
                rows, block = lowering.descriptors[p.name]
                arguments.append((f"{p.name}_desc", "descriptor", (p.name, block, rows), False))
    leaves = dict(namer.used)
    for name in sorted(leaves, key=_leaf_order(kernel)):
        leaf = leaves[name]
        constexpr = isinstance(leaf, Symbol) and leaf.constexpr
        if type(leaf) is SizeOf:
            constexpr = bool(leaf.options.get("constexpr"))
        constexpr = constexpr or interpret
        arguments.append((name, "leaf", leaf, constexpr))
    for size, name in namer.padded.items():
        arguments.append((name, "padded", size, True))
    args = [
        ast.arg(name, ast.Attribute(_name(TL), "constexpr", ast.Load()) if constexpr else None)
        for name, _, _, constexpr in arguments
    ]
    function_name = f"{kernel.name}_kernel"
    func = ast.FunctionDef(
        name=function_name,
        args=ast.arguments(posonlyargs=[], args=args, kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=body or [ast.Pass()],
        decorator_list=[_attr("triton", "jit")],
        returns=None,
    )
    func.type_params = []
    imports = [ast.Import([ast.alias("triton")]), ast.Import([ast.alias("triton.language", TL)])]
    helpers = _helper_functions(kernel, spec, namer, lowering)
    helpers = [ast.parse(MATH_HELPERS[n]).body[0] for n in sorted(lowering.math_helpers)] + helpers
    if interpret:
        helpers = [ast.parse(PYTHON_INT).body[0]] + helpers
    module = ast.Module(imports + helpers + [func], type_ignores=[])
    ast.fix_missing_locations(module)
    header = f'"""Generated by ninefold.dsl from {kernel.name}; do not edit."""\n\n'
    source = header + ast.unparse(module) + "\n"
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    return Generated(source, function_name, arguments, key, list(namer.padded))


GROUP = 8


def _assign(name, value):
    return ast.Assign([ast.Name(name, ast.Store())], value, lineno=0)


def _binop(a, op, b):
    a = _name(a) if isinstance(a, str) else a
    b = ast.Constant(b) if isinstance(b, int) else (_name(b) if isinstance(b, str) else b)
    return ast.BinOp(a, op, b)


def _dot_in_loop(kernel) -> bool:
    for loop in ast.walk(kernel.app.tree):
        if isinstance(loop, (ast.For, ast.While)):
            for node in ast.walk(loop):
                if isinstance(node, ast.Attribute) and node.attr == "dot":
                    return True
    return False


def _program_indices(kernel, grid_shape, namer, wide, grouped=True, group=GROUP):
    """Statements that split ``tl.program_id(0)`` into ``program_<d>`` (row-major, or grouped).

    Kernels that accumulate dots in a loop visit the last two grid dimensions in groups of
    ``group`` rows, so that consecutive programs share tiles in L2.
    """
    program = _call(_attr(TL, "program_id"), ast.Constant(0))
    if wide:
        program = _call(ast.Attribute(program, "to", ast.Load()), _attr(TL, "int64"))
    out = [_assign("program", program)]

    def size(d):
        return namer.expr(grid_shape[d])

    dims = [d for d in range(len(grid_shape)) if const_value(grid_shape[d]) != 1]
    # another parameter's grid size there may not be a constant 1: its index is still 0
    out += [_assign(f"program_{d}", ast.Constant(0)) for d in range(len(grid_shape)) if d not in dims]
    if len(dims) >= 2 and grouped and _dot_in_loop(kernel):
        m, n = dims[-2], dims[-1]
        tiles = ast.BinOp(size(m), ast.Mult(), size(n))
        out += [
            _assign("tile", _binop("program", ast.Mod(), tiles)),
            _assign("program", _binop("program", ast.FloorDiv(), copy.deepcopy(tiles))),
            _assign("group_width", _binop(ast.Constant(group), ast.Mult(), size(n))),
            _assign("first_m", _binop(_binop("tile", ast.FloorDiv(), "group_width"), ast.Mult(), group)),
            _assign("group_m", _call(_attr(TL, "minimum"), _binop(size(m), ast.Sub(), "first_m"), ast.Constant(group))),
            _assign(f"program_{m}", _binop("first_m", ast.Add(), _binop(_binop("tile", ast.Mod(), "group_width"), ast.Mod(), "group_m"))),
            _assign(f"program_{n}", _binop(_binop("tile", ast.Mod(), "group_width"), ast.FloorDiv(), "group_m")),
        ]
        dims = dims[:-2]
    for i, d in enumerate(reversed(dims)):
        last = i == len(dims) - 1
        out.append(_assign(f"program_{d}", _name("program") if last else _binop("program", ast.Mod(), size(d))))
        if not last:
            out.append(_assign("program", _binop("program", ast.FloorDiv(), size(d))))
    return out


def _leaf_order(kernel):
    params = [p.name for p in kernel.params]

    def order(name):
        for i, p in enumerate(params):
            if name.startswith(p + "_size_") or name.startswith(p + "_stride_"):
                kind = 0 if "_size_" in name[len(p) :] else 1
                return (0, i, kind, int(name.rsplit("_", 1)[1]))
        return (1, 0, 0, name)

    return order


def argument_values(generated: Generated, bound) -> list:
    """Launch arguments in signature order for a bound call."""
    values = []
    for _, kind, payload, _ in generated.arguments:
        if kind == "pointer":
            values.append(bound.values[payload])
        elif kind == "scalar":
            values.append(bound.values[payload])
        elif kind == "leaf":
            values.append(bound.env[payload])
        elif kind == "descriptor":
            name, block, rows = payload
            values.append(descriptor(bound.values[name], descriptor_block(block, bound.env), rows))
        else:
            values.append(_next_power_of_two(int(evaluate(payload, bound.env))))
    return values


def descriptor_block(block, env) -> list[int]:
    """The box of a descriptor argument: padded tile sizes, 1 on the dimensions the tile does not walk."""
    return [1 if size is None else _next_power_of_two(int(evaluate(size, env))) for size in block]


def descriptor(tensor, block, rows=0):
    """A host-side TMA descriptor of ``tensor`` with box ``block`` (Triton >= 3.3); with ``rows``
    > 0, of the view that reads dimensions ``0..rows`` as one (see :func:`collapsible`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    shape, strides = list(tensor.shape), list(tensor.stride())
    if rows:
        shape = [math.prod(shape[: rows + 1])] + shape[rows + 1 :]
        strides = [_implied_strides(tensor)[rows]] + strides[rows + 1 :]
    return TensorDescriptor(tensor, shape, strides, list(block))


def _implied_strides(tensor) -> list[int]:
    """The strides, except that a size-1 dimension (before the last) gets the one a contiguous
    layout of the dimensions after it implies: its own stride is never used to address."""
    implied = list(tensor.stride())
    for d in range(tensor.dim() - 2, -1, -1):
        if tensor.shape[d] == 1:
            implied[d] = tensor.shape[d + 1] * implied[d + 1]
    return implied


def collapsible(tensor) -> int:
    """How many leading dimensions of ``tensor`` can be read together with the next one as a
    single dimension of stride ``stride(r)``: ``r`` such that every ``d < r`` is of size 1 or has
    ``stride(d) == size(d + 1) * stride(d + 1)`` (the stride of a size-1 dimension does not count:
    it is the one implied by the dimensions after it)."""
    shape, stride = tensor.shape, tensor.stride()
    implied = _implied_strides(tensor)
    r = 0
    for d in range(tensor.dim() - 1):
        if shape[d] != 1 and stride[d] != shape[d + 1] * implied[d + 1]:
            break
        r = d + 1
    return r


def _box_mapping(access):
    """For each tile dimension, the source dimension it walks with unit steps (in increasing order),
    or None when the access is not a box. Checked numerically at a few random points."""
    import random

    rng = random.Random(0)
    mapping = None
    exprs = access.source_index
    leaves = set()
    for e in exprs:
        leaves |= e.leaves() if isinstance(e, Expr) else set()
    for _ in range(3):
        env = {leaf: rng.randint(3, 40) for leaf in leaves}
        found = []
        for t in access.tile_vars:
            moved = []
            for d, e in enumerate(exprs):
                base = [evaluate(e, {**env, **{v: 0 for v in access.tile_vars}}) for _ in (0,)][0]
                steps = [evaluate(e, {**env, **{v: 0 for v in access.tile_vars}, t: k}) - base for k in (1, 2, 5)]
                if steps == [1, 2, 5]:
                    moved.append(d)
                elif any(steps):
                    return None
            if len(moved) != 1:
                return None
            found.append(moved[0])
        if found != sorted(set(found)) or (mapping is not None and found != mapping):
            return None
        mapping = found
    return mapping
