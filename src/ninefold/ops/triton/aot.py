"""Ahead-of-time compilation of the Triton kernels for a target (e.g. ``cuda:90``) on any machine.

``launches(op, dtype, shapes)`` runs the operator's Triton implementation on ``meta`` tensors at a
model's shapes with the launchers recording instead of launching: the exact kernels, constexprs,
launch options and argument specialisations (dtypes, 16-byte alignment, integers equal to 1 or
divisible by 16) the JIT would compile on the GPU. ``compile_spec`` compiles one such
specialisation with ``triton.compile`` for a ``GPUTarget`` (what ``ninefold ops build`` ships, see
``ninefold.ops.triton.prebuilt``). ``variants``/``compile_variant`` compile the modules' declared
variants (``aot_variants``) with every pointer assumed 16-byte aligned, so a CPU-only machine can
check that every kernel builds for the H200.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ninefold.ops.spec import dtype_name
from ninefold.ops.triton import activation, argmax, cache, decode, gemv, norm, prefill, rope, sample, softmax

_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Pointer arguments whose element type does not follow the activations' dtype.
_FIXED_POINTERS = {"pos_ptr": "*i64", "slot_ptr": "*i64", "bt_ptr": "*i32", "lens_ptr": "*i32", "cu_q_ptr": "*i32",
                   "cu_k_ptr": "*i32", "tile_starts_ptr": "*i32", "cache_ptr": "*fp32", "cs_ptr": "*fp32", "part_ptr": "*fp32",
                   "lse_ptr": "*fp32", "index_ptr": "*i64", "val_ptr": "*fp32", "idx_ptr": "*i32", "count_ptr": "*i32",
                   "temp_ptr": "*fp32", "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "seed_ptr": "*i64",
                   "token_ptr": "*i64", "top_k_ptr": "*i32", "state_ptr": "*i32", "hist_ptr": "*i32", "kth_ptr": "*fp32"}
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
    if backend not in ("cuda", "hip") or not arch or (backend == "cuda" and not arch.isdigit()):
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
    """Compile one variant for ``target`` with 16-byte aligned pointers (as the JIT specialises fresh
    tensors); returns Triton's compiled kernel (``.asm`` holds the binary)."""
    sig = signature(variant.kernel, dtype, variant.constexprs)
    spec = [("constexpr", variant.constexprs[n]) if t == "constexpr" else (t, "D" if t.startswith("*") else "")
            for n, t in sig.items()]
    return compile_spec(variant.kernel, spec, variant.num_warps, variant.num_stages, target)


def compile_spec(kernel, spec, num_warps: int, num_stages: int, target: GPUTarget):
    """Compile ``kernel`` for one specialisation (``(type, attr)`` per parameter, as
    ``prebuilt.specialisation`` gives) exactly as Triton's JIT would on a GPU of ``target``."""
    names = kernel.arg_names
    sig = {name: kind for name, (kind, _) in zip(names, spec)}
    constexprs = {(i,): value for i, (kind, value) in enumerate(spec) if kind == "constexpr"}
    attrs = {(i,): ([["tt.divisibility", 16]] if attr == "D" else []) for i, (kind, attr) in enumerate(spec)
             if kind != "constexpr" and isinstance(attr, str)}
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=target,
                          options={"num_warps": num_warps, "num_stages": num_stages})


# SMs of the target GPU (the attention launchers size their splits by it): H100/H200 SXM.
TARGET_SMS = {"cuda:90": 132, "cuda:80": 108, "cuda:89": 128, "cuda:100": 148}


@contextlib.contextmanager
def sized_as(sms: int):
    """Within it, decode attention sizes its splits as on a GPU with ``sms`` SMs (the target's, not the recording
    device's: meta tensors have none)."""
    real = decode._sm_count
    decode._sm_count = lambda device: sms
    try:
        yield
    finally:
        decode._sm_count = real


TRITON_IMPLS = ("triton", "triton_gemm", "triton_row", "triton_pdl", "triton_gemv", "scaled_mm")  # implementations
# that run Triton kernels (a build compiles them; linear_fp8's scaled_mm quantizes x with one before cuBLASLt's FP8
# GEMM); the other CUDA-only ones (cublaslt, cutlass) call vendor libraries


