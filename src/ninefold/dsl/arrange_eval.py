"""``Tensor.eval``: the source index of every element of an arranged tensor, with numpy."""

from __future__ import annotations

import numpy as np

from ninefold.dsl.expr import Index, SizeOf, conjunction, evaluate
from ninefold.dsl.symbol import Symbol
from ninefold.dsl.tensor import Tensor, level_index_vars, resolve

NUMPY_OPS = {"min": np.minimum, "max": np.maximum}


def bind_leaves(leaves, subs) -> dict:
    """Numbers for size leaves and symbols, from ``subs`` (see ``Tensor.eval``)."""
    subs = subs or {}
    env = {}
    for leaf in leaves:
        if isinstance(leaf, SizeOf):
            spec = next((v for k, v in subs.items() if k is leaf.tensor), None)
            if spec is None:
                raise ValueError(f"eval: no size for {leaf.display_name()}; pass subs={{tensor: {{'shape': ...}}}}")
            shape = spec.shape if isinstance(spec, Tensor) else spec["shape"]
            env[leaf] = int(shape[leaf.dim])
        elif isinstance(leaf, Symbol):
            matches = [v for k, v in subs.items() if isinstance(k, Symbol) and k == leaf]
            if not matches:
                raise ValueError(f"eval: no value for symbol {leaf.display_name()}; pass it in subs")
            env[leaf] = int(matches[0])
    return env


def eval_index_map(tensor: Tensor, subs=None) -> np.ndarray:
    """See ``Tensor.eval``."""
    if tensor.source.ndim == 0:
        return np.array(0, dtype=np.intp)
    variables = level_index_vars(tensor)
    source_index, conditions, requires = resolve(tensor, variables)
    levels = tensor.levels()
    exprs = [*source_index, *conditions, *tensor.source._shape]
    exprs += [s for level in levels for s in level._shape] + [size for size, _ in requires]
    leaves = set()
    for e in exprs:
        leaves |= getattr(e, "leaves", lambda: set())()
    env = bind_leaves({leaf for leaf in leaves if not isinstance(leaf, Index)}, subs)
    for size, message in requires:
        if evaluate(size, env) != 1:
            raise ValueError(f"{message}; it is {evaluate(size, env)}")
    full_shape = [int(evaluate(s, env)) for level in levels for s in level._shape]
    position = 0
    for level_vars in variables:
        for var in level_vars:
            shape = [1] * len(full_shape)
            shape[position] = full_shape[position]
            env[var] = np.arange(full_shape[position], dtype=np.intp).reshape(shape)
            position += 1
    source_shape = [int(evaluate(s, env)) for s in tensor.source._shape]
    flat = np.zeros([1] * len(full_shape), dtype=np.intp)
    stride = 1
    for dim in reversed(range(len(source_shape))):
        flat = flat + np.asarray(evaluate(source_index[dim], env, NUMPY_OPS)) * stride
        stride *= source_shape[dim]
    mask = np.asarray(evaluate(conjunction(conditions), env, NUMPY_OPS), dtype=bool)
    return np.broadcast_to(np.where(mask, flat, -1), full_shape).copy()
