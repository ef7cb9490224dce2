"""Recognise applications in the flash-attention form, for schedules that pipeline them.

The form, on the normalized application (see ``frontend``)::

    <prologue: no loops; reads one tensor parameter Q, whole (no middle index)>
    for j in range(a, b):                    # one loop, or several over consecutive ranges
        kt = _nf.load(K, (j,))
        s = nl.dot(A, nl.trans(kt))          # A: assigned by the prologue, by no loop
        <statements that do not read acc>
        vt = _nf.load(V, (j,))
        acc = acc * F + nl.dot(P, vt)        # or F * acc + ..., nl.dot(...) + acc * F, acc + nl.dot(...), acc += ...
        <statements that do not read acc>
    <epilogue: no loops, no loads>
    _nf.store(O, (), value)

Nothing but the one update reads the accumulator inside the loops, so the update of iteration ``j`` can
run while iteration ``j + 1`` computes its scores (what FlashAttention-3 does on Hopper). ``match`` says
why an application is not in the form; it checks structure only (the code generator checks each
expression it translates).
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

from ninefold.dsl import language
from ninefold.dsl.compiler.frontend import is_language_module, is_nf_call, names_in


class NotInForm(Exception):
    """The application is not in the flash-attention form (the message says where)."""


@dataclass
class Update:
    """``acc = acc * scale + nl.dot(probabilities, vt)``: ``scale`` None for ``acc + nl.dot(...)``."""

    scale: ast.expr | None
    probabilities: ast.expr
    position: int  # index in the loop's body


@dataclass
class Loop:
    var: str
    start: ast.expr
    stop: ast.expr
    body: list  # the loop's statements without the loads of K and V
    scores: str  # the name the scores statement assigns
    score_position: int
    update: Update
    score_value: ast.expr = None  # the scores statement's value, its product replaced by the name ``nf_s``


@dataclass
class Form:
    query: str  # the parameter the prologue reads
    key: str
    value: str
    out: str
    operand: str  # A, the first product's left operand (loop-invariant)
    operand_is_query: bool  # A is the query tile as read (in a loop): no prologue computes it
    accumulator: str
    prologue: list
    loops: list
    epilogue: list  # before the store
    result: ast.expr  # the value stored to ``out``


def language_call(node, namespace, locals_=()) -> str | None:
    """The name of the ``ninefold.dsl.language`` function ``node`` calls, if it calls one."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id not in locals_:
        if is_language_module(namespace.get(func.value.id)):
            return func.attr
    if isinstance(func, ast.Name) and func.id not in locals_:
        value = namespace.get(func.id)
        if getattr(value, "__module__", None) == language.__name__ and callable(value):
            return func.id
    return None


def _assigned(stmt) -> set:
    return names_in([stmt], ast.Store)


def match(app, tensor_params) -> Form:
    """The application's flash-attention form; ``NotInForm`` saying why where it has none."""
    body = app.tree.body
    first = next((i for i, s in enumerate(body) if isinstance(s, (ast.For, ast.While))), None)
    if first is None:
        raise NotInForm("no loop")
    last = first
    while last + 1 < len(body) and isinstance(body[last + 1], ast.For):
        last += 1
    prologue, loops_ast, tail = body[:first], body[first : last + 1], body[last + 1 :]
    for stmt in prologue + tail:
        if any(isinstance(n, (ast.For, ast.While)) for n in ast.walk(stmt)):
            raise NotInForm("a loop outside the consecutive loops over key tiles")
    if not tail or not (isinstance(tail[-1], ast.Expr) and is_nf_call(tail[-1].value, "store")):
        raise NotInForm("the application does not end by storing its result")
    store = tail[-1].value
    if store.args[1].elts:
        raise NotInForm("the result is stored to an indexed middle level")
    epilogue = tail[:-1]
    for stmt in epilogue:
        if any(is_nf_call(n, "load") or is_nf_call(n, "store") for n in ast.walk(stmt)):
            raise NotInForm("the epilogue reads or writes a parameter before the final store")
    namespace = app.namespace
    loops = [_loop(stmt, namespace) for stmt in loops_ast]
    invariant = {loop_.invariant for loop_ in loops} - {None}
    query = _prologue_query(prologue, invariant)
    keys = {(loop_.key, loop_.value, loop_.operand, loop_.accumulator) for loop_ in loops}
    if len(keys) != 1:
        raise NotInForm("the loops read different key/value parameters, operands or accumulators")
    key, value, operand, accumulator = keys.pop()
    operand_is_query = bool(invariant)
    for a, b in zip(loops, loops[1:]):
        if ast.dump(a.loop.stop) != ast.dump(b.loop.start):
            raise NotInForm("the loops do not cover consecutive ranges (each starts where the one before stops)")
    assigned_in_loops = set().union(set(), *(_assigned(s) for loop_ in loops for s in loop_.loop.body))
    range_names = names_in([n for loop_ in loops for n in (loop_.loop.start, loop_.loop.stop)], ast.Load)
    if range_names & assigned_in_loops:
        raise NotInForm("a loop assigns a name that a loop range reads")
    if operand in assigned_in_loops:
        raise NotInForm(f"the first product's left operand {operand!r} changes inside the loops")
    prologue_assigned = set().union(set(), *(_assigned(s) for s in prologue))
    if operand not in prologue_assigned and not operand_is_query:
        raise NotInForm(f"the first product's left operand {operand!r} is not computed before the loops")
    if accumulator not in prologue_assigned:
        raise NotInForm(f"the accumulator {accumulator!r} is not initialised before the loops")
    if {key, value} & {query} or store.args[0].value in (key, value):
        raise NotInForm("the query, key/value and output parameters must be distinct")
    return Form(
        query=query, key=key, value=value, out=store.args[0].value, operand=operand,
        operand_is_query=operand_is_query, accumulator=accumulator,
        prologue=prologue, loops=[loop_.loop for loop_ in loops], epilogue=epilogue, result=store.args[2],
    )


