"""Integer index expressions: the trees that arrangements are made of.

An :class:`Expr` is immutable. Leaves are constants, named symbols (``symbol.Symbol``), the sizes
and strides of source tensors (:class:`SizeOf`, :class:`StrideOf`) and the index variables of the
levels of an arranged tensor (:class:`Index`). The same tree is evaluated with numbers (sizes at a
call), numpy or torch arrays (``Tensor.eval``, the cpu backend), intervals (to prove a mask always
true) and printed as a Python AST (the triton backend).
"""

from __future__ import annotations

import ast
import operator

_ARITH = {
    "+": (operator.add, ast.Add),
    "-": (operator.sub, ast.Sub),
    "*": (operator.mul, ast.Mult),
    "//": (operator.floordiv, ast.FloorDiv),
    "%": (operator.mod, ast.Mod),
}
_COMPARE = {
    "<": (operator.lt, ast.Lt),
    "<=": (operator.le, ast.LtE),
    ">": (operator.gt, ast.Gt),
    ">=": (operator.ge, ast.GtE),
}


def as_expr(value) -> Expr:
    """Wrap a Python int/float/bool as a :class:`Const`; return expressions unchanged."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, (bool, int, float)):
        return Const(value)
    if hasattr(value, "__index__"):
        return Const(int(value))
    raise TypeError(f"expected an int or a symbolic expression, got {type(value).__name__} {value!r}")


def const_value(value):
    """The Python number of a constant (int or Const), else None."""
    if isinstance(value, Const):
        return value.value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


class Expr:
    """Base class of index expressions; supports + - * // % and comparisons."""

    __slots__ = ()

    def __add__(self, other):
        return binary("+", self, other)

    def __radd__(self, other):
        return binary("+", other, self)

    def __sub__(self, other):
        return binary("-", self, other)

    def __rsub__(self, other):
        return binary("-", other, self)

    def __mul__(self, other):
        return binary("*", self, other)

    def __rmul__(self, other):
        return binary("*", other, self)

    def __floordiv__(self, other):
        return binary("//", self, other)

    def __rfloordiv__(self, other):
        return binary("//", other, self)

    def __mod__(self, other):
        return binary("%", self, other)

    def __rmod__(self, other):
        return binary("%", other, self)

    def __neg__(self):
        return binary("-", 0, self)

    def __lt__(self, other):
        return binary("<", self, other)

    def __le__(self, other):
        return binary("<=", self, other)

    def __gt__(self, other):
        return binary(">", self, other)

    def __ge__(self, other):
        return binary(">=", self, other)

    def __bool__(self):
        raise TypeError(f"the truth value of the symbolic expression {self} is unknown until call time")

    def __repr__(self):
        return ast.unparse(self.to_ast(lambda leaf: ast.Name(leaf.display_name())))

    __str__ = __repr__

    def leaves(self) -> set:
        """Every leaf (non-constant) of the tree."""
        out: set = set()
        stack = [self]
        while stack:
            node = stack.pop()
            if isinstance(node, BinOp):
                stack.extend((node.a, node.b))
            elif not isinstance(node, Const):
                out.add(node)
        return out

    def to_ast(self, leaf_fn) -> ast.expr:
        """Print as a Python AST; ``leaf_fn(leaf)`` gives each leaf's AST."""
        raise NotImplementedError


