"""Shared pieces of the operator contracts: errors, argument checks and shape buckets.

Every public operator validates its arguments with these helpers before dispatch, so a bad
call raises ``TypeError``/``ValueError`` naming the argument, what was given and what is
accepted, whichever implementation would have run.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
# The order in which error messages list dtypes.
_DTYPE_ORDER = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64)


class OpError(ValueError):
    """A bad argument to an operator (wrong shape, value or device)."""


class UnsupportedError(OpError):
    """No implementation of the operator supports the given inputs on their device."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_names(dtypes) -> str:
    """Comma-separated dtype names in a stable order (half precision first)."""
    rank = {d: i for i, d in enumerate(_DTYPE_ORDER)}
    return ", ".join(dtype_name(d) for d in sorted(set(dtypes), key=lambda d: rank.get(d, 99)))


def tensor(op: str, name: str, value, ndim: int | None = None, min_ndim: int = 0) -> torch.Tensor:
    """Check that ``value`` is a tensor (of ``ndim`` or at least ``min_ndim`` dimensions)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise OpError(f"{op}: {name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if value.dim() < min_ndim:
        raise OpError(f"{op}: {name} must have at least {min_ndim} dimensions, got shape {tuple(value.shape)}")
    return value


def floating(op: str, name: str, value: torch.Tensor) -> None:
    """Check that ``value`` holds floating-point numbers."""
    if not value.dtype.is_floating_point:
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {dtype_name(value.dtype)}")


def integer(op: str, name: str, value: torch.Tensor, dtypes=INDEX_DTYPES) -> None:
    """Check that ``value`` is an index tensor (int32 or int64 unless ``dtypes`` says otherwise)."""
    if value.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be {' or '.join(dtype_name(d) for d in dtypes)}, "
                        f"got {dtype_name(value.dtype)}")


def same_device(op: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    """Check that every tensor in ``others`` lives on ``ref``'s device."""
    for name, value in others.items():
        if value is not None and value.device != ref.device:
            raise OpError(f"{op}: {name} is on {value.device} but {ref_name} is on {ref.device}; "
                          "move them to one device")


def same_dtype(op: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    """Check that every tensor in ``others`` has ``ref``'s dtype."""
    for name, value in others.items():
        if value is not None and value.dtype != ref.dtype:
            raise TypeError(f"{op}: {name} is {dtype_name(value.dtype)} but {ref_name} is "
                            f"{dtype_name(ref.dtype)}; they must match")


def shape(op: str, name: str, value: torch.Tensor, expected: tuple, what: str = "") -> None:
    """Check ``value.shape == expected`` (``None`` entries match any size)."""
    got = tuple(value.shape)
    if len(got) != len(expected) or any(e is not None and e != g for e, g in zip(expected, got)):
        want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + (",)" if len(expected) == 1 else ")")
        raise OpError(f"{op}: {name} must have shape {want}{what}, got {got}")


def positive_float(op: str, name: str, value) -> float:
    """Check a positive Python number (eps, scale)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
    if not value > 0:
        raise OpError(f"{op}: {name} must be > 0, got {value}")
    return float(value)


def pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): the shape bucket of a token count."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
