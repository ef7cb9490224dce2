"""Ahead-of-time compilation of the Triton kernels for a target (e.g. ``cuda:90``) on any machine.

``variants(op, dtype, shapes)`` lists the kernel specialisations an operator launches at a
model's shapes (the same block sizes the launchers pick); ``compile_variant`` compiles one with
``triton.compile`` for a ``GPUTarget`` and returns its binary, so a CPU-only machine can check
that every kernel builds for the H200 and ``ninefold ops build`` can ship the binaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ninefold.ops.triton import activation, cache, decode, gemv, norm, prefill, rope, softmax

_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Pointer arguments whose element type does not follow the activations' dtype.
_FIXED_POINTERS = {"pos_ptr": "*i64", "slot_ptr": "*i64", "bt_ptr": "*i32", "lens_ptr": "*i32", "cu_q_ptr": "*i32",
                   "cu_k_ptr": "*i32", "tile_starts_ptr": "*i32", "cache_ptr": "*fp32", "part_ptr": "*fp32",
                   "lse_ptr": "*fp32"}
_FLOATS = {"eps", "scale_log2e"}


@dataclass(frozen=True)
class Variant:
    """One specialisation of one kernel: its constexpr values and launch options."""

    op: str
    kernel: object
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 2

    @property
    def name(self) -> str:
        values = "-".join(f"{k}{v}" for k, v in sorted(self.constexprs.items()))
        return f"{self.kernel.fn.__name__}-{values}"


def parse_target(text: str) -> GPUTarget:
    """``"cuda:90"`` -> ``GPUTarget("cuda", 90, 32)`` (``ValueError`` naming the accepted forms)."""
    backend, _, arch = text.partition(":")
    if backend not in ("cuda", "hip") or not arch:
        raise ValueError(f"--target: expected cuda:<sm> (e.g. cuda:90) or hip:<gfx>, got {text!r}")
    return GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)


def signature(kernel, dtype: torch.dtype, constexprs: dict) -> dict:
    """Triton signature of ``kernel`` with activations of ``dtype``."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = _FIXED_POINTERS.get(name, "*" + _TYPE[dtype])
        else:
            sig[name] = "fp32" if name in _FLOATS else "i32"
    return sig


def compile_variant(variant: Variant, dtype: torch.dtype, target: GPUTarget):
    """Compile one variant for ``target``; returns Triton's compiled kernel (``.asm`` holds the binary)."""
    source = ASTSource(variant.kernel, signature(variant.kernel, dtype, variant.constexprs), variant.constexprs)
    return triton.compile(source, target=target, options={"num_warps": variant.num_warps,
                                                          "num_stages": variant.num_stages})


# Operators whose kernel module lists the variants its launcher runs (``aot_variants``).
_LISTED = {"rms_norm": norm, "add_rms_norm": norm, "silu_and_mul": activation, "gelu_and_mul": activation,
           "softmax": softmax, "rope": rope, "attention_decode": decode, "attention_prefill": prefill,
           "linear": gemv}


def variants(op: str, dtype: torch.dtype, shapes) -> list[Variant]:
    """The specialisations ``op`` launches at ``shapes`` (a ``ninefold.ops.workloads.Shapes``)."""
    p2 = triton.next_power_of_2
    if op in _LISTED:
        return [Variant(op, **v) for v in _LISTED[op].aot_variants(op, dtype, shapes)]
    if op == "reshape_and_cache":
        return [Variant(op, cache.reshape_and_cache_kernel, {"BLOCK_H": p2(shapes.kv_heads), "BLOCK_D": p2(shapes.head_dim)})]
    return []
