"""What one access to an arranged parameter touches, symbolically.

A parameter ``x`` arranged as levels ``[L0, L1, ..., Ln]`` is read in the application as ``x``
(level 1 is the tile) or ``x[i]`` (``i`` indexes level 1, level 2 is the tile, or nothing when
there is no level 2: one element per program). Level 0 is indexed by the program.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ninefold.dsl.expr import Expr, Index, Leaf
from ninefold.dsl.tensor import Tensor, resolve


class Middle(Leaf):
    """Placeholder for the ``j``-th index the application gives to a middle level."""

    __slots__ = ("position",)

    def __init__(self, position):
        self.position = position

    def __eq__(self, other):
        return type(other) is Middle and other.position == self.position

    def __hash__(self):
        return hash(("middle", self.position))

    def display_name(self):
        return f"middle_{self.position}"


@dataclass(frozen=True)
class Access:
    """One access pattern: its index variables, the source index per source dim, the mask terms."""

    top: Tensor
    grid_vars: tuple[Index, ...]
    middle_vars: tuple[Middle, ...]
    middle_level: Tensor | None
    tile_level: Tensor | None
    tile_vars: tuple[Index, ...]
    source_index: tuple[Expr, ...]
    conditions: tuple[Expr, ...]
    requires: tuple

    @property
    def tile_shape(self) -> tuple[Expr, ...]:
        return self.tile_level._shape if self.tile_level is not None else ()


@lru_cache(maxsize=4096)
def analyze(top: Tensor, num_indices: int, name: str = "tensor") -> Access:
    """The access ``name`` (read as ``name[...]`` with ``num_indices`` indices, or plain when 0)."""
    levels = top.levels()
    grid_vars = tuple(Index(levels[0], d) for d in range(levels[0].ndim))
    middle_level = None
    middle_vars: tuple = ()
    rest = levels[1:]
    if num_indices:
        if not rest:
            raise IndexError(f"{name} has a single level (one element per program); it cannot be indexed")
        middle_level, rest = rest[0], rest[1:]
        if num_indices != middle_level.ndim:
            raise IndexError(
                f"{name}[...] takes {middle_level.ndim} index(es) for its level of shape {middle_level.shape}, got {num_indices}"
            )
        middle_vars = tuple(Middle(j) for j in range(num_indices))
    if len(rest) > 1:
        shapes = " -> ".join(str(level.shape) for level in rest)
        raise IndexError(f"{name} has middle levels ({shapes}); index them, as in {name}[k]")
    tile_level = rest[0] if rest else None
    tile_vars = tuple(Index(tile_level, d) for d in range(tile_level.ndim)) if tile_level is not None else ()
    indices = [grid_vars] + ([middle_vars] if middle_level is not None else []) + ([tile_vars] if tile_level is not None else [])
    source_index, conditions, requires = resolve(top, indices)
    return Access(
        top, grid_vars, middle_vars, middle_level, tile_level, tile_vars, tuple(source_index), tuple(conditions), tuple(requires)
    )