def form_of(kernel) -> Form | str:
    """``kernel``'s flash-attention form, or why it has none (matched once, kept on the kernel)."""
    if "fa3_form" not in kernel._cache:
        try:
            kernel._cache["fa3_form"] = match(kernel.app, [p.name for p in kernel.params if not p.is_scalar])
        except NotInForm as error:
            kernel._cache["fa3_form"] = str(error)
    return kernel._cache["fa3_form"]


def _prologue_query(prologue, invariant) -> str:
    """The query parameter: the one the prologue reads, or the loops read whole as the product's operand."""
    loaded = set(invariant)
    for stmt in prologue:
        for node in ast.walk(stmt):
            if is_nf_call(node, "store"):
                raise NotInForm("the prologue stores to a parameter")
            if is_nf_call(node, "load"):
                if node.args[1].elts:
                    raise NotInForm("the prologue reads a middle level of a parameter")
                loaded.add(node.args[0].value)
    if len(loaded) != 1:
        raise NotInForm(f"the prologue and the products must read exactly one parameter whole (the queries), "
                        f"they read {sorted(loaded)}")
    return loaded.pop()


@dataclass
class _LoopMatch:
    loop: Loop
    key: str
    value: str
    operand: str
    accumulator: str
    invariant: str | None  # the parameter read whole in the loop as the product's operand


def _loop(node, namespace) -> _LoopMatch:
    if not (isinstance(node, ast.For) and isinstance(node.target, ast.Name) and not node.orelse):
        raise NotInForm("the loops must be plain `for j in range(...)` loops")
    it = node.iter
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
            and 1 <= len(it.args) <= 2 and not it.keywords):
        raise NotInForm("the loops must run over range(stop) or range(start, stop)")
    var = node.target.id
    start, stop = (ast.Constant(0), it.args[0]) if len(it.args) == 1 else it.args
    loads, aliases, whole, body = {}, {}, {}, []
    for stmt in node.body:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and is_nf_call(stmt.value, "load")):
            index = stmt.value.args[1].elts
            if not index:  # a parameter read whole: the same tile in every iteration
                whole[stmt.targets[0].id] = stmt.value.args[0].value
                continue
            if not (len(index) == 1 and isinstance(index[0], ast.Name) and index[0].id == var):
                raise NotInForm(f"a loop reads {stmt.value.args[0].value}[...] other than at the loop index")
            loads[stmt.targets[0].id] = stmt.value.args[0].value
            continue
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, ast.Name) and stmt.value.id in loads):  # key = k[j]: another name for it
            aliases[stmt.targets[0].id] = stmt.value.id
            continue
        if any(is_nf_call(n) and n.func.attr in ("load", "store") for n in ast.walk(stmt)):
            raise NotInForm("a loop reads or writes a parameter other than by one load of a key and a value tile")
        body.append(stmt)
    if aliases:
        if set(aliases) & set().union(set(), *(_assigned(s) for s in body)):
            raise NotInForm("a loop reassigns a name it gave to a key or value tile")
        body = [_Rename(aliases).visit(stmt) for stmt in body]
    if var in set().union(set(), *(_assigned(s) for s in body)):
        raise NotInForm(f"the loop assigns its index {var!r}")
    if len(loads) != 2:
        raise NotInForm(f"a loop must read two tiles at its index (keys and values), it reads {len(loads)}")
    score_position, scores_name, operand, key_temp, score_value = _find_scores(body, loads, namespace)
    if set(whole) - {operand} or any(t in names_in([s], ast.Load) for t in whole for s in body[:score_position]
                                      + body[score_position + 1:]):
        raise NotInForm("a loop reads a parameter whole other than as the scores' left operand")
    value_temp = next(t for t in loads if t != key_temp)
    if sum(language_call(n, namespace) == "dot" for n in ast.walk(body[score_position])) != 1:
        raise NotInForm("the scores statement computes more than one product")
    update_position, accumulator, update = _find_update(body, value_temp, namespace)
    if accumulator in names_in([update.probabilities], ast.Load):
        raise NotInForm("the accumulator's update reads the accumulator in its product")
    for i, stmt in enumerate(body):
        dots = [n for n in ast.walk(stmt) if language_call(n, namespace) == "dot"]
        if dots and i not in (score_position, update_position):
            raise NotInForm("a loop computes a product other than the scores and the accumulator's update")
        if i != update_position and accumulator in names_in([stmt], ast.Load) | names_in([stmt], ast.Store):
            raise NotInForm(f"the loop reads or writes the accumulator {accumulator!r} outside its update")
        if i != score_position and key_temp in names_in([stmt], ast.Load):
            raise NotInForm("the key tile is used other than in the scores' product")
        if i != update_position and value_temp in names_in([stmt], ast.Load):
            raise NotInForm("the value tile is used other than in the accumulator's update")
    loop = Loop(var, start, stop, body, scores_name, score_position, update, score_value)
    invariant = whole.get(operand)
    if invariant is not None:
        operand = "nf_query"  # one name for the query tile across loops
    return _LoopMatch(loop, loads[key_temp], loads[value_temp], operand, accumulator, invariant)


