"""ninefold.dsl: a tile DSL (arrangement + application) compiled to Triton and run natively on CPUs.

A kernel is two functions. The *arrangement* cuts each symbolic :class:`Tensor` into a hierarchy
of tiles (``tile``, ``expand``, ``squeeze``, ``unsqueeze``, ``permute``, ``flatten``, ``ravel``,
``pad``, indexing; ``t.dtype`` is the next level and may be reassigned); the outermost level of
every arranged tensor is the grid of programs. The *application* is serial code for one program:
reading a parameter loads its tile (``other`` where the tile overhangs), assigning stores it,
``x[k]`` indexes a middle level, ``p += v`` loads, adds and stores. ``make`` (or ``@jit``) binds
them into a kernel called with torch tensors::

    BLOCK = block_size()
    def arrangement(x, y, z, BLOCK=BLOCK):
        return x.tile((BLOCK,)), y.tile((BLOCK,)), z.tile((BLOCK,))
    def application(x, y, z):
        z = x + y
    add = make(arrangement, application, (Tensor(1), Tensor(1), Tensor(1)))
    add(a, b, c)               # meta symbols (BLOCK) tuned, or add(a, b, c, BLOCK=256)

Backends follow the tensors' device (``backend=`` or ``NINEFOLD_DSL_BACKEND`` override):
``triton`` (generated source: ``add.source``; tuned, cached under ``NINEFOLD_CACHE_DIR``),
``cpu`` (all programs at once as batched torch ops) and ``interpret`` (the generated code under
Triton's interpreter). ``Tensor.eval`` shows an arrangement as source indices; ``aot.compile``
writes cubins that ``aot.load`` launches without Triton. The kernel language is
``ninefold.dsl.language``; kernels written for NineToothed run with its imports replaced.
"""

from ninefold.dsl.language import bfloat16, float16, float32, float64, int8, int16, int32, int64, uint8
from ninefold.dsl.make import jit, make
from ninefold.dsl.symbol import Symbol, block_size
from ninefold.dsl.tensor import Tensor


def eval(tensor, subs=None):  # noqa: A001  (NineToothed's name)
    """``tensor.eval(subs)``: the source index of every element of an arranged tensor."""
    return tensor.eval(subs)


__all__ = [
    "Symbol",
    "Tensor",
    "bfloat16",
    "block_size",
    "eval",
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "jit",
    "make",
    "uint8",
]