class Const(Expr):
    """A constant int, float or bool."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Const) and type(other.value) is type(self.value) and other.value == self.value

    def __hash__(self):
        return hash(("const", self.value))

    def to_ast(self, leaf_fn):
        if isinstance(self.value, (int, float)) and not isinstance(self.value, bool) and self.value < 0:
            return ast.UnaryOp(ast.USub(), ast.Constant(-self.value))
        return ast.Constant(self.value)


class Leaf(Expr):
    """A named quantity whose value comes from the environment."""

    __slots__ = ()

    def display_name(self) -> str:
        raise NotImplementedError

    def to_ast(self, leaf_fn):
        return leaf_fn(self)


class SizeOf(Leaf):
    """Size of dimension ``dim`` of a source tensor."""

    __slots__ = ("tensor", "dim")

    def __init__(self, tensor, dim):
        self.tensor = tensor
        self.dim = dim

    def __eq__(self, other):
        return type(other) is type(self) and other.tensor is self.tensor and other.dim == self.dim

    def __hash__(self):
        return hash((type(self).__name__, id(self.tensor), self.dim))

    @property
    def options(self) -> dict:
        return self.tensor._shape_options[self.dim]

    def display_name(self):
        return f"{self.tensor.display_name()}_size_{self.dim}"


class StrideOf(SizeOf):
    """Stride of dimension ``dim`` of a source tensor (in elements)."""

    __slots__ = ()

    def display_name(self):
        return f"{self.tensor.display_name()}_stride_{self.dim}"


class Index(Leaf):
    """Index variable of dimension ``dim`` of one level (a ``Tensor`` node) of an arranged tensor."""

    __slots__ = ("level", "dim")

    def __init__(self, level, dim):
        self.level = level
        self.dim = dim

    def __eq__(self, other):
        return type(other) is Index and other.level is self.level and other.dim == self.dim

    def __hash__(self):
        return hash(("index", id(self.level), self.dim))

    def display_name(self):
        return f"index_{self.dim}"


class BinOp(Expr):
    """``a op b`` for arithmetic, comparison, ``&`` (and) and ``min``/``max``."""

    __slots__ = ("op", "a", "b", "_hash")

    def __init__(self, op, a, b):
        self.op = op
        self.a = a
        self.b = b
        self._hash = hash((op, a, b))

    def __eq__(self, other):
        return (
            type(other) is BinOp
            and other._hash == self._hash
            and other.op == self.op
            and other.a == self.a
            and other.b == self.b
        )

    def __hash__(self):
        return self._hash

    def to_ast(self, leaf_fn):
        return binop_ast(self.op, self.a.to_ast(leaf_fn), self.b.to_ast(leaf_fn))


def binop_ast(op, a: ast.expr, b: ast.expr) -> ast.expr:
    """The Python AST of ``a op b`` for an operator of :class:`BinOp`."""
    if op in _ARITH:
        return ast.BinOp(a, _ARITH[op][1](), b)
    if op in _COMPARE:
        return ast.Compare(a, [_COMPARE[op][1]()], [b])
    if op == "&":
        return ast.BinOp(a, ast.BitAnd(), b)
    return ast.Call(ast.Name(op), [a, b], [])


def binary(op, a, b) -> Expr:
    """Build ``a op b`` with constant folding and the identities that keep trees small."""
    a, b = as_expr(a), as_expr(b)
    ca, cb = const_value(a), const_value(b)
    if ca is not None and cb is not None:
        return Const(_apply(op, ca, cb))
    if op in ("+", "-") and cb is not None and isinstance(cb, int) and isinstance(a, BinOp) and a.op in ("+", "-"):
        inner = const_value(a.b)
        if isinstance(inner, int) and not isinstance(inner, bool):
            total = (inner if a.op == "+" else -inner) + (cb if op == "+" else -cb)
            return a.a if total == 0 else BinOp("+" if total > 0 else "-", a.a, Const(abs(total)))
    if op == "+":
        if ca == 0:
            return b
        if cb == 0:
            return a
        if isinstance(b, BinOp) and b.op == "-" and b.b == a:
            return b.a
        if isinstance(a, BinOp) and a.op == "-" and a.b == b:
            return a.a
    elif op == "-":
        if cb == 0:
            return a
        if a == b:
            return Const(0)
        if isinstance(a, BinOp) and a.op == "+" and a.b == b:
            return a.a
    elif op == "*":
        if ca == 0 or cb == 0:
            return Const(0)
        if ca == 1:
            return b
        if cb == 1:
            return a
    elif op == "//":
        if cb == 1:
            return a
        if ca == 0:
            return Const(0)
    elif op == "%":
        if cb == 1 or ca == 0:
            return Const(0)
    elif op == "&":
        if isinstance(a, Const):
            return b if a.value else Const(False)
        if isinstance(b, Const):
            return a if b.value else Const(False)
    elif op in ("<", "<=", ">", ">=") and a == b:
        return Const(op in ("<=", ">="))
    return BinOp(op, a, b)


def _apply(op, x, y):
    if op in _ARITH:
        return _ARITH[op][0](x, y)
    if op in _COMPARE:
        return _COMPARE[op][0](x, y)
    if op == "&":
        return x & y
    if op == "min":
        return min(x, y)
    if op == "max":
        return max(x, y)
    raise ValueError(f"unknown operator {op!r}")


def minimum(a, b) -> Expr:
    """Symbolic ``min(a, b)``."""
    return binary("min", a, b)


def maximum(a, b) -> Expr:
    """Symbolic ``max(a, b)``."""
    return binary("max", a, b)


def conjunction(conditions) -> Expr:
    """``c0 & c1 & ...`` (``True`` when empty)."""
    out: Expr = Const(True)
    for condition in conditions:
        out = binary("&", out, condition)
    return out


def evaluate(expr, env, ops=None):
    """Evaluate ``expr`` with ``env[leaf]`` for every leaf.

    Values may be numbers, numpy arrays or torch tensors; ``ops`` overrides how ``&``, ``min`` and
    ``max`` combine arrays (``{"&": f, "min": f, "max": f}``).
    """
    memo: dict = {}

    def go(node):
        if isinstance(node, Const):
            return node.value
        if not isinstance(node, BinOp):
            if not isinstance(node, Expr):
                return node
            try:
                return env[node]
            except KeyError:
                raise KeyError(f"no value for {node.display_name()}") from None
        key = id(node)
        if key in memo:
            return memo[key]
        x, y = go(node.a), go(node.b)
        if ops and node.op in ops and not (_is_number(x) and _is_number(y)):
            value = ops[node.op](x, y)
        else:
            value = _apply(node.op, x, y)
        memo[key] = value
        return value

    return go(as_expr(expr))


def _is_number(x):
    return isinstance(x, (int, float, bool))


def interval(expr, env):
    """Bounds ``(lo, hi)`` of ``expr`` (inclusive) given ``env[leaf] = (lo, hi)``; None if unknown.

    Comparisons give ``(0, 1)`` unless decided, ``(1, 1)`` when always true.
    """
    memo: dict = {}

    def go(node):
        if isinstance(node, Const):
            v = node.value
            return (int(v), int(v)) if isinstance(v, bool) else (v, v)
        if not isinstance(node, BinOp):
            return env.get(node)
        key = id(node)
        if key in memo:
            return memo[key]
        x, y = go(node.a), go(node.b)
        memo[key] = out = _interval_op(node.op, x, y)
        return out

    return go(as_expr(expr))


def _interval_op(op, x, y):
    if x is None or y is None:
        return (0, 1) if op in _COMPARE or op == "&" else None
    (a, b), (c, d) = x, y
    if op == "+":
        return (a + c, b + d)
    if op == "-":
        return (a - d, b - c)
    if op == "*":
        products = (a * c, a * d, b * c, b * d)
        return (min(products), max(products))
    if op == "//":
        if c <= 0:
            return None
        candidates = (a // c, a // d, b // c, b // d)
        return (min(candidates), max(candidates))
    if op == "%":
        if c <= 0:
            return None
        if a >= 0 and b < c and c == d:
            return (a, b)
        return (0, d - 1) if a >= 0 else None
    if op == "min":
        return (min(a, c), min(b, d))
    if op == "max":
        return (max(a, c), max(b, d))
    if op == "&":
        return (min(a, c), min(b, d))
    decided = {
        "<": (b < c, a >= d),
        "<=": (b <= c, a > d),
        ">": (a > d, b <= c),
        ">=": (a >= d, b < c),
    }[op]
    if decided[0]:
        return (1, 1)
    if decided[1]:
        return (0, 0)
    return (0, 1)


def affine(expr, variables, env):
    """Write ``expr`` as ``const + sum(coef[v] * v)`` over ``variables`` with integer values.

    Every other leaf takes its integer value from ``env``. Returns ``(const, {v: coef})`` or None
    when the expression is not affine in the variables (``//`` or ``%`` of an index, say).
    """

    def go(node):
        if isinstance(node, Const):
            return (node.value, {})
        if not isinstance(node, BinOp):
            if node in variables:
                return (0, {node: 1})
            return (env[node], {})
        x, y = go(node.a), go(node.b)
        if x is None or y is None:
            return None
        if node.op in ("+", "-"):
            sign = 1 if node.op == "+" else -1
            coefs = dict(x[1])
            for v, c in y[1].items():
                coefs[v] = coefs.get(v, 0) + sign * c
            return (x[0] + sign * y[0], coefs)
        if node.op == "*":
            if x[1] and y[1]:
                return None
            if not x[1]:
                x, y = y, x
            return (x[0] * y[0], {v: c * y[0] for v, c in x[1].items()})
        if not x[1] and not y[1]:
            return (_apply(node.op, x[0], y[0]), {})
        return None

    return go(as_expr(expr))


def substitute(expr, mapping: dict) -> Expr:
    """Replace leaves by the expressions in ``mapping`` (rebuilding with simplification)."""
    memo: dict = {}

    def go(node):
        if isinstance(node, Const):
            return node
        if not isinstance(node, BinOp):
            return as_expr(mapping[node]) if node in mapping else node
        key = id(node)
        if key not in memo:
            memo[key] = binary(node.op, go(node.a), go(node.b))
        return memo[key]

    return go(as_expr(expr))
