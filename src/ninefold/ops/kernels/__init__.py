"""Kernels written in the ninefold tile DSL, one module per operator family.

Each module holds the arrangement and application functions, the kernel objects built from them
with ``ninefold.dsl.make`` and a plain Python function that checks its inputs, allocates the
output and launches the kernel (for example ``rms_norm.rms_norm(x, weight, eps)``). The modules
import only ``ninefold.dsl``, ``ninefold.dsl.language`` and each other, so their source also runs
under NineToothed with those two imports renamed (the benchmark relies on that).
"""

FAMILIES = ("add", "activation", "mm", "conv2d", "softmax", "rms_norm", "rope", "attention", "pool")
