"""Input checks and 2-D views shared by the kernel launchers (plain torch, no DSL)."""

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name, t, ndim=None, dtypes=FLOAT_DTYPES):
    """Raise TypeError/ValueError naming ``name`` unless ``t`` is a tensor of an accepted kind."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        accepted = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; accepted: {accepted}")
    if ndim is not None and t.ndim not in ((ndim,) if isinstance(ndim, int) else ndim):
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")


def check_same(names, tensors):
    """Raise ValueError unless all tensors share one dtype and one device."""
    first = tensors[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t.device != first.device:
            raise ValueError(f"{name}: on {t.device}, but {names[0]} is on {first.device}")
        if t.dtype != first.dtype:
            raise TypeError(f"{name}: dtype {t.dtype}, but {names[0]} has {first.dtype}")


def rows(t):
    """``t`` as a 2-D ``[rows, last dim]`` view, copying only when the leading dims cannot merge."""
    if t.ndim == 0:
        return t.reshape(1, 1)
    if t.ndim == 1:
        return t.unsqueeze(0)
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])
