"""Parse an application and normalize its access to parameters.

The normalized function reads and writes tensor parameters only through calls on a pseudo
object ``_nf`` that each backend implements:

* ``_nf.load(name, index)`` -- the tile of parameter ``name`` (``index`` selects a middle level);
* ``_nf.store(name, index, value)`` -- assignment to a parameter;
* ``_nf.shape(name, index)``, ``_nf.dtype(name)``, ``_nf.offsets(name, index, dim)``,
  ``_nf.source_shape(name)``.

Reads of parameters are hoisted into temporaries before the statement that uses them, one per
distinct (parameter, index) in that statement, so a parameter read twice in one statement is
loaded once; ``p += v`` becomes a load, the operation and a store.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field

NF = "_nf"


@dataclass
class Application:
    """A normalized application: ``tree`` is ``def name(_nf, *params)``."""

    name: str
    params: tuple[str, ...]
    tree: ast.FunctionDef
    namespace: dict = field(repr=False)
    source: str = field(repr=False, default="")


def parse(func) -> tuple[ast.FunctionDef, dict, str]:
    """The function's definition (decorators removed) and the names it can see."""
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as error:
        raise TypeError(f"application {func!r}: its source is not available ({error})") from None
    module = ast.parse(source)
    tree = next(node for node in module.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
    tree.decorator_list = []
    tree.returns = None
    for arg in tree.args.args:
        arg.annotation = None
    namespace = dict(func.__globals__)
    closure = inspect.getclosurevars(func)
    namespace.update(closure.nonlocals)
    return tree, namespace, source


def normalize(func, tensor_params) -> Application:
    """Normalize ``func``; ``tensor_params`` are the parameter names that are (non-scalar) tensors."""
    tree, namespace, source = parse(func)
    params = tuple(arg.arg for arg in tree.args.args)
    taken = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | set(params)
    body = _Normalizer(set(tensor_params), taken).block(tree.body)
    args = ast.arguments(
        posonlyargs=[], args=[ast.arg(NF)] + [ast.arg(p) for p in params], kwonlyargs=[], kw_defaults=[], defaults=[]
    )
    new = ast.FunctionDef(name=tree.name, args=args, body=body or [ast.Pass()], decorator_list=[], returns=None)
    new.type_params = []
    ast.fix_missing_locations(new)
    return Application(tree.name, params, new, namespace, source)


def nf_call(method, *args) -> ast.Call:
    return ast.Call(ast.Attribute(ast.Name(NF, ast.Load()), method, ast.Load()), list(args), [])


def is_language_module(module) -> bool:
    """Whether ``module`` is the in-kernel language (``ninefold.dsl.language``, or NineToothed's, which sources
    written for NineToothed import)."""
    from ninefold.dsl import language

    return module is language or getattr(module, "__name__", "") == "ninetoothed.language"


def names_in(nodes, ctx) -> set:
    """The names that ``nodes`` (AST nodes) read (``ctx`` ``ast.Load``) or assign (``ast.Store``)."""
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def is_nf_call(node, method=None) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == NF
        and (method is None or node.func.attr == method)
    )


