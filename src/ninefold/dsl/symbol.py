"""Named symbols: sizes, block sizes and other compile-time or run-time parameters."""

from __future__ import annotations

from ninefold.dsl.expr import Leaf

META_LOWER_BOUND = 32
META_UPPER_BOUND = 1024


class Symbol(Leaf):
    """A named integer parameter of a kernel.

    ``constexpr`` symbols are compile-time constants; ``meta`` symbols (always constexpr) are
    chosen by the tuner unless the caller passes them; other symbols are run-time arguments.
    Every non-meta symbol that appears in an arrangement is a keyword argument of the kernel call.
    A symbol made without a name (``block_size()``) is named when its kernel is made, after the
    arrangement parameter that defaults to it or else by its order of appearance; ``self`` and
    ``backend`` are taken by the kernel call.

    A value passed at the call must be an int (not a bool); a non-meta symbol's value must lie within
    ``lower_bound``..``upper_bound`` and be at least 1 where the arrangement uses it as a tile size or
    a stride. A meta symbol's bounds are only the tuner's range; a value passed for it must be positive
    and, with ``power_of_two`` (the default for meta symbols), a power of two.
    """

    __slots__ = ("name", "constexpr", "meta", "lower_bound", "upper_bound", "power_of_two")

    def __init__(
        self,
        name,
        constexpr=False,
        meta=False,
        lower_bound=None,
        upper_bound=None,
        power_of_two=None,
    ):
        if name is not None and (not isinstance(name, str) or not name.isidentifier()):
            raise ValueError(f"Symbol name must be a Python identifier, got {name!r}")
        if meta and constexpr is False and constexpr is not None and constexpr != 0:
            raise ValueError("a meta symbol is always constexpr; got constexpr=False")
        self.name = name
        self.meta = bool(meta)
        self.constexpr = bool(constexpr) or self.meta
        if meta:
            lower_bound = META_LOWER_BOUND if lower_bound is None else lower_bound
            upper_bound = META_UPPER_BOUND if upper_bound is None else upper_bound
            power_of_two = True if power_of_two is None else power_of_two
        if lower_bound is not None and upper_bound is not None and lower_bound > upper_bound:
            raise ValueError(
                f"Symbol {name!r}: lower_bound={lower_bound} is greater than upper_bound={upper_bound}"
            )
        self.lower_bound = lower_bound
        self.upper_bound = upper_bound
        self.power_of_two = bool(power_of_two)

    def __eq__(self, other):
        if self.name is None or not isinstance(other, Symbol):
            return other is self
        return other.name == self.name

    def __hash__(self):
        return hash(("symbol", self.name)) if self.name is not None else id(self)

    def display_name(self):
        return self.name if self.name is not None else f"block_size_{id(self) % 10000}"

    def candidates(self) -> list[int]:
        """Values the tuner may try: powers of two within the bounds for meta symbols."""
        lo = self.lower_bound or 1
        hi = self.upper_bound or max(lo, META_UPPER_BOUND)
        values, v = [], 1
        while v <= hi:
            if v >= lo:
                values.append(v)
            v *= 2
        return values or [lo]


def block_size(lower_bound=None, upper_bound=None) -> Symbol:
    """A meta symbol for a tile size; the tuner picks a power of two within the bounds."""
    return Symbol(None, meta=True, lower_bound=lower_bound, upper_bound=upper_bound)
