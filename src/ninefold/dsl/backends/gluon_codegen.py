"""Lower an application in the flash-attention form to Gluon with FlashAttention-3's schedule (sm_90).

Each program's ``BLOCK_M`` = 128 query rows run in three partitions (the structure of
``ninefold.bench.attention_gluon``, measured at 101-106% of cuDNN on an H100):

* a one-warp producer loads the two 64-row halves of the query tile once, then the key and value
  tiles of every iteration through TMA into a ring of ``STAGES`` shared-memory slots;
* two consumer warpgroups of 64 rows each run the application: the prologue's tensor statements,
  the loop bodies (the scores' product from shared memory, the statements on them as written) and
  the epilogue. The accumulator's update of iteration ``t`` is issued in iteration ``t + 1``, after
  that iteration's scores are requested, so the tensor cores work while the softmax runs; with
  ``pingpong`` the two warpgroups take turns issuing their products.

Scalar statements of the prologue (the loop bounds) run once per program with all ``BLOCK_M`` rows
and are handed to the partitions; the consecutive loops become one loop over their iterations in
order, each iteration running the body of the loop it belongs to. Expressions go through
``gluon_values.Translator``; sizes, offsets and TMA coordinates come from the arrangement exactly as
for the Triton code (``triton_codegen``). ``Unsupported`` means: keep the Triton code.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import re
from dataclasses import dataclass

from ninefold.dsl import language
from ninefold.dsl.backends.gluon_values import (
    WG_ROWS,
    Translator,
    Unsupported,
    Val,
    call,
    gl,
    layout,
    name,
    shape_of,
)
from ninefold.dsl.backends.triton_codegen import _Lowering, _Namer, _next_power_of_two, _program_indices
from ninefold.dsl.compiler.access import analyze
from ninefold.dsl.compiler.frontend import names_in
from ninefold.dsl.compiler.online_softmax import form_of
from ninefold.dsl.expr import SizeOf, evaluate
from ninefold.dsl.symbol import Symbol

BLOCK_M = 2 * WG_ROWS
PRODUCER_REGS, CONSUMER_REGS, MAXNREG = 24, 240, 168  # measured best on the H100 (docs/perf/dsl.md)
UNPACK = "NF_UNPACK_CONTEXT"  # replaced by the unpacking of the context once every name is known
GL_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16"}
HEADER = '''import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# Triton 3.9 renamed the TMA copies
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
'''


@dataclass
class GluonGenerated:
    """Generated Gluon module text, its kernel's name and arguments, and the launch facts."""

    source: str
    function_name: str
    arguments: list  # (name, kind, payload): "descriptor" (param, rows, block), "leaf" leaf, "scalar" param
    key: str
    block_n: int
    head_dim: int


# names the generated module binds itself (besides nf_*/NF_* and the leaves' names)
TEMPLATE_NAMES = {
    "WG", "bars", "ctx", "args", "turn", "q_ready", "k_ready", "v_ready", "k_empty", "v_empty", "q_smem", "k_smem",
    "v_smem", "o_smem", "program", "tile", "group_width", "first_m", "group_m", "gl", "gluon", "triton", "mbarrier",
    "tma", "warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "_tma_load", "_tma_store",
}


def _roles(form):
    return {form.query: ("m", "d"), form.out: ("m", "d"), form.key: ("n", "d"), form.value: ("n", "d")}