class _Normalizer:
    def __init__(self, tensors, taken):
        self.tensors = tensors
        self.taken = set(taken)

    def fresh(self, base):
        n = 0
        while f"{base}_{n}" in self.taken:
            n += 1
        self.taken.add(f"{base}_{n}")
        return f"{base}_{n}"

    # ------------------------------------------------------------------ statements
    def block(self, stmts):
        out = []
        for stmt in stmts:
            out.extend(self.stmt(stmt))
        return out

    def stmt(self, node):
        pre: list = []
        cache: dict = {}
        if isinstance(node, ast.Assign):
            value = self.expr(node.value, pre, cache)
            stores = []
            for target in node.targets:
                ref = self.param_ref(target)
                if ref is not None:
                    stores.append(ast.Expr(nf_call("store", ast.Constant(ref[0]), ref[1], value)))
                elif any(self.param_ref(t) is not None for t in ast.walk(target)):
                    raise SyntaxError(f"line {node.lineno}: assign to a tensor parameter on its own (x = value)")
            if stores:
                if len(node.targets) != len(stores):
                    raise SyntaxError(f"line {node.lineno}: chained assignment mixing parameters and locals")
                return pre + stores
            targets = [self.expr(t, pre, cache) for t in node.targets]
            return pre + [ast.Assign(targets=targets, value=value, lineno=node.lineno)]
        if isinstance(node, ast.AugAssign):
            ref = self.param_ref(node.target)
            if ref is not None:
                current = self.load_temp(ref[0], ref[1], pre, cache)
                value = ast.BinOp(current, node.op, self.expr(node.value, pre, cache))
                return pre + [ast.Expr(nf_call("store", ast.Constant(ref[0]), ref[1], value))]
            return pre + [
                ast.AugAssign(self.expr(node.target, pre, cache), node.op, self.expr(node.value, pre, cache))
            ]
        if isinstance(node, ast.AnnAssign):
            return self.stmt(ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno))
        if isinstance(node, ast.For):
            iterable = self.expr(node.iter, pre, cache)
            return pre + [ast.For(node.target, iterable, self.block(node.body), self.block(node.orelse))]
        if isinstance(node, ast.If):
            test = self.expr(node.test, pre, cache)
            return pre + [ast.If(test, self.block(node.body), self.block(node.orelse))]
        if isinstance(node, ast.While):
            if any(self.param_ref(n) is not None for n in ast.walk(node.test)):
                raise SyntaxError(f"line {node.lineno}: a while condition cannot read a tensor parameter")
            return [ast.While(node.test, self.block(node.body), self.block(node.orelse))]
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.With, ast.Try)):
            raise SyntaxError(f"line {node.lineno}: {type(node).__name__} is not supported in an application")
        new = self.transform_fields(node, pre, cache)
        return pre + [new]

    def transform_fields(self, node, pre, cache):
        fields = {}
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                value = self.expr(value, pre, cache)
            elif isinstance(value, list):
                value = [self.expr(v, pre, cache) if isinstance(v, ast.expr) else v for v in value]
            fields[name] = value
        return type(node)(**fields)

    # ------------------------------------------------------------------ expressions
    def param_ref(self, node):
        """``(name, index_tuple_ast)`` when ``node`` is ``p`` or ``p[...]`` for a tensor parameter."""
        if isinstance(node, ast.Name) and node.id in self.tensors:
            return node.id, ast.Tuple([], ast.Load())
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in self.tensors:
            index = node.slice
            elts = list(index.elts) if isinstance(index, ast.Tuple) else [index]
            return node.value.id, ast.Tuple(elts, ast.Load())
        return None

    def load_temp(self, name, index, pre, cache):
        key = (name, ast.dump(index))
        if key not in cache:
            temp = self.fresh(name)
            pre.append(ast.Assign([ast.Name(temp, ast.Store())], nf_call("load", ast.Constant(name), index), lineno=0))
            cache[key] = temp
        return ast.Name(cache[key], ast.Load())

    def expr(self, node, pre, cache):
        ref = self.param_ref(node)
        if ref is not None and isinstance(getattr(node, "ctx", ast.Load()), ast.Load):
            index = self.expr(ref[1], pre, cache)
            return self.load_temp(ref[0], index, pre, cache)
        if isinstance(node, ast.Attribute):
            special = self.attribute(node, pre, cache)
            if special is not None:
                return special
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "offsets"
            and self.param_ref(node.func.value) is not None
        ):
            name, index = self.param_ref(node.func.value)
            dim = self.expr(node.args[0], pre, cache) if node.args else ast.Constant(None)
            return nf_call("offsets", ast.Constant(name), self.expr(index, pre, cache), dim)
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.GeneratorExp, ast.DictComp, ast.SetComp)):
            return node
        return self.transform_fields(node, pre, cache)

    def attribute(self, node, pre, cache):
        ref = self.param_ref(node.value)
        if ref is not None:
            name, index = ref[0], self.expr(ref[1], pre, cache)
            if node.attr == "shape":
                return nf_call("shape", ast.Constant(name), index)
            if node.attr == "ndim":
                return ast.Call(ast.Name("len", ast.Load()), [nf_call("shape", ast.Constant(name), index)], [])
            if node.attr == "dtype":
                return nf_call("dtype", ast.Constant(name))
            if node.attr == "source":
                raise SyntaxError(f"line {node.lineno}: use {name}.source.shape (other source attributes are not supported)")
            return ast.Attribute(self.load_temp(name, index, pre, cache), node.attr, ast.Load())
        if isinstance(node.value, ast.Attribute) and node.value.attr == "source":
            ref = self.param_ref(node.value.value)
            if ref is not None:
                if node.attr == "shape":
                    return nf_call("source_shape", ast.Constant(ref[0]))
                if node.attr == "ndim":
                    return ast.Call(ast.Name("len", ast.Load()), [nf_call("source_shape", ast.Constant(ref[0]))], [])
                if node.attr == "dtype":
                    return nf_call("dtype", ast.Constant(ref[0]))
                raise SyntaxError(f"line {node.lineno}: unknown attribute {ref[0]}.source.{node.attr}")
        return None