def launches(op: str, dtype: torch.dtype, shapes, sms: int = 132, cache_dtype: torch.dtype | None = None,
             impl_name: str = "triton", pdl: bool = False) -> tuple[list, list[str]]:
    """``(launches, notes)``: the distinct ``(kernel, spec, num_warps, num_stages)`` the Triton
    implementation ``impl_name`` of ``op`` launches for the representative calls at ``shapes``
    (``ninefold.ops.workloads``; KV caches of ``cache_dtype``, default ``dtype``), recorded on ``meta``
    tensors as if on a GPU with ``sms`` SMs, without programmatic dependent launch and, with ``pdl``, with it
    (kernels that use it then take other constexprs); ``notes`` says which calls the implementation does not
    support."""
    from ninefold.ops import dispatch, registry, workloads
    from ninefold.ops.triton import launch, prebuilt

    if impl_name not in TRITON_IMPLS:
        raise ValueError(f"impl_name: {impl_name!r} runs no Triton kernels to build; accepted: {', '.join(TRITON_IMPLS)}")
    impl = next((i for i in registry.all_implementations(op) if i.name == impl_name), None)
    if impl is None:
        return [], [f"{op}: no {impl_name!r} implementation registered here"]
    if op not in workloads.OPS:
        return [], [f"{op}: no representative calls in ninefold.ops.workloads, so nothing is built ahead of time for "
                    f"it; its Triton kernels compile on first use (or are refused: uncovered = \"error\")"]
    found, notes, unrecorded = {}, [], []
    with sized_as(sms):
        for case in workloads.cases(op, shapes, "meta", dtype, cache_dtype=cache_dtype):
            bound = dispatch.operator(op).bind(*case.args, **case.kwargs)
            reason = impl.reason(bound)
            if reason:
                notes.append(f"{op} {case.label}: {reason}")
                continue
            calls = []
            for with_pdl in (False, True) if pdl else (False,):
                with launch.recording(with_pdl) as recorded:
                    impl.fn(*bound)
                calls += recorded
            if not calls:
                unrecorded.append(case.label)
            for kernel, values, warps, stages in calls:
                spec = prebuilt.specialisation(kernel, values)
                found.setdefault((prebuilt.kernel_id(kernel), spec, warps, stages), (kernel, spec, warps, stages))
    if notes:
        over = "" if cache_dtype in (None, dtype) else f" ({dtype_name(cache_dtype)} caches)"
        notes = [f"{op} {dtype_name(dtype)}{over}: {len(notes)} representative calls are outside its "
                 f"{impl_name!r} implementation (nothing built for them), e.g. {notes[0]}"]
    if unrecorded:  # (triton_gemm measures its tile configuration on the device before it launches anything)
        notes.append(f"{op} {dtype_name(dtype)}: its {impl_name!r} implementation launched no kernel for "
                     f"{len(unrecorded)} representative calls away from a GPU (e.g. {unrecorded[0]}): it chooses its "
                     f"kernels on the device, where they compile on first use (or are refused: uncovered = \"error\")")
    return list(found.values()), notes


# Operators whose kernel module lists the variants its launcher runs (``aot_variants``).
_LISTED = {"rms_norm": norm, "add_rms_norm": norm, "silu_and_mul": activation, "gelu_and_mul": activation,
           "softmax": softmax, "rope": rope, "attention_decode": decode, "attention_prefill": prefill,
           "linear": gemv, "argmax": argmax, "sample": sample}


def variants(op: str, dtype: torch.dtype, shapes) -> list[Variant]:
    """The specialisations ``op`` launches at ``shapes`` (a ``ninefold.ops.workloads.Shapes``)."""
    p2 = triton.next_power_of_2
    if op in _LISTED:
        return [Variant(op, **v) for v in _LISTED[op].aot_variants(op, dtype, shapes)]
    if op == "reshape_and_cache":
        return [Variant(op, cache.reshape_and_cache_kernel, {"BLOCK_H": p2(shapes.kv_heads), "BLOCK_D": p2(shapes.head_dim)})]
    return []
