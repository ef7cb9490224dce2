"""Hand-written Triton implementations, registered as "triton" for CUDA devices.

With ``TRITON_INTERPRET=1`` they also register for the CPU in float32 (Triton's interpreter
runs them there), which is how the CPU test suite exercises them at tiny sizes.
"""

from __future__ import annotations

import os

import torch

from ninefold.ops.registry import register
from ninefold.ops.spec import FLOAT_DTYPES
from ninefold.ops.triton import (
    activation,
    argmax,
    cache,
    decode,
    fp8_gemv,
    gemm,
    gemv,
    gemv_pdl_ops,
    norm,
    prefill,
    rope,
    rope_cache,
    sample,
    softmax,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ("cuda", "cpu") if INTERPRETED else ("cuda",)
DTYPES = (torch.float32,) if INTERPRETED else FLOAT_DTYPES
PRIORITY = {"cuda": 10, "cpu": -10}

# (operator, function, supports)
KERNELS = [
    ("rms_norm", norm.rms_norm, norm.supports),
    ("add_rms_norm", norm.add_rms_norm, norm.supports),
    ("silu_and_mul", activation.silu_and_mul, activation.supports),
    ("gelu_and_mul", activation.gelu_and_mul, activation.supports),
    ("softmax", softmax.softmax, softmax.supports),
    ("rope", rope.rope, rope.supports),
    ("reshape_and_cache", cache.reshape_and_cache, cache.supports),
    ("rope_and_cache", rope_cache.rope_and_cache, rope_cache.supports),
    ("attention_decode", decode.attention_decode, decode.supports),
    ("rope_cache_attention_decode", decode.rope_cache_attention_decode, decode.rope_cache_supports),
    ("attention_prefill", prefill.attention_prefill, prefill.supports),
    ("argmax", argmax.argmax, argmax.supports),
    ("sample", sample.sample, sample.supports),
]

for _op, _fn, _supports in KERNELS:
    register(_op, "triton", devices=DEVICES, dtypes=DTYPES, supports=_supports, priority=PRIORITY)(_fn)
# Below cuBLAS by default (see gemv's docstring): chosen only where tuning measured it faster.
register("linear", "triton", devices=DEVICES, dtypes=DTYPES, supports=gemv.supports,
         priority={"cuda": -5, "cpu": -10})(gemv.linear)
# Below cuBLAS (see gemm's docstring: in the engine it did not beat cuBLAS): runs where pinned
# (NINEFOLD_OPS=linear=triton_gemm) or a tuning table picks it, with its own per-shape configuration.
register("linear", "triton_gemm", devices=DEVICES, dtypes=DTYPES, supports=gemm.supports,
         priority={"cuda": -5, "cpu": -10})(gemm.linear)
gemv_pdl_ops.register_all()  # the one-row GEMV behind linear (triton_row), the *_linear fused operators, linear_fp8
# Weight-only FP8 decode steps of 1..16 rows, above scaled_mm (10) and below the one-row PDL GEMV (30).
register("linear_fp8", "triton_gemv", devices=("cuda",), dtypes=(torch.bfloat16, torch.float16),
         supports=fp8_gemv.supports, priority={"cuda": 20})(fp8_gemv.linear_fp8)
