"""Symbolic tensors and the arrangement operations (meta-operations) on them.

An arranged tensor is a hierarchy of levels: ``t`` (the outermost, one element per program),
``t.dtype`` (the next level), ``t.dtype.dtype``, ... down to an element type. Every level is a
``Tensor`` node. A node made by a meta-operation keeps *edges* to the node(s) it was made from;
an edge is a function from the node's index tuple to a contribution to its parent's index tuple,
and a node's index is the sum of the contributions it receives (so ``tile`` splits an index into
``outer * stride + inner * dilation``). Walking the edges from the hierarchy's levels to the source
gives the source index of every element, and the range checks of every node on the way give the
mask. Nodes are never modified after they are made; meta-operations return new nodes.
"""

from __future__ import annotations

from ninefold.dsl.expr import Const, Expr, Index, SizeOf, as_expr, binary, const_value, maximum

_SHAPE_OPTION_KEYS = {"constexpr", "upper_bound", "lower_bound"}


def _plain(value):
    """Constants as Python ints (what users see in ``shape``), expressions unchanged."""
    c = const_value(value)
    return int(c) if c is not None and float(c).is_integer() else value


class Tensor:
    """A symbolic tensor: a source parameter of a kernel, or a level of an arranged one.

    :param ndim: number of dimensions (or give ``shape``).
    :param shape: sizes; ``None`` entries become symbols bound at call time.
    :param dtype: element type (a torch dtype), or for a level, the next level down.
    :param other: value read where a tile overhangs the source (default 0 on cpu, unspecified on triton).
    :param shape_options: dict (all dims) or one dict per dim: ``constexpr``, ``upper_bound``.
    :param constexpr: for a 0-dim tensor (a scalar): a compile-time constant.
    :param value: for a constexpr scalar: its fixed value (then it is not passed at the call).
    :param name: display name (the kernel names its parameters after the arrangement's).
    """

    def __init__(
        self,
        ndim=None,
        shape=None,
        dtype=None,
        other=None,
        shape_options=None,
        constexpr=None,
        value=None,
        name=None,
        jagged_dim=None,
    ):
        if jagged_dim is not None:
            raise NotImplementedError("jagged tensors are not supported by ninefold.dsl")
        if ndim is None and shape is None:
            raise ValueError("Tensor needs ndim or shape; got neither")
        if shape is not None:
            shape = tuple(shape)
            if ndim is not None and ndim != len(shape):
                raise ValueError(f"Tensor: ndim={ndim} disagrees with shape={shape}")
            ndim = len(shape)
        if not isinstance(ndim, int) or ndim < 0:
            raise ValueError(f"Tensor: ndim must be a non-negative int, got {ndim!r}")
        if shape is None:
            shape = (None,) * ndim
        if shape_options is None or isinstance(shape_options, dict):
            shape_options = (shape_options,) * ndim
        shape_options = tuple(dict(o or {}) for o in shape_options)
        if len(shape_options) != ndim:
            raise ValueError(f"Tensor: shape_options has {len(shape_options)} entries for ndim={ndim}")
        for options in shape_options:
            unknown = set(options) - _SHAPE_OPTION_KEYS
            if unknown:
                raise ValueError(f"Tensor: unknown shape option(s) {sorted(unknown)}; accepted {sorted(_SHAPE_OPTION_KEYS)}")
        if constexpr and ndim != 0:
            raise ValueError(f"Tensor: constexpr is only for 0-dim tensors, got ndim={ndim}")
        if value is not None and not constexpr:
            raise ValueError("Tensor: value is only for constexpr (0-dim) tensors")
        self._shape_options = shape_options
        self._shape = tuple(SizeOf(self, d) if s is None else as_expr(s) for d, s in enumerate(shape))
        self.dtype = dtype
        self.other = other
        self.constexpr = bool(constexpr)
        self.value = value
        self.name = name
        self.source = self
        self._edges = ()
        self._requires = ()

    # ----------------------------------------------------------------- structure
    @classmethod
    def _node(cls, source, shape, dtype, edges, requires=()):
        node = cls.__new__(cls)
        node.source = source
        node._shape = tuple(as_expr(s) for s in shape)
        node.dtype = dtype
        node._edges = tuple(edges)
        node._requires = tuple(requires)
        return node

    def _derive(self, shape, fn, requires=()):
        """A node one step from ``self`` at the same level (keeps ``self.dtype``)."""
        return Tensor._node(self.source, shape, self.dtype, [(self, fn)], requires)

    @property
    def shape(self) -> tuple:
        """Sizes of this level (ints where known, symbolic expressions otherwise)."""
        return tuple(_plain(s) for s in self._shape)

    @shape.setter
    def shape(self, value):
        raise AttributeError("Tensor.shape cannot be assigned; use the meta-operations")

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def size(self, dim=None):
        """``shape`` or ``shape[dim]``."""
        return self.shape if dim is None else self.shape[dim]

    @property
    def is_source(self) -> bool:
        return self.source is self

    def display_name(self) -> str:
        return self.source.name or "tensor"

    def levels(self) -> list[Tensor]:
        """The hierarchy: this level, its dtype, its dtype's dtype, ..."""
        out, node = [], self
        while isinstance(node, Tensor):
            out.append(node)
            node = node.dtype
        return out

    def innermost(self) -> Tensor:
        return self.levels()[-1]

    def __repr__(self):
        shapes = " -> ".join(str(tuple(level.shape)) for level in self.levels())
        return f"Tensor({self.display_name()}: {shapes})"

    def _dim(self, dim, ndim=None, what="dim"):
        ndim = self.ndim if ndim is None else ndim
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"{what} must be an int, got {type(dim).__name__} {dim!r}")
        if not -ndim <= dim < max(ndim, 1):
            raise IndexError(f"{what}={dim} is out of range for a {ndim}-dim level (shape {self.shape})")
        return dim % ndim if ndim else 0

    # ----------------------------------------------------------------- meta-operations
    def tile(self, tile_shape, strides=None, dilation=None, floor_mode=False):
        """Cut this level into tiles: returns the grid of tiles, whose ``dtype`` is one tile.

        ``-1`` in ``tile_shape`` takes the whole dimension; ``strides`` (default: the tile size,
        ``-1`` also means the tile size) smaller than a tile give overlapping windows;
        ``dilation`` spaces the elements inside a tile. The number of tiles rounds up (tiles may
        overhang and are masked) unless ``floor_mode``.
        """
        tile_shape = tuple(tile_shape)
        if len(tile_shape) != self.ndim:
            raise ValueError(f"tile: tile_shape {tile_shape} has {len(tile_shape)} entries for a {self.ndim}-dim level")
        strides = tuple(strides) if strides is not None else (-1,) * self.ndim
        dilation = tuple(dilation) if dilation is not None else (1,) * self.ndim
        if len(strides) != self.ndim or len(dilation) != self.ndim:
            raise ValueError(f"tile: strides {strides} and dilation {dilation} need {self.ndim} entries")
        outer, inner, steps, spacings = [], [], [], []
        for size, t, s, d in zip(self._shape, tile_shape, strides, dilation):
            t = size if const_value(t) == -1 else as_expr(t)
            s = t if const_value(s) == -1 else as_expr(s)
            d = as_expr(d)
            for name, v in (("tile size", t), ("stride", s), ("dilation", d)):
                if const_value(v) is not None and const_value(v) <= 0:
                    raise ValueError(f"tile: {name} must be positive (or -1), got {const_value(v)}")
            if t == size and s == t:
                n = Const(1)
            elif const_value(d) == 1 and s == t:
                n = size // t if floor_mode else (size + t - 1) // t
            else:
                span = size - d * (t - 1) - 1
                n = span // s + 1 if floor_mode else (span + s - 1) // s + 1
            outer.append(n)
            inner.append(t)
            steps.append(s)
            spacings.append(d)
        inner_node = Tensor._node(
            self.source, inner, self.dtype, [(self, lambda idx: tuple(i * d for i, d in zip(idx, spacings)))]
        )
        return Tensor._node(
            self.source, outer, inner_node, [(self, lambda idx: tuple(i * s for i, s in zip(idx, steps)))]
        )

    def expand(self, shape):
        """Repeat singleton dimensions: ``-1`` keeps a dimension, a size broadcasts a size-1 one."""
        shape = tuple(shape)
        if len(shape) != self.ndim:
            raise ValueError(f"expand: shape {shape} has {len(shape)} entries for a {self.ndim}-dim level")
        keep = [const_value(s) == -1 for s in shape]
        requires = []
        for dim, (size, k) in enumerate(zip(self._shape, keep)):
            if k:
                continue
            c = const_value(size)
            if c is not None and c != 1:
                raise ValueError(f"expand: dimension {dim} has size {c}; only size-1 dimensions expand")
            if c is None:
                requires.append((size, f"expand: dimension {dim} must have size 1"))
        new_shape = [old if k else new for old, new, k in zip(self._shape, shape, keep)]
        return self._derive(
            new_shape, lambda idx: tuple(i if k else Const(0) for i, k in zip(idx, keep)), requires
        )

    def squeeze(self, dim):
        """Remove size-1 dimension(s) ``dim`` (an int or a tuple); checked at the call if symbolic."""
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        dims = sorted({self._dim(d, what="squeeze dim") for d in dims})
        requires = []
        for d in dims:
            c = const_value(self._shape[d])
            if c is not None and c != 1:
                raise ValueError(f"squeeze: dimension {d} has size {c}; only size-1 dimensions squeeze")
            if c is None:
                requires.append((self._shape[d], f"squeeze: dimension {d} must have size 1"))
        ndim = self.ndim

        def fn(idx):
            it = iter(idx)
            return tuple(Const(0) if d in dims else next(it) for d in range(ndim))

        return self._derive([s for d, s in enumerate(self._shape) if d not in dims], fn, requires)

    def unsqueeze(self, dim):
        """Insert a size-1 dimension at ``dim``."""
        dim = self._dim(dim, ndim=self.ndim + 1, what="unsqueeze dim")
        shape = list(self._shape)
        shape.insert(dim, Const(1))
        return self._derive(shape, lambda idx: tuple(i for d, i in enumerate(idx) if d != dim))

    def permute(self, dims):
        """Reorder dimensions: dimension ``i`` of the result is dimension ``dims[i]`` of this level."""
        dims = tuple(self._dim(d, what="permute dim") for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute: dims {dims} is not a permutation of range({self.ndim})")
        return self._derive(
            [self._shape[d] for d in dims], lambda idx: tuple(idx[dims.index(d)] for d in range(len(dims)))
        )

    def flatten(self, start_dim=None, end_dim=None):
        """Merge dimensions ``start_dim`` up to but excluding ``end_dim`` (NineToothed's convention)."""
        start = 0 if start_dim is None else self._dim(start_dim, what="start_dim")
        if end_dim is None:
            end = self.ndim
        else:
            end = end_dim + self.ndim if end_dim < 0 else end_dim
            if not start < end <= self.ndim:
                raise ValueError(f"flatten: end_dim={end_dim} must be in ({start}, {self.ndim}] (it is exclusive)")
        merged = self._shape[start:end]
        size = Const(1)
        for s in merged:
            size = size * s

        def fn(idx):
            flat = idx[start]
            parts = []
            for s in reversed(merged[1:]):
                parts.append(flat % s)
                flat = flat // s
            parts.append(flat)
            return tuple(idx[:start]) + tuple(reversed(parts)) + tuple(idx[start + 1 :])

        return self._derive(list(self._shape[:start]) + [size] + list(self._shape[end:]), fn)

    def ravel(self):
        """Flatten the hierarchy: one level whose dims are all levels' dims, outermost first."""
        levels = self.levels()
        shape = [s for level in levels for s in level._shape]
        edges = []
        start = 0
        for level in levels:
            stop = start + level.ndim
            edges.append((level, lambda idx, a=start, b=stop: tuple(idx[a:b])))
            start = stop
        return Tensor._node(self.source, shape, levels[-1].dtype, edges)

    def pad(self, pad):
        """Pad each dimension by ``(before, after)`` (one pair per dimension, in order)."""
        pad = tuple(tuple(p) for p in pad)
        if len(pad) != self.ndim or any(len(p) != 2 for p in pad):
            raise ValueError(f"pad: need one (before, after) pair per dimension ({self.ndim}), got {pad}")
        return self._derive(
            [s + a + b for s, (a, b) in zip(self._shape, pad)],
            lambda idx: tuple(i - a for i, (a, _) in zip(idx, pad)),
        )

    def __getitem__(self, key):
        """Index this level with ints, slices (any step), ``None`` and ``...``."""
        key = key if isinstance(key, tuple) else (key,)
        if sum(k is Ellipsis for k in key) > 1:
            raise IndexError("only one Ellipsis is allowed in an index")
        effective = sum(k is not None and k is not Ellipsis for k in key)
        if effective > self.ndim:
            raise IndexError(f"too many indices ({effective}) for a {self.ndim}-dim level")
        expanded = []
        for k in key:
            if k is Ellipsis:
                expanded.extend([slice(None)] * (self.ndim - effective))
            else:
                expanded.append(k)
        out, dim = self, 0
        for k in expanded:
            if k is None:
                out = out.unsqueeze(dim)
                dim += 1
            elif isinstance(k, slice):
                out = out._slice(dim, k.start, k.stop, k.step)
                dim += 1
            elif isinstance(k, (int, Expr)) and not isinstance(k, bool):
                stop = None if const_value(k) == -1 else k + 1
                out = out._slice(dim, k, stop, 1)
                out = out._derive([s for d, s in enumerate(out._shape) if d != dim], _drop_dim(dim, out.ndim))
            else:
                raise TypeError(f"index entries must be int, slice, None or ..., got {type(k).__name__}")
        return out

    def _slice(self, dim, start, stop, step):
        size = self._shape[dim]
        step = 1 if step is None else step
        if not isinstance(step, int) or step == 0:
            raise ValueError(f"slice step must be a non-zero int, got {step!r}")
        csize, cstart, cstop = const_value(size), const_value(start), const_value(stop)
        if csize is not None and (start is None or cstart is not None) and (stop is None or cstop is not None):
            first, _, _ = slice(cstart, cstop, step).indices(csize)
            n = len(range(*slice(cstart, cstop, step).indices(csize)))
            begin = Const(first)
        else:
            def norm(v):
                c = const_value(v)
                return size + c if c is not None and c < 0 else as_expr(v)

            if step > 0:
                begin = Const(0) if start is None else norm(start)
                end = size if stop is None else norm(stop)
                n = maximum((end - begin + step - 1) // step, 0)
            else:
                begin = size - 1 if start is None else norm(start)
                end = Const(-1) if stop is None else norm(stop)
                n = maximum((begin - end - step - 1) // (-step), 0)
        shape = list(self._shape)
        shape[dim] = n

        def fn(idx):
            out = list(idx)
            out[dim] = begin + idx[dim] * step
            return tuple(out)

        return self._derive(shape, fn)

    # ----------------------------------------------------------------- evaluation
    def eval(self, subs=None):
        """Source index (flat, row-major over the source shape) of every element, -1 where masked.

        ``subs`` maps source tensors to ``{"shape": sizes}`` (or a concrete ``Tensor``) and
        symbols to ints. The result has the shapes of all levels concatenated, outermost first.
        """
        from ninefold.dsl.arrange_eval import eval_index_map

        return eval_index_map(self, subs)


def _drop_dim(dim, ndim):
    def fn(idx):
        it = iter(idx)
        return tuple(Const(0) if d == dim else next(it) for d in range(ndim))

    return fn


def resolve(top: Tensor, level_indices):
    """Map indices of every level of ``top``'s hierarchy to source indices.

    ``level_indices`` holds one tuple of index expressions per level (outermost first). Returns
    ``(source_indices, conditions, requires)``: the source index of each source dimension, the
    range checks of every intermediate node and of the source (their conjunction is the mask), and
    the ``(size, message)`` pairs that must equal 1 at the call.
    """
    levels = top.levels()
    if len(level_indices) != len(levels):
        raise ValueError(f"{len(level_indices)} index tuples for {len(levels)} levels")
    given = {id(level): tuple(as_expr(i) for i in idx) for level, idx in zip(levels, level_indices)}
    nodes: dict[int, Tensor] = {}
    stack = list(levels)
    while stack:
        node = stack.pop()
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        stack.extend(parent for parent, _ in node._edges)
    indegree = {key: 0 for key in nodes}
    for node in nodes.values():
        for parent, _ in node._edges:
            indegree[id(parent)] += 1
    ready = [node for key, node in nodes.items() if indegree[key] == 0]
    received: dict[int, list] = {}
    conditions: list[Expr] = []
    requires: list = []
    source_index = None
    while ready:
        node = ready.pop()
        requires.extend(node._requires)
        if id(node) in given:
            idx = given[id(node)]
        else:
            parts = received.get(id(node))
            if not parts:
                raise ValueError(f"arrangement level {node} is not reachable from the arranged tensor")
            idx = tuple(_sum(column) for column in zip(*parts)) if node.ndim else ()
            for i, size in zip(idx, node._shape):
                conditions.append(binary(">=", i, 0))
                conditions.append(binary("<", i, size))
        if node is node.source:
            source_index = idx
        for parent, fn in node._edges:
            contribution = fn(idx)
            if len(contribution) != parent.ndim:
                raise AssertionError("edge produced an index of the wrong length")
            received.setdefault(id(parent), []).append(contribution)
            indegree[id(parent)] -= 1
            if indegree[id(parent)] == 0:
                ready.append(parent)
    if source_index is None:
        raise ValueError(f"{top} does not reach its source tensor")
    conditions = [c for c in conditions if not (isinstance(c, Const) and c.value)]
    return source_index, _dedupe(conditions), requires


def _sum(values):
    out = Const(0)
    for v in values:
        out = out + v
    return out


def _dedupe(items):
    seen, out = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def level_index_vars(top: Tensor):
    """``Index`` leaves for every dimension of every level of ``top``'s hierarchy."""
    return [tuple(Index(level, d) for d in range(level.ndim)) for level in top.levels()]
