"""ninefold.dsl: a tile DSL (arrangement + application) compiled to Triton and run natively on CPUs."""

from ninefold.dsl.language import bfloat16, float16, float32, float64, int8, int16, int32, int64, uint8
from ninefold.dsl.make import jit, make
from ninefold.dsl.symbol import Symbol, block_size
from ninefold.dsl.tensor import Tensor

__all__ = [
    "Symbol",
    "Tensor",
    "bfloat16",
    "block_size",
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
