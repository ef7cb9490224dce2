"""ninefold.ops: one call per operator; the fastest supporting implementation runs.

``import ninefold.ops as ops`` then ``ops.rms_norm(x, w, eps)`` on any device. Each operator has
a vendor implementation (torch and the libraries behind it, CPU and CUDA) and, where they beat
it, hand-written Triton kernels (``ninefold.ops.triton``) and ``ninefold.dsl`` kernels.
``ops.use(rms_norm="dsl")`` or ``NINEFOLD_OPS=rms_norm=dsl`` pins one; ``ops.choose(...)`` says
which would run. See ``docs/architecture.md`` for the contract of every operator.
"""

from ninefold.ops import fused_linear, registry, tuning  # noqa: F401  (ops.registry, ops.tuning)
from ninefold.ops.attention import attention_decode, attention_prefill, reshape_and_cache
from ninefold.ops.dispatch import candidates, choose, implementation, operators, reload_environment, run, use
from ninefold.ops.elementwise import add, gelu_and_mul, mul, silu_and_mul
from ninefold.ops.fp8 import Fp8Weight, linear_fp8
from ninefold.ops.fused_linear import add_rms_norm_linear, silu_and_mul_linear
from ninefold.ops.linear import embedding, linear
from ninefold.ops.norm import add_rms_norm, rms_norm, softmax
from ninefold.ops.quantized import BlockWeight, Int4Weight, linear_blocks, linear_int4
from ninefold.ops.registry import Impl, register
from ninefold.ops.rope import rope
from ninefold.ops.rope_cache import rope_and_cache
from ninefold.ops.rope_cache_attention import rope_cache_attention_decode
from ninefold.ops.sampling import argmax, sample
from ninefold.ops.spec import OpError, UnsupportedError
from ninefold.ops.torch_library import register_torch_library


def _load_triton() -> None:
    """Register the Triton kernels where they can run (CUDA, or Triton's CPU interpreter)."""
    import os

    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        try:
            import ninefold.ops.triton  # noqa: F401
        except ImportError:  # no Triton on this machine: vendor implementations only
            pass


_load_triton()
from ninefold.ops.cublaslt import register_cuda as _register_cublaslt  # noqa: E402

_register_cublaslt()  # linear with a measured cuBLASLt algorithm per decode shape
from ninefold.ops.cutlass import register_cuda as _register_cutlass  # noqa: E402

_register_cutlass()  # linear with a measured CUTLASS configuration per decode shape (when its library is built)
import ninefold.ops.cpu_native.attention  # noqa: E402,F401  (native CPU attention_prefill)
import ninefold.ops.cpu_native.rows  # noqa: E402,F401  (native CPU add_rms_norm, silu_and_mul, rope)
import ninefold.ops.dsl_impls  # noqa: E402,F401  (registers the DSL kernels; they import on first use)
import ninefold.ops.norm_row  # noqa: E402,F401  (one-row CPU rms_norm / add_rms_norm)

__all__ = [
    "add", "add_rms_norm", "add_rms_norm_linear", "argmax", "attention_decode", "attention_prefill", "embedding", "gelu_and_mul",
    "linear", "linear_blocks", "linear_fp8", "linear_int4", "mul", "reshape_and_cache", "rms_norm", "rope", "rope_and_cache", "rope_cache_attention_decode", "sample", "silu_and_mul", "silu_and_mul_linear", "softmax",
    "BlockWeight", "Fp8Weight", "Impl", "Int4Weight", "OpError", "UnsupportedError", "candidates", "choose", "implementation", "operators", "register",
    "register_torch_library", "reload_environment", "run", "use",
]