def _find_scores(body, loads, namespace):
    """``(position, name, operand, key temp, value)`` of the one statement ``s = ...nl.dot(a, nl.trans(kt))...``
    (``value`` with that product replaced by the name ``nf_s``; the rest of it elementwise, checked later)."""
    found = []
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        for node in ast.walk(stmt.value):
            if language_call(node, namespace) != "dot" or len(node.args) != 2 or node.keywords:
                continue
            a, b = node.args
            if (isinstance(a, ast.Name) and language_call(b, namespace) == "trans" and len(b.args) == 1
                    and isinstance(b.args[0], ast.Name) and b.args[0].id in loads):
                value = _Replace(node, ast.Name("nf_s", ast.Load())).visit(copy.deepcopy(stmt.value))
                found.append((i, stmt.targets[0].id, a.id, b.args[0].id, value))
    if len(found) != 1:
        raise NotInForm("a loop must compute its scores once from `nl.dot(a, nl.trans(key_tile))`")
    return found[0]


class _Replace(ast.NodeTransformer):
    """Replaces the node equal (by its dump) to ``target``."""

    def __init__(self, target, by):
        self.target, self.by = ast.dump(target), by

    def visit(self, node):
        if ast.dump(node) == self.target:
            return self.by
        return super().visit(node)


def _find_update(body, value_temp, namespace):
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and isinstance(stmt.op, ast.Add):
            dot = _value_product(stmt.value, value_temp, namespace)
            if dot is not None:
                return i, stmt.target.id, Update(None, dot, i)
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        acc, value = stmt.targets[0].id, stmt.value
        if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)):
            continue
        for carried, product in ((value.left, value.right), (value.right, value.left)):
            dot = _value_product(product, value_temp, namespace)
            if dot is None:
                continue
            if isinstance(carried, ast.Name) and carried.id == acc:
                return i, acc, Update(None, dot, i)
            if isinstance(carried, ast.BinOp) and isinstance(carried.op, ast.Mult):
                for a, b in ((carried.left, carried.right), (carried.right, carried.left)):
                    if isinstance(a, ast.Name) and a.id == acc and acc not in names_in([b], ast.Load):
                        return i, acc, Update(b, dot, i)
    raise NotInForm("a loop must update its accumulator as `acc = acc * f + nl.dot(p, value_tile)`")


def _value_product(node, value_temp, namespace):
    """``p`` where ``node`` is ``nl.dot(p, value_tile)``."""
    if language_call(node, namespace) == "dot" and len(node.args) == 2 and not node.keywords:
        p, v = node.args
        if isinstance(v, ast.Name) and v.id == value_temp and value_temp not in names_in([p], ast.Load):
            return p
    return None


class _Rename(ast.NodeTransformer):
    def __init__(self, names):
        self.names = names

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.names:
            return ast.Name(self.names[node.id], ast.Load())
        return node
