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

from ninefold.dsl.expr import Const, Expr, Index, SizeOf, as_expr, binary, const_value, maximum, minimum

_SHAPE_OPTION_KEYS = {"constexpr", "upper_bound", "lower_bound"}


def _plain(value):
    """Constants as Python ints (what users see in ``shape``), expressions unchanged."""
    c = const_value(value)
    return int(c) if c is not None and float(c).is_integer() else value


class DimensionError(IndexError, ValueError):
    """A dimension or an index out of range: an ``IndexError`` as in torch, and a ``ValueError``."""


def _size(value, what) -> Expr:
    """A size-like argument as an expression: an int or a symbolic expression, nothing else."""
    if isinstance(value, Expr) and not isinstance(value, Const):
        return value
    c = const_value(value)
    if c is None and not isinstance(value, bool) and hasattr(value, "__index__"):
        c = int(value)  # numpy and torch integers
    if c is None or isinstance(c, bool) or not float(c).is_integer():
        raise TypeError(
            f"{what} must be an int or a symbolic expression (Symbol), got {type(value).__name__} {value!r}"
        )
    return Const(int(c))


def _entries(values, what, ndim) -> tuple:
    """``values`` as a tuple of ``ndim`` entries (one per dimension)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(
            f"{what} must be a tuple with one entry per dimension ({ndim}), got {type(values).__name__} {values!r}"
        )
    values = tuple(values)
    if len(values) != ndim:
        raise ValueError(f"{what} {values} has {len(values)} entries; this {ndim}-dim level takes {ndim}")
    return values


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
        self._shape = tuple(
            SizeOf(self, d) if s is None else _size(s, f"Tensor: shape[{d}]") for d, s in enumerate(shape)
        )
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
            accepted = f"{-ndim}..{ndim - 1}" if ndim else "0"
            raise DimensionError(
                f"{what}={dim} is out of range for a {ndim}-dim level (shape {self.shape}); accepted: {accepted}"
            )
        return dim % ndim if ndim else 0

    # ----------------------------------------------------------------- meta-operations
    def tile(self, tile_shape, strides=None, dilation=None, floor_mode=False):
        """Cut this level into tiles: returns the grid of tiles, whose ``dtype`` is one tile.

        ``-1`` in ``tile_shape`` takes the whole dimension; ``strides`` (default: the tile size,
        ``-1`` also means the tile size) smaller than a tile give overlapping windows;
        ``dilation`` spaces the elements inside a tile. The number of tiles rounds up (tiles may
        overhang and are masked) unless ``floor_mode``; a window longer than its dimension gives one
        tile (none in ``floor_mode``).
        """
        tile_shape = _entries(tile_shape, "tile: tile_shape", self.ndim)
        strides = _entries(strides, "tile: strides", self.ndim) if strides is not None else (-1,) * self.ndim
        dilation = _entries(dilation, "tile: dilation", self.ndim) if dilation is not None else (1,) * self.ndim
        outer, inner, steps, spacings = [], [], [], []
        for dim, (size, t, s, d) in enumerate(zip(self._shape, tile_shape, strides, dilation)):
            t, s, d = (_size(v, f"tile: {n}[{dim}]") for v, n in ((t, "tile_shape"), (s, "strides"), (d, "dilation")))
            for name, v, minus_one in (("tile_shape", t, " or -1 for the whole dimension"),
                                       ("strides", s, " or -1 for the tile size"), ("dilation", d, None)):
                c = const_value(v)
                if c is not None and c <= 0 and not (minus_one and c == -1):
                    raise ValueError(f"tile: {name}[{dim}] must be a positive size{minus_one or ''}, got {c}")
            t = size if const_value(t) == -1 else t
            s = t if const_value(s) == -1 else s
            if t == size and s == t:
                n = Const(1)
            elif const_value(d) == 1 and s == t:
                n = size // t if floor_mode else (size + t - 1) // t
            else:
                # A window longer than the dimension (span < 0) gives one overhanging tile, or none in
                # floor mode. The dividends stay non-negative: Triton's `//` truncates, Python's floors.
                span = size - d * (t - 1) - 1
                n = maximum(span + s, 0) // s if floor_mode else (maximum(span, 0) + s - 1) // s + 1
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
        shape = _entries(shape, "expand: shape", self.ndim)
        shape = tuple(_size(s, f"expand: shape[{d}]") for d, s in enumerate(shape))
        for d, s in enumerate(shape):
            if const_value(s) is not None and const_value(s) < -1:
                raise ValueError(f"expand: shape[{d}] must be a size >= 0, or -1 to keep the dimension; got {s}")
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
            if not isinstance(end_dim, int) or isinstance(end_dim, bool):
                raise TypeError(f"flatten: end_dim must be an int or None, got {type(end_dim).__name__} {end_dim!r}")
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
        pairs = isinstance(pad, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pad)
        if not pairs or len(pad) != self.ndim:
            raise ValueError(f"pad: need one (before, after) pair per dimension ({self.ndim}), got {pad!r}")
        pad = tuple(tuple(_size(v, f"pad: pad[{d}][{i}]") for i, v in enumerate(p)) for d, p in enumerate(pad))
        return self._derive(
            [s + a + b for s, (a, b) in zip(self._shape, pad)],
            lambda idx: tuple(i - a for i, (a, _) in zip(idx, pad)),
        )

    def __getitem__(self, key):
        """Index this level with ints, slices (any step), ``None`` and ``...``; constant slice bounds clamp
        into the dimension as Python's do, a constant int out of a constant size's range raises."""
        key = key if isinstance(key, tuple) else (key,)
        if sum(k is Ellipsis for k in key) > 1:
            raise DimensionError("only one Ellipsis is allowed in an index")
        effective = sum(k is not None and k is not Ellipsis for k in key)
        if effective > self.ndim:
            raise DimensionError(
                f"too many indices ({effective}) for a {self.ndim}-dim level; accepted: at most {self.ndim}"
            )
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
                size, c = const_value(out._shape[dim]), const_value(k)
                if size is not None and c is not None and not -size <= c < size:
                    raise DimensionError(
                        f"index {c} is out of range for dimension {dim} of size {size}; accepted: {-size}..{size - 1}"
                    )
                stop = None if const_value(k) == -1 else k + 1
                out = out._slice(dim, k, stop, 1, clamp=False)
                out = out._derive([s for d, s in enumerate(out._shape) if d != dim], _drop_dim(dim, out.ndim))
            else:
                raise TypeError(f"index entries must be int, slice, None or ..., got {type(k).__name__}")
        return out

    def _slice(self, dim, start, stop, step, clamp=True):
        """``[start:stop:step]`` of dimension ``dim``; constant bounds clamp into the dimension as Python's
        do (``clamp`` False: an int index, whose one element is masked where it is out of range)."""
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
            def norm(v, lo, hi):
                c = const_value(v)
                if c is None:
                    return as_expr(v)  # a symbolic bound is taken as it is
                if not clamp:
                    return size + c if c < 0 else as_expr(v)
                return maximum(size + c, lo) if c < 0 else minimum(c, hi)

            if step > 0:
                begin = Const(0) if start is None else norm(start, 0, size)
                end = size if stop is None else norm(stop, 0, size)
                n = maximum((end - begin + step - 1) // step, 0)
            else:
                begin = size - 1 if start is None else norm(start, -1, size - 1)
                end = Const(-1) if stop is None else norm(stop, -1, size - 1)
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