class _Generator:
    DTYPES = set(language.DTYPES)

    def __init__(self, kernel, bound, spec, collapse, stages, pingpong, group):
        self.form = form_of(kernel)
        if isinstance(self.form, str):
            raise Unsupported(f"not in the flash-attention form: {self.form}")
        self.kernel, self.bound, self.stages, self.pingpong, self.group = kernel, bound, stages, pingpong, group
        self.namespace = kernel.app.namespace
        self.roles = _roles(self.form)
        tensors = [p.name for p in kernel.params if not p.is_scalar]
        if sorted(tensors) != sorted(self.roles):
            raise Unsupported(f"tensor parameters {tensors} other than queries, keys, values and output")
        self.namer = _Namer(kernel)
        self.lowering = _Lowering(kernel, spec, self.namer, tma="rows", collapse=collapse)
        self.namer.taken |= self.lowering.locals
        generated_names = set(kernel.symbol_names.values()) | {kernel.leaf_name(leaf) for leaf in kernel.call_leaves()}
        for local in self.lowering.locals:
            if (local.lower().startswith("nf_") or local in TEMPLATE_NAMES or local in generated_names
                    or re.fullmatch(r"(program|extent)_\d+|BLOCK_P2_\d+|\w+_(size|stride)_\d+", local)):
                raise Unsupported(f"the application's name {local!r} is one the generated module uses")
        for param in kernel.params:
            if param.name.lower().startswith("nf_") or param.name in TEMPLATE_NAMES:
                raise Unsupported(f"the parameter name {param.name!r} is one the generated module uses")
        dtypes = {str(bound.values[n].dtype) for n in self.roles}
        if len(dtypes) != 1 or not dtypes <= GL_DTYPES.keys():
            raise Unsupported(f"dtypes {sorted(dtypes)} (one of bfloat16, float16 for all four tensors)")
        self.dtype = GL_DTYPES[dtypes.pop()]
        self.block_m = self._tile_size(self.form.query, 0)
        self.block_n = self._tile_size(self.form.key, 0, middle=True)
        self.head_dim = self._tile_size(self.form.query, 1)
        if self.block_m != BLOCK_M or self.block_n not in (64, 128) or self.head_dim not in (64, 128):
            raise Unsupported(f"tiles BLOCK_M={self.block_m}, BLOCK_N={self.block_n}, D={self.head_dim} "
                              f"(accepted: 128, 64 or 128, 64 or 128)")
        for param in (self.form.key, self.form.value):
            if self._tile_size(param, 1, middle=True) != self.head_dim or self._tile_size(param, 0, middle=True) != self.block_n:
                raise Unsupported("key and value tiles of different shapes")
        if self._tile_size(self.form.out, 0) != BLOCK_M or self._tile_size(self.form.out, 1) != self.head_dim:
            raise Unsupported("an output tile of another shape than the query tile")
        self.runtime_leaves: dict = {}
        self.runtime_scalars: list = []
        self.top_names: list = []
        self.top_assigned: dict = {}  # names the program-wide statements assign, in order
        self.shadowed: set = set()  # names the per-warpgroup prologue statements assign

    # ----------------------------------------------------------------- facts for the translator
    def _tile_size(self, param, dim, middle=False) -> int:
        access = analyze(self.kernel.param(param).arranged, 1 if middle else 0, param)
        if len(access.tile_vars) != 2:
            raise Unsupported(f"{param}: its tile is not two-dimensional")
        return int(evaluate(access.tile_level._shape[dim], self.bound.env))

    def extent(self, axis, mode) -> int:
        return {"m": WG_ROWS if mode == "consumer" else BLOCK_M, "n": self.block_n, "d": self.head_dim}[axis]

    def global_value(self, id_):
        param = next((p for p in self.kernel.params if p.name == id_), None)
        if param is not None:
            if not param.is_scalar:
                raise Unsupported(f"the tensor parameter {id_!r} used directly")
            if not param.passed:
                return Val(ast.Constant(param.source.value))
            if param.source.constexpr:
                return Val(ast.Constant(self.bound.values[id_]))
            if id_ not in self.runtime_scalars:
                self.runtime_scalars.append(id_)
            return Val(name(id_))
        value = self.namespace.get(id_)
        if isinstance(value, (bool, int, float)):
            return Val(ast.Constant(value))
        if isinstance(value, Symbol):
            return Val(self.fix(name(self.namer.leaf(value))))
        return None

    def fix(self, node):
        """Leaves that are compile-time constants become literals; the others are recorded as arguments."""
        padded = {v: k for k, v in self.namer.padded.items()}

        class Fix(ast.NodeTransformer):
            def visit_Name(inner, n):  # noqa: N805
                if n.id == "tl":
                    return name("gl")
                if n.id in padded:
                    return ast.Constant(_next_power_of_two(int(evaluate(padded[n.id], self.bound.env))))
                leaf = self.namer.used.get(n.id)
                if leaf is not None:
                    constant = (isinstance(leaf, Symbol) and (leaf.meta or leaf.constexpr)) or (
                        type(leaf) is SizeOf and leaf.options.get("constexpr"))
                    if constant:
                        return ast.Constant(int(evaluate(leaf, self.bound.env)))
                    self.runtime_leaves[n.id] = leaf
                return n

        return Fix().visit(copy.deepcopy(node))

    def size_code(self, size) -> ast.expr:
        return self.fix(self.namer.expr(size))

    def nf_call(self, translator, node) -> Val:
        method, param = node.func.attr, node.args[0].value
        index = [translator.expr(e) for e in node.args[1].elts] if len(node.args) > 1 else []
        if any(v.axes or v.kind != "value" for v in index):
            raise Unsupported(f"{param}[...] indexed by a tensor")
        index_nodes = [v.code for v in index]
        if method == "load":
            if translator.mode != "consumer" or param != self.form.query or index:
                raise Unsupported(f"a load of {param} outside the prologue's query tile")
            return Val(ast.parse("q_smem.index(WG).load(NF_O)", mode="eval").body, ("m", "d"), "o", dtype=self.dtype)
        if method == "dtype":
            return Val(gl(self.dtype), kind="dtype", dtype=self.dtype)
        if method == "source_shape":
            source = self.kernel.param(param).source
            items = [Val(self.size_code(s)) for s in source._shape]
            return Val(ast.Tuple([v.code for v in items], ast.Load()), kind="tuple", items=items)
        if method == "shape":
            levels = self.kernel.param(param).arranged.levels()
            depth = 2 if index else 1
            if depth >= len(levels):
                return Val(ast.Tuple([], ast.Load()), kind="tuple", items=[])
            level = levels[depth]
            is_tile = depth == len(levels) - 1 and param in self.roles
            items = [Val(self.size_code(s), axis=self.roles[param][d] if is_tile else None) for d, s in enumerate(level._shape)]
            return Val(ast.Tuple([v.code for v in items], ast.Load()), kind="tuple", items=items)
        if method == "offsets":
            return self.offsets(translator, param, index_nodes, ast.literal_eval(node.args[2]))
        raise Unsupported(f"_nf.{method}")

    def offsets(self, translator, param, index_nodes, dim) -> Val:
        if dim is None or param not in self.roles:
            raise Unsupported(f"{param}.offsets() of every dimension")
        access = analyze(self.kernel.param(param).arranged, len(index_nodes), param)
        expr = access.source_index[dim % len(access.source_index)]
        tile_vars = [v for v in access.tile_vars if v in expr.leaves()]
        if len(tile_vars) != 1:
            raise Unsupported(f"{param}.offsets({dim}) along other than one tile dimension")
        axis = self.roles[param][tile_vars[0].dim]
        if translator.mode == "top" and axis != "m":
            raise Unsupported(f"{param}.offsets({dim}) where the loop bounds are computed")
        code = self.lowering.render(expr, access, index_nodes, flat_tile=True)
        parent = "b" if translator.mode == "top" else ("o" if axis == "d" else "s")
        arange = call("arange", ast.Constant(0), ast.Constant(self.extent(axis, translator.mode)),
                      layout=layout((axis,), parent))
        if translator.mode == "consumer" and axis == "m":
            arange = ast.BinOp(ast.BinOp(name("WG"), ast.Mult(), ast.Constant(WG_ROWS)), ast.Add(), arange)

        class Arange(ast.NodeTransformer):
            def visit_Call(inner, n):  # noqa: N805
                if isinstance(n.func, ast.Attribute) and n.func.attr == "arange":
                    return copy.deepcopy(arange)
                inner.generic_visit(n)
                return n

        return Val(self.fix(Arange().visit(code)), (axis,), parent)

    def coordinates(self, param, index_nodes) -> list:
        """The TMA coordinates of ``param``'s tile in the rows-collapsed 2-D view of its source."""
        loaded = self.lowering.descriptor_load(param, index_nodes)
        ok = (isinstance(loaded, ast.Call) and isinstance(loaded.func, ast.Attribute) and loaded.func.attr == "load"
              and isinstance(loaded.func.value, ast.Name) and loaded.func.value.id == f"{param}_desc"
              and isinstance(loaded.args[0], ast.List) and len(loaded.args[0].elts) == 2)
        if not ok or any(isinstance(n, ast.Attribute) and n.attr == "where" for n in ast.walk(loaded)):
            raise Unsupported(f"{param}: its tiles are not whole rows of a 2-D view of the source (a tile that can "
                              "overhang the sequence, or strides that do not collapse)")
        return [self.fix(e) for e in loaded.args[0].elts]

    # ----------------------------------------------------------------- the module
    def generate(self) -> GluonGenerated:
        form = self.form
        first = next(p for p in self.kernel.params if not p.is_scalar)
        programs = _program_indices(self.kernel, first.arranged._shape, self.namer, False, self.group > 0,
                                    max(self.group, 1))
        self.programs = [self.fix(s) for s in programs]
        self.program_names = [t.id for s in self.programs for t in s.targets if t.id.startswith("program_")]
        top = Translator(self, "top", {})
        top_stmts, consumer_prologue = self.split(form.prologue, top)
        stops, top_ranges = [], []
        for i, loop in enumerate(form.loops):
            start = top.expr(loop.start) if i == 0 else stops[-1]
            stop = top.expr(loop.stop)
            for v in (start, stop):
                if v.axes or v.kind != "value":
                    raise Unsupported("a loop range that is not a scalar")
            stops.append(stop)
            before = f"nf_end_{i - 1} + " if i else ""
            top_ranges += [f"nf_start_{i} = gl.to_tensor({ast.unparse(start.code)})",
                           f"nf_end_{i} = {before}gl.maximum(gl.to_tensor({ast.unparse(stop.code)}) - nf_start_{i}, 0)"]
        top_ranges.append(f"nf_total = nf_end_{len(form.loops) - 1}")
        self.top_names = list(self.top_assigned)  # every one a scalar; handed to the partitions
        consumer = self.consumer_text(consumer_prologue)
        producer = self.producer_text()
        kernel = self.kernel_text(top_stmts, top_ranges)  # last: the arguments are known once all is translated
        unpack = f"({', '.join(self.context_names())},) = ctx"
        source = (f'"""Generated by ninefold.dsl (Gluon, FlashAttention-3 schedule) from {self.kernel.name}; '
                  f'do not edit."""\n\n{HEADER}\n\n{producer}\n\n{consumer}\n\n{kernel}').replace(UNPACK, unpack)
        key = hashlib.sha256(source.encode()).hexdigest()[:24]
        return GluonGenerated(source, f"{self.kernel.name}_fa3", self.arguments, key, self.block_n, self.head_dim)

    def split(self, stmts, top, seen=None):
        """(top-level statements translated, consumer statements untranslated): a statement goes to the top
        level where it translates there and gives a scalar, and moving it ahead of the consumer statements
        before it changes nothing (it assigns no name they read or assign; names they assign leave the top)."""
        seen = set() if seen is None else seen  # names the consumer statements so far read or assign
        top_out, rest = [], []
        for stmt in stmts:
            if isinstance(stmt, ast.If):
                test = top.expr(stmt.test)
                if test.axes:
                    raise Unsupported("an `if` on a tensor in the prologue")
                body_top, body_rest = self.split(stmt.body, top, seen)
                else_top, else_rest = self.split(stmt.orelse, top, seen)
                if (body_rest or else_rest) and not isinstance(test.code, ast.Constant):
                    if names_in(body_top + else_top, ast.Store) & names_in([stmt.test], ast.Load):
                        raise Unsupported("an `if` whose test the prologue's scalar statements change")
                if body_top or else_top:
                    top_out.append(ast.If(test.code, body_top or [ast.Pass()], else_top))
                if body_rest or else_rest:
                    rest.append(ast.If(stmt.test, body_rest or [ast.Pass()], else_rest))
                    seen |= names_in([stmt.test], ast.Load)  # the consumers evaluate the test again: keep its names
                continue
            before = dict(top.env)
            try:
                if names_in([stmt], ast.Store) & seen:
                    raise Unsupported("reorders")
                out = top.stmt(stmt)
                if any(v.axes or v.kind != "value" for k, v in top.env.items() if before.get(k) is not v):
                    raise Unsupported("not a scalar")
                top_out += out
                self.top_assigned.update(dict.fromkeys(sorted(names_in([stmt], ast.Store))))
            except Unsupported:
                top.env.clear()
                top.env.update(before)
                for assigned in names_in([stmt], ast.Store):
                    top.env.pop(assigned, None)  # later top statements must not read the stale value,
                    self.shadowed.add(assigned)  # nor the parameter or global of that name
                seen |= names_in([stmt], ast.Store) | names_in([stmt], ast.Load)
                rest.append(stmt)
        return top_out, rest

    def context_names(self) -> list:
        programs = sorted(set(self.program_names))
        hoisted = [n for n, _ in self.namer.hoisted.values()]
        return (sorted(self.runtime_leaves) + self.runtime_scalars + hoisted + programs + self.top_names
                + [f"nf_start_{i}" for i in range(len(self.form.loops))]
                + [f"nf_end_{i}" for i in range(len(self.form.loops))] + ["nf_total"])

    def segment_dispatch(self, counter, f_name, p_name, env) -> list:
        """Statements running iteration ``counter`` of the combined loop: the body of the loop it belongs to,
        with the update replaced by ``f_name``/``p_name`` (its factor and probabilities, for later)."""
        branches, kinds = [], set()
        for i, loop in enumerate(self.form.loops):
            translator = Translator(self, "consumer", dict(env))
            offset = f"({counter} - nf_end_{i - 1})" if i else counter
            stmts = ast.parse(f"{loop.var} = nf_start_{i} + {offset}").body
            translator.env[loop.var] = Val(name(loop.var))
            translator.env["nf_s"] = Val(name("nf_s"), ("m", "n"), "s", dtype="float32")
            update = loop.update
            for k, stmt in enumerate(loop.body[: update.position]):
                if k == loop.score_position:
                    stmt = ast.Assign([ast.Name(loop.scores, ast.Store())], loop.score_value, lineno=0)
                stmts += translator.stmt(stmt)
            if loop.score_position > update.position:
                raise Unsupported("the accumulator's update comes before the scores")
            if update.scale is not None:
                factor = translator.expr(update.scale)
                if factor.axes == ("m", None) and factor.vector is not None:
                    code = call("convert_layout", factor.vector.code, layout(("m",), "o"))
                    kinds.add("vector")
                elif not factor.axes:
                    code = call("to_tensor", factor.code)
                    kinds.add("scalar")
                else:
                    raise Unsupported("an accumulator factor other than a scalar or v[:, None]")
                stmts.append(ast.Assign([ast.Name(f_name, ast.Store())], code, lineno=0))
            else:
                kinds.add("none")
            probabilities = translator.expr(update.probabilities)
            if probabilities.axes != ("m", "n"):
                raise Unsupported("probabilities that are not a score-shaped tile")
            if probabilities.dtype is not None and probabilities.dtype != self.dtype:
                raise Unsupported(f"probabilities of dtype {probabilities.dtype} (the product runs on "
                                  f"{self.dtype} operands: convert them with .to)")
            stmts.append(ast.Assign([ast.Name(p_name, ast.Store())],
                                    call("convert_layout", translator.convert(probabilities, "s"), name("NF_P")), lineno=0))
            stmts.append(ast.parse(f'gl.static_assert({p_name}.dtype == gl.{self.dtype}, '
                                   f'"fa3: the probabilities must be {self.dtype}")').body[0])
            stmts += translator.block(loop.body[update.position + 1 :])
            branches.append(stmts)
            for key, value in translator.env.items():  # carried state the next iterations read
                if key in env and shape_of(env[key]) != shape_of(value):
                    raise Unsupported(f"{key!r} changes shape inside the loop")
        if len(kinds) != 1:
            raise Unsupported("loops whose accumulator factors differ in kind")
        self.factor_kind = kinds.pop()
        out = branches[-1]
        for i in range(len(branches) - 2, -1, -1):
            test = ast.parse(f"{counter} < nf_end_{i}", mode="eval").body
            out = [ast.If(test, branches[i], out)]
        return out

    def rescale(self, f_name) -> str:
        if self.factor_kind == "none":
            return ""
        if self.factor_kind == "vector":
            return f"{self.form.accumulator} = {self.form.accumulator} * gl.expand_dims({f_name}, 1)"
        return f"{self.form.accumulator} = {self.form.accumulator} * {f_name}"

    def consumer_text(self, prologue) -> str:
        form, acc = self.form, self.form.accumulator
        env = {n: Val(name(n)) for n in self.top_names}
        translator = Translator(self, "consumer", env)
        prologue_code = translator.block(prologue)
        if acc not in env or env[acc].axes != ("m", "d"):
            raise Unsupported(f"the accumulator {acc!r} is not an output-shaped tile")
        operand = env.get(form.operand)
        if not form.operand_is_query and (operand is None or operand.axes != ("m", "d")):
            raise Unsupported(f"the operand {form.operand!r} is not a query-shaped tile")
        if not form.operand_is_query and operand.dtype not in (None, self.dtype):
            raise Unsupported(f"the operand {form.operand!r} of dtype {operand.dtype}, not {self.dtype} "
                              "(convert it with .to)")
        if env[acc].dtype not in (None, "float32"):
            raise Unsupported(f"the accumulator {acc!r} of dtype {env[acc].dtype} (float32 accepted)")
        # what the inference could not tell, the compiler checks (a failed compile keeps the Triton code)
        checks = [f'gl.static_assert({acc}.dtype == gl.float32, "fa3: the accumulator {acc} must be float32")']
        if not form.operand_is_query:
            checks.append(f'gl.static_assert({form.operand}.dtype == gl.{self.dtype}, '
                          f'"fa3: the operand {form.operand} must be {self.dtype}")')
        checks = "\n    ".join(checks)
        # an operand the prologue computes goes to the query's slot (it is read by every product from there)
        store = "" if form.operand_is_query else f"q_smem.index(WG).store({form.operand})\n    fence_async_shared()"
        peel = self.segment_dispatch("0", "nf_f", "nf_p", dict(env))
        body = self.segment_dispatch("nf_t", "nf_f_next", "nf_p_next", dict(env))
        tail = Translator(self, "consumer", dict(env))
        epilogue = tail.block(form.epilogue)
        result = tail.expr(form.result)
        if result.axes != ("m", "d"):
            raise Unsupported("a result that is not an output-shaped tile")
        out_code = tail.convert(result, "o")
        out_coords = self.coordinates(form.out, [])

        def text(stmts, indent):
            return "\n".join(" " * indent + line for s in stmts for line in ast.unparse(s).splitlines())

        pp = self.pingpong
        stages = self.stages
        zeros = f"gl.zeros([{WG_ROWS}, {self.block_n}], gl.float32, layout=NF_S)"
        lines = f'''
@gluon.jit
def nf_consumer(nf_q_desc, nf_k_desc, nf_v_desc, nf_o_desc, q_smem, k_smem, v_smem, o_smem, bars, ctx, WG: gl.constexpr):
    NF_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, {self.block_n}, 16])
    NF_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, {self.head_dim}, 16])
    NF_P: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=NF_O, k_width=2)
    q_ready, k_ready, v_ready, k_empty, v_empty, turn = bars
    {UNPACK}
    mbarrier.wait(q_ready.index(WG), 0)
{text(prologue_code, 4)}
    {checks}
    {store}
    nf_a = q_smem.index(WG)
    if nf_total > 0:
        mbarrier.wait(k_ready.index(0), 0)
        {"mbarrier.wait(turn.index(WG), WG ^ 1)" if pp else ""}
        nf_s = warpgroup_mma(nf_a, k_smem.index(0).permute((1, 0)), {zeros}, use_acc=False, is_async=True)
        {"mbarrier.arrive(turn.index(1 - WG), count=1)" if pp else ""}
        nf_s = warpgroup_mma_wait(num_outstanding=0, deps=(nf_s,))
        mbarrier.arrive(k_empty.index(0), count=1)
{text(peel, 8)}
        for nf_t in range(1, nf_total):
            nf_slot = nf_t % {stages}
            nf_prev = (nf_t - 1) % {stages}
            mbarrier.wait(k_ready.index(nf_slot), (nf_t // {stages}) & 1)
            {"mbarrier.wait(turn.index(WG), (nf_t & 1) ^ WG ^ 1)" if pp else ""}
            nf_s = warpgroup_mma(nf_a, k_smem.index(nf_slot).permute((1, 0)), {zeros}, use_acc=False, is_async=True)
            {self.rescale("nf_f")}
            mbarrier.wait(v_ready.index(nf_prev), ((nf_t - 1) // {stages}) & 1)
            {acc} = warpgroup_mma(nf_p, v_smem.index(nf_prev), {acc}, is_async=True)
            {"mbarrier.arrive(turn.index(1 - WG), count=1)" if pp else ""}
            nf_s = warpgroup_mma_wait(num_outstanding=1, deps=(nf_s,))
            mbarrier.arrive(k_empty.index(nf_slot), count=1)
{text(body, 12)}
            {acc}, nf_p = warpgroup_mma_wait(num_outstanding=0, deps=({acc}, nf_p))
            mbarrier.arrive(v_empty.index(nf_prev), count=1)
            nf_p = nf_p_next
            {"nf_f = nf_f_next" if self.factor_kind != "none" else ""}
        nf_last = (nf_total - 1) % {stages}
        mbarrier.wait(v_ready.index(nf_last), ((nf_total - 1) // {stages}) & 1)
        {self.rescale("nf_f")}
        {acc} = warpgroup_mma(nf_p, v_smem.index(nf_last), {acc}, is_async=True)
        {acc} = warpgroup_mma_wait(num_outstanding=0, deps=({acc},))
        mbarrier.arrive(v_empty.index(nf_last), count=1)
{text(epilogue, 4)}
    o_smem.index(WG).store(({ast.unparse(out_code)}).to(gl.{self.dtype}))
    fence_async_shared()
    _tma_store(nf_o_desc, [{ast.unparse(out_coords[0])} + WG * {WG_ROWS}, {ast.unparse(out_coords[1])}], o_smem.index(WG))
    tma.store_wait(0)


@gluon.jit
def nf_consumer0(nf_q_desc, nf_k_desc, nf_v_desc, nf_o_desc, q_smem, k_smem, v_smem, o_smem, bars, ctx):
    nf_consumer(nf_q_desc, nf_k_desc, nf_v_desc, nf_o_desc, q_smem, k_smem, v_smem, o_smem, bars, ctx, 0)


@gluon.jit
def nf_consumer1(nf_q_desc, nf_k_desc, nf_v_desc, nf_o_desc, q_smem, k_smem, v_smem, o_smem, bars, ctx):
    nf_consumer(nf_q_desc, nf_k_desc, nf_v_desc, nf_o_desc, q_smem, k_smem, v_smem, o_smem, bars, ctx, 1)
'''
        return "\n".join(line for line in lines.splitlines() if line.strip())

    def producer_text(self) -> str:
        form = self.form
        var = form.loops[0].var
        q_coords = self.coordinates(form.query, [])
        k_coords = self.coordinates(form.key, [name(var)])
        v_coords = self.coordinates(form.value, [name(var)])
        segment = "\n".join(
            f"        if nf_t >= nf_end_{i - 1}:\n            {var} = nf_start_{i} + (nf_t - nf_end_{i - 1})"
            for i in range(1, len(form.loops)))
        u = ast.unparse
        stages = self.stages
        return f'''
@gluon.jit
def nf_producer(nf_q_desc, nf_k_desc, nf_v_desc, nf_o_desc, q_smem, k_smem, v_smem, o_smem, bars, ctx):
    q_ready, k_ready, v_ready, k_empty, v_empty, turn = bars
    {UNPACK}
    for nf_w in gl.static_range(2):
        mbarrier.expect(q_ready.index(nf_w), nf_q_desc.block_type.nbytes)
        _tma_load(nf_q_desc, [{u(q_coords[0])} + nf_w * {WG_ROWS}, {u(q_coords[1])}], q_ready.index(nf_w), q_smem.index(nf_w))
    for nf_t in range(0, nf_total):
        {var} = nf_start_0 + nf_t
{segment}
        nf_slot = nf_t % {stages}
        nf_phase = (nf_t // {stages}) & 1
        mbarrier.wait(k_empty.index(nf_slot), nf_phase ^ 1)
        mbarrier.expect(k_ready.index(nf_slot), nf_k_desc.block_type.nbytes)
        _tma_load(nf_k_desc, [{u(k_coords[0])}, {u(k_coords[1])}], k_ready.index(nf_slot), k_smem.index(nf_slot))
        mbarrier.wait(v_empty.index(nf_slot), nf_phase ^ 1)
        mbarrier.expect(v_ready.index(nf_slot), nf_v_desc.block_type.nbytes)
        _tma_load(nf_v_desc, [{u(v_coords[0])}, {u(v_coords[1])}], v_ready.index(nf_slot), v_smem.index(nf_slot))
'''.replace("\n\n", "\n")

    def kernel_text(self, top_stmts, top_ranges) -> str:
        hoisted = [ast.Assign([ast.Name(n, ast.Store())], self.fix(v), lineno=0) for n, v in self.namer.hoisted.values()]
        form = self.form
        descriptors = [form.query, form.key, form.value, form.out]
        self.arguments = [(f"nf_{role}_desc", "descriptor", (p, self.lowering.descriptors[p][0], self._box(p)))
                          for role, p in zip("qkvo", descriptors)]
        self.arguments += [(n, "leaf", leaf) for n, leaf in sorted(self.runtime_leaves.items())]
        self.arguments += [(n, "scalar", n) for n in self.runtime_scalars]
        params = ", ".join(a[0] for a in self.arguments)
        names = self.context_names()
        body = "\n".join("    " + line for s in hoisted + self.programs + top_stmts for line in ast.unparse(s).splitlines())
        ranges = "\n".join("    " + line for line in top_ranges)
        ctx = ", ".join(f"gl.to_tensor({n})" for n in names)
        s = self.stages
        return f'''
@gluon.jit
def {self.kernel.name}_fa3({params}):
    NF_B: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
{body}
{ranges}
    q_smem = gl.allocate_shared_memory(nf_q_desc.dtype, [2] + nf_q_desc.block_type.shape, nf_q_desc.layout)
    k_smem = gl.allocate_shared_memory(nf_k_desc.dtype, [{s}] + nf_k_desc.block_type.shape, nf_k_desc.layout)
    v_smem = gl.allocate_shared_memory(nf_v_desc.dtype, [{s}] + nf_v_desc.block_type.shape, nf_v_desc.layout)
    o_smem = q_smem  # each warpgroup's query slot holds its output once its last product is done
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [{s}, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [{s}, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [{s}, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [{s}, 1], mbarrier.MBarrierLayout())
    for nf_i in gl.static_range(2):
        mbarrier.init(q_ready.index(nf_i), count=1)
        mbarrier.init(turn.index(nf_i), count=1)
    for nf_i in gl.static_range({s}):
        mbarrier.init(k_ready.index(nf_i), count=1)
        mbarrier.init(v_ready.index(nf_i), count=1)
        mbarrier.init(k_empty.index(nf_i), count=2)
        mbarrier.init(v_empty.index(nf_i), count=2)
    bars = (q_ready, k_ready, v_ready, k_empty, v_empty, turn)
    ctx = ({ctx},)
    args = (nf_q_desc, nf_k_desc, nf_v_desc, nf_o_desc, q_smem, k_smem, v_smem, o_smem, bars, ctx)
    gl.warp_specialize([(nf_consumer0, args), (nf_producer, args), (nf_consumer1, args)], [1, 4], [{PRODUCER_REGS}, {CONSUMER_REGS}])
'''

    def _box(self, param) -> list:
        rows = WG_ROWS if param in (self.form.query, self.form.out) else self.block_n
        return [rows, self.head_dim]


def generate(kernel, bound, spec, collapse, stages=2, pingpong=True, group=8) -> GluonGenerated:
    """The Gluon module for ``kernel`` at the call ``bound`` (finished: meta symbols fixed); ``Unsupported``
    where the application or the call falls outside what the schedule lowers. ``group``: programs visit the
    last two grid dimensions in groups of that many rows (0: row-major, see ``_program_indices``)."""
    return _Generator(kernel, bound, spec, collapse, stages, pingpong, group).generate()
