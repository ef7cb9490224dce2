"""Typed translation of application expressions to Gluon, with explicit layouts (for ``gluon_codegen``).

Gluon needs a layout on every tensor and exact layout agreement in each operation. In the
flash-attention form every tensor is one of a few shapes, named by axes: ``m`` (query rows), ``n``
(key columns of a score tile) and ``d`` (head dimension). A consumer warpgroup holds 64 query rows:

* score tiles ``(m, n)`` in the layout of a wgmma accumulator with N = BLOCK_N (``NF_S``);
* output tiles ``(m, d)`` in the one with N = D (``NF_O``);
* vectors in the slice of their parent: ``m`` vectors along dimension 1, ``n`` and ``d`` along 0;
* ``v[:, None]`` and ``v[None, :]`` are remembered as expansions of ``v``, so that an operation
  with a tile of the other parent expands ``v`` there instead of converting a whole tile.

In the program-wide (``top``) context, where loop bounds are computed, vectors span the program's
rows in a blocked layout (``NF_B``) and nothing two-dimensional is allowed. Whatever falls outside
raises ``Unsupported``, and the kernel keeps its Triton code.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from ninefold.dsl.compiler.frontend import is_language_module, is_nf_call
from ninefold.dsl.compiler.online_softmax import language_call

WG_ROWS = 64
UNARY = {"exp", "exp2", "log", "log2", "sqrt", "rsqrt", "abs"}
REDUCTIONS = {"max", "min", "sum"}
PARENT_NAMES = {"s": "NF_S", "o": "NF_O", "b": "NF_B"}


class Unsupported(Exception):
    """An expression the Gluon lowering does not translate (the message says which)."""


@dataclass
class Val:
    """A translated expression: its code and what it is."""

    code: ast.expr
    axes: tuple = ()  # () for scalars; ("m",), ("m", "n"), ("m", None) for a [rows, 1] tensor, ...
    parent: str | None = None  # "s", "o" or "b": the layout it is in (or, for a vector, sliced from)
    vector: Val | None = None  # for v[:, None] / v[None, :]: v
    kind: str = "value"  # "value", "tuple" (of ``items``), "dtype"
    items: list = field(default_factory=list)
    axis: str | None = None  # for a tile size in a shape tuple: the axis it measures
    dtype: str | None = None  # where known: a load's, a conversion's or a creation's (a dtype value: the one it names)


def name(id_) -> ast.Name:
    return ast.Name(id_, ast.Load())


def gl(attr) -> ast.Attribute:
    return ast.Attribute(name("gl"), attr, ast.Load())


def call(func, *args, **kwargs) -> ast.Call:
    func = gl(func) if isinstance(func, str) else func
    return ast.Call(func, list(args), [ast.keyword(k, v) for k, v in kwargs.items()])


def layout(axes, parent) -> ast.expr:
    """The layout of a tensor with ``axes`` in ``parent``."""
    base = name(PARENT_NAMES[parent])
    if len(axes) == 1 and parent != "b":
        return call("SliceLayout", ast.Constant(1 if axes[0] == "m" else 0), base)
    return base


HALF = {"bfloat16", "float16"}


def result_dtype(values) -> str | None:
    """The dtype of an elementwise result where it is known: the tensors' common one, float32 if any is float32
    (Python constants do not promote; a run-time scalar may)."""
    tensors = [v for v in values if v.axes]
    dtypes = {v.dtype for v in tensors}
    if "float32" in dtypes:
        return "float32"
    if len(dtypes) != 1 or any(not v.axes and not isinstance(v.code, ast.Constant) for v in values):
        return None
    return dtypes.pop()


def shape_of(value: Val) -> tuple:
    """What must agree where two values meet under one name (the branches of an `if`, loop iterations)."""
    return value.axes, value.parent, value.kind, value.vector is not None


def required_parent(axes, default):
    if "n" in axes:
        return "s"
    if "d" in axes:
        return "o"
    return default


class Translator:
    """Translates expressions of one context (``"top"`` or ``"consumer"``) given the generator's facts."""

    def __init__(self, gen, mode, env):
        self.gen = gen
        self.mode = mode
        self.env = env  # name -> Val (code unused: a Name)

    # ----------------------------------------------------------------- statements
    def block(self, stmts) -> list:
        out = []
        for stmt in stmts:
            out.extend(self.stmt(stmt))
        return out

    def stmt(self, node) -> list:
        if isinstance(node, ast.Pass) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            return []  # docstrings too
        if isinstance(node, ast.Assign):
            if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                raise Unsupported("assignments other than `name = value`")
            return self.assign(node.targets[0].id, self.expr(node.value))
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            value = self.binary(node.op, self.expr(ast.Name(node.target.id, ast.Load())), self.expr(node.value))
            return self.assign(node.target.id, value)
        if isinstance(node, ast.If):
            test = self.expr(node.test)
            if test.axes or test.kind != "value":
                raise Unsupported("an `if` on a tensor")
            if isinstance(test.code, ast.Constant):  # decided here, as Triton does for constexpr conditions
                return self.block(node.body if test.code.value else node.orelse)
            before = dict(self.env)
            body = self.block(node.body)
            after_body = dict(self.env)
            self.env.clear()  # the same table throughout: callers hold it
            self.env.update(before)
            orelse = self.block(node.orelse)
            for key in set(after_body) | set(self.env):
                a, b = after_body.get(key), self.env.get(key)
                if a is not None and b is not None and shape_of(a) != shape_of(b):
                    raise Unsupported(f"{key!r} is assigned tensors of different shapes in the branches of an `if`")
                self.env[key] = a or b
            return [ast.If(test.code, body or [ast.Pass()], orelse)]
        raise Unsupported(f"the statement {ast.unparse(node)!r}")

    def assign(self, target, value: Val) -> list:
        if value.kind == "tuple":
            raise Unsupported(f"{target!r}: assigning a shape tuple")
        out = []
        vector = None
        if value.vector is not None:
            # the vector an expansion came from gets a name of its own, read wherever the expansion is used
            vector_name = f"nf_vector_{target}"
            out.append(ast.Assign([ast.Name(vector_name, ast.Store())], value.vector.code, lineno=0))
            vector = Val(name(vector_name), value.vector.axes, value.vector.parent)
            dim = 1 if value.axes[0] is not None else 0
            value = Val(call("expand_dims", name(vector_name), ast.Constant(dim)), value.axes, value.parent)
        self.env[target] = Val(name(target), value.axes, value.parent, vector, value.kind, axis=value.axis,
                               dtype=value.dtype)
        return out + [ast.Assign([ast.Name(target, ast.Store())], value.code, lineno=0)]

    # ----------------------------------------------------------------- expressions
    def expr(self, node) -> Val:
        method = getattr(self, "expr_" + type(node).__name__, None)
        if method is None:
            raise Unsupported(f"the expression {ast.unparse(node)!r}")
        return method(node)

    def expr_Constant(self, node):
        return Val(node)

    def expr_Name(self, node):
        if node.id in self.env:
            return self.env[node.id]
        if self.mode == "top" and node.id in self.gen.shadowed:
            raise Unsupported(f"the name {node.id!r}, which a per-warpgroup statement reassigns, where loop bounds are computed")
        value = self.gen.global_value(node.id)
        if value is None:
            raise Unsupported(f"the name {node.id!r}")
        return value

    def expr_Tuple(self, node):
        items = [self.expr(e) for e in node.elts]
        return Val(ast.Tuple([v.code for v in items], ast.Load()), kind="tuple", items=items)

    def expr_Attribute(self, node):
        if (isinstance(node.value, ast.Name) and node.value.id not in self.env
                and is_language_module(self.gen.namespace.get(node.value.id))):  # (a local may shadow the module)
            if node.attr in self.gen.DTYPES:
                return Val(gl(node.attr), kind="dtype", dtype=node.attr)
            raise Unsupported(f"language.{node.attr} outside a call")
        if node.attr == "dtype":
            base = self.expr(node.value)
            return Val(ast.Attribute(base.code, "dtype", ast.Load()), kind="dtype", dtype=base.dtype)
        raise Unsupported(f"the attribute {ast.unparse(node)!r}")

    def expr_Subscript(self, node):
        base = self.expr(node.value)
        if base.kind == "tuple":
            try:
                index = ast.literal_eval(node.slice)
            except ValueError:
                raise Unsupported(f"a shape indexed by {ast.unparse(node.slice)!r}") from None
            if not isinstance(index, int) or not -len(base.items) <= index < len(base.items):
                raise Unsupported(f"the shape index {index!r}")
            return base.items[index]
        if len(base.axes) != 1 or not isinstance(node.slice, ast.Tuple) or len(node.slice.elts) != 2:
            raise Unsupported(f"the subscript {ast.unparse(node)!r} (only v[:, None] and v[None, :] of vectors)")
        first, second = node.slice.elts
        is_none = [isinstance(e, ast.Constant) and e.value is None for e in (first, second)]
        is_all = [isinstance(e, ast.Slice) and e.lower is e.upper is e.step is None for e in (first, second)]
        if is_all[0] and is_none[1]:
            return self.expand(base, 1)
        if is_none[0] and is_all[1]:
            return self.expand(base, 0)
        raise Unsupported(f"the subscript {ast.unparse(node)!r}")

    def expand(self, vector: Val, dim: int) -> Val:
        if self.mode == "top":
            raise Unsupported("two-dimensional values where the loop bounds are computed")
        axes = (vector.axes[0], None) if dim == 1 else (None, vector.axes[0])
        if (dim == 1) != (vector.axes[0] == "m"):
            raise Unsupported(f"a vector along {vector.axes[0]} expanded along the other dimension")
        code = call("expand_dims", vector.code, ast.Constant(dim))
        return Val(code, axes, vector.parent, vector=vector)

    def expr_UnaryOp(self, node):
        operand = self.expr(node.operand)
        code = ast.UnaryOp(node.op, operand.code)
        if isinstance(operand.code, ast.Constant) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return Val(ast.Constant(-operand.code.value if isinstance(node.op, ast.USub) else operand.code.value))
        dtype = "int1" if isinstance(node.op, ast.Not) else operand.dtype
        return Val(code, operand.axes, operand.parent, kind=operand.kind, dtype=dtype)

    def expr_BinOp(self, node):
        return self.binary(node.op, self.expr(node.left), self.expr(node.right))

    def binary(self, op, a: Val, b: Val) -> Val:
        if isinstance(a.code, ast.Constant) and isinstance(b.code, ast.Constant):  # folded, as Python would
            try:
                return Val(ast.Constant(eval(compile(ast.Expression(ast.BinOp(a.code, op, b.code)), "<fold>", "eval"))))
            except Exception:  # noqa: BLE001  (left to the compiler, e.g. a division by zero)
                pass
        value = self.broadcast([a, b], lambda x, y: ast.BinOp(x, op, y))
        if isinstance(op, ast.Div) or (isinstance(op, (ast.Mod, ast.FloorDiv)) and value.dtype in HALF):
            value.dtype = "float32" if value.axes else value.dtype  # Triton divides half floats in float32
        return value

    def expr_Compare(self, node):
        if len(node.ops) != 1:
            raise Unsupported("chained comparisons")
        op = node.ops[0]
        value = self.broadcast(
            [self.expr(node.left), self.expr(node.comparators[0])], lambda x, y: ast.Compare(x, [op], [y])
        )
        value.dtype = "int1"
        return value

    def expr_BoolOp(self, node):
        values = [self.expr(v) for v in node.values]
        if any(v.axes for v in values):
            raise Unsupported("`and`/`or` on tensors (use & and |)")
        return Val(ast.BoolOp(node.op, [v.code for v in values]))

    def expr_Call(self, node):
        if is_nf_call(node):
            return self.gen.nf_call(self, node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "to" and language_call(node, self.gen.namespace, self.env) is None:
            value = self.expr(node.func.value)
            if len(node.args) != 1 or node.keywords:
                raise Unsupported("x.to(...) with other than one dtype")
            dtype = self.expr(node.args[0])
            if dtype.kind != "dtype":
                raise Unsupported(f"x.to({ast.unparse(node.args[0])})")
            code = ast.Call(ast.Attribute(value.code, "to", ast.Load()), [dtype.code], [])
            return Val(code, value.axes, value.parent, dtype=dtype.dtype)
        func = language_call(node, self.gen.namespace, self.env)
        if func is None:
            return self.builtin(node)
        if func in UNARY:
            (x,) = self.arguments(node, 1)
            return Val(call(func, x.code), x.axes, x.parent, dtype=x.dtype)
        if func in ("maximum", "minimum"):
            return self.broadcast(self.arguments(node, 2), lambda x, y: call(func, x, y))
        if func == "where":
            condition, x, y = self.arguments(node, 3)
            value = self.broadcast([condition, x, y], lambda c, a, b: call("where", c, a, b))
            value.dtype = result_dtype([x, y])  # the condition does not take part in the promotion
            return value
        if func in REDUCTIONS:
            return self.reduce(func, node)
        if func in ("full", "zeros"):
            return self.create(func, node)
        if func == "cdiv":
            a, b = self.arguments(node, 2)
            if a.axes or b.axes:
                raise Unsupported("cdiv of tensors")
            return Val(call("cdiv", a.code, b.code))
        raise Unsupported(f"language.{func}")

    def arguments(self, node, count):
        if len(node.args) != count or node.keywords:
            raise Unsupported(f"{ast.unparse(node)!r}: expected {count} positional arguments")
        return [self.expr(a) for a in node.args]

    def builtin(self, node):
        if isinstance(node.func, ast.Name) and node.func.id in ("float", "int") and node.func.id not in self.env:
            if all(isinstance(a, ast.Constant) for a in node.args) and not node.keywords:
                return Val(ast.Constant({"float": float, "int": int}[node.func.id](*(a.value for a in node.args))))
        raise Unsupported(f"the call {ast.unparse(node)!r}")

    # ----------------------------------------------------------------- tensors
    def convert(self, value: Val, parent: str) -> ast.expr:
        """``value``'s code in ``parent``'s layout family."""
        if not value.axes or value.parent == parent:
            return value.code
        if value.vector is not None:
            dim = 1 if value.axes[0] is not None else 0
            vector = call("convert_layout", value.vector.code, layout(value.vector.axes, parent))
            return call("expand_dims", vector, ast.Constant(dim))
        return call("convert_layout", value.code, layout(value.axes, parent))

    def broadcast(self, values, build) -> Val:
        tensors = [v for v in values if v.axes]
        if any(v.kind == "tuple" for v in values):
            raise Unsupported("arithmetic on a shape tuple")
        if not tensors:
            return Val(build(*(v.code for v in values)))
        ranks = {len(v.axes) for v in tensors}
        if len(ranks) != 1:
            raise Unsupported("an implicit broadcast of a vector against a tile (write v[:, None] or v[None, :])")
        if ranks == {1}:
            axes = {v.axes for v in tensors}
            if len(axes) != 1:
                raise Unsupported(f"vectors along different axes {sorted(a[0] for a in axes)} combined")
            axes = axes.pop()
        else:
            axes = []
            for d in range(2):
                seen = {v.axes[d] for v in tensors} - {None}
                if len(seen) > 1:
                    raise Unsupported(f"tiles of different shapes combined ({sorted(seen)})")
                axes.append(seen.pop() if seen else None)
            axes = tuple(axes)
        parent = required_parent(axes, tensors[0].parent)
        codes = [self.convert(v, parent) for v in values]
        return Val(build(*codes), axes, parent, dtype=result_dtype(values))

    def reduce(self, func, node):
        if not node.args or len(node.args) > 2:
            raise Unsupported(f"{func} takes a tensor and an axis")
        x = self.expr(node.args[0])
        axis_node = node.args[1] if len(node.args) == 2 else next((k.value for k in node.keywords if k.arg == "axis"), None)
        axis = None if axis_node is None else ast.literal_eval(axis_node)
        if any(k.arg != "axis" for k in node.keywords):
            raise Unsupported(f"{func} with keywords other than axis")
        if len(x.axes) == 2 and axis in (1, -1) and x.axes[0] is not None:
            return Val(call(func, x.code, ast.Constant(1)), (x.axes[0],), x.parent, dtype=x.dtype)
        if len(x.axes) == 1 and axis in (None, 0, -1):
            if self.mode == "consumer" and x.axes[0] == "m":
                raise Unsupported(f"{func} across query rows (a warpgroup holds only part of the program's rows)")
            return Val(call(func, x.code, ast.Constant(0)))
        raise Unsupported(f"{func} over axis {axis} of a tensor along {x.axes}")

    def create(self, func, node):
        args = list(node.args)
        keywords = {k.arg: k.value for k in node.keywords}
        shape = self.expr(args.pop(0) if args else keywords.pop("shape"))
        if shape.kind != "tuple" or not shape.items or any(v.axis is None for v in shape.items):
            raise Unsupported(f"{func}: its shape must be made of the tiles' sizes")
        axes = tuple(v.axis for v in shape.items)
        if len(axes) > 2 or len(set(axes)) != len(axes) or (len(axes) == 2 and axes[0] != "m"):
            raise Unsupported(f"{func} of a tensor along {axes}")
        if self.mode == "top" and axes != ("m",):
            raise Unsupported(f"{func} of a tile where the loop bounds are computed")
        value = Val(ast.Constant(0.0)) if func == "zeros" else self.expr(args.pop(0) if args else keywords.pop("fill_value"))
        dtype_node = args.pop(0) if args else keywords.pop("dtype", None)
        dtype = Val(gl("float32"), kind="dtype", dtype="float32") if dtype_node is None else self.expr(dtype_node)
        if args or keywords or value.axes or dtype.kind != "dtype":
            raise Unsupported(f"the arguments of {func}")
        parent = "b" if self.mode == "top" else required_parent(axes, "s")
        sizes = ast.List([ast.Constant(self.gen.extent(a, self.mode)) for a in axes], ast.Load())
        return Val(call("full", sizes, value.code, dtype.code, layout=layout(axes, parent)), axes, parent,
                   dtype=dtype.dtype)
