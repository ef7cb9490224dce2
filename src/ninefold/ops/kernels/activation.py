"""SiLU and SwiGLU (``silu(gate) * up``), computed in float32.

Contiguous SiLU inputs run as flat vectors in ``BLOCK`` chunks; strided ones and SwiGLU (whose halves
are strided views) on ``[rows, cols]`` views in ``BLOCK_M x BLOCK_N`` tiles.
"""

import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor
from ninefold.ops.kernels._checks import check_tensor, rows

BLOCK = Symbol("BLOCK", meta=True, lower_bound=1024, upper_bound=8192)
BLOCK_M = Symbol("BLOCK_M", meta=True, lower_bound=1, upper_bound=16)
BLOCK_N = Symbol("BLOCK_N", meta=True, lower_bound=64, upper_bound=1024)


def arrangement_silu_flat(x, y, BLOCK=BLOCK):
    return x.tile((BLOCK,)), y.tile((BLOCK,))


def arrangement_silu(x, y, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N):
    return x.tile((BLOCK_M, BLOCK_N)), y.tile((BLOCK_M, BLOCK_N))


def application_silu(x, y):
    v = x
    v = v.to(nl.float32)
    y = v * nl.sigmoid(v)  # noqa: F841


def arrangement_swiglu(gate, up, out, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N):
    tile = (BLOCK_M, BLOCK_N)
    return gate.tile(tile), up.tile(tile), out.tile(tile)


def application_swiglu(gate, up, out):
    g = gate
    g = g.to(nl.float32)
    out = g * nl.sigmoid(g) * up  # noqa: F841


silu_flat_kernel = nd.make(arrangement_silu_flat, application_silu, (Tensor(1), Tensor(1)))
silu_kernel = nd.make(arrangement_silu, application_silu, (Tensor(2), Tensor(2)))
swiglu_kernel = nd.make(arrangement_swiglu, application_swiglu, tuple(Tensor(2) for _ in range(3)))


def silu(x, **blocks):
    """Return ``x * sigmoid(x)`` in x's dtype (any shape, any strides)."""
    check_tensor("x", x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.is_contiguous() and "BLOCK_M" not in blocks:  # flat vectors stream best on GPUs
        silu_flat_kernel(x.view(-1), y.view(-1), **blocks)
    else:
        silu_kernel(rows(x), rows(y), **blocks)
    return y


def silu_and_mul(x, **blocks):
    """SwiGLU: ``x [..., 2d] -> silu(x[..., :d]) * x[..., d:]`` (the halves are strided views)."""
    check_tensor("x", x)
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: the last dimension must be even, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    swiglu_kernel(rows(x[..., :d]), rows(x[..., d:]), rows(out), **blocks)
    return out


def swiglu(gate, up, **blocks):
    """Return ``silu(gate) * up`` for two tensors of one shape."""
    check_tensor("gate", gate)
    check_tensor("up", up)
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"up: expected shape {tuple(gate.shape)}, {gate.dtype} on {gate.device} like gate, "
            f"got {tuple(up.shape)}, {up.dtype} on {up.device}"
        )
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    swiglu_kernel(rows(gate), rows(up), rows(out), **blocks)
    return out
