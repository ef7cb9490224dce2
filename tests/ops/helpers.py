"""Shared helpers for the operator tests: devices, per-dtype tolerances, implementation lists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import registry

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
# (atol, rtol) against float64 references, for elementwise/normalisation outputs.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[2]
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))]


def impl_params(op: str) -> list:
    """``(device, impl)`` pairs for every implementation of ``op`` (cuda ones skip without CUDA)."""
    params = []
    for impl in registry.all_implementations(op):
        for device in ("cpu", "cuda"):
            if device in impl.devices:
                marks = [pytest.mark.skipif(not CUDA, reason="needs CUDA")] if device == "cuda" else []
                params.append(pytest.param(device, impl.name, id=f"{device}-{impl.name}", marks=marks))
    return params


def call(op: str, impl: str, *args, **kwargs):
    """Run ``ops.<op>`` pinned to ``impl``, checking that dispatch really picks it."""
    for candidate in ops.registry.all_implementations(op):
        if candidate.name == impl and candidate.reason(ops.dispatch.operator(op).bind(*args, **kwargs)):
            pytest.skip(f"{impl} does not cover this case: {candidate.reason(ops.dispatch.operator(op).bind(*args, **kwargs))}")
    with ops.use(**{op: impl}):
        assert ops.choose(op, *args, **kwargs) == impl
        return getattr(ops, op)(*args, **kwargs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Compare an implementation's output to a float64 reference with ``dtype``'s tolerance."""
    atol, rtol = TOLERANCES[dtype]
    assert actual.dtype == dtype, f"output dtype {actual.dtype}, expected {dtype}"
    torch.testing.assert_close(actual.detach().cpu().double(), expected, atol=atol * scale, rtol=rtol * scale)


def randn(*shape, dtype=torch.float32, device="cpu", strided: bool = False, seed: int = 0,
          scale: float = 1.0) -> torch.Tensor:
    """A random tensor (times ``scale``); ``strided=True`` returns a view with last-dimension stride 2."""
    g = torch.Generator().manual_seed(seed)
    if not strided:
        return (torch.randn(tuple(shape), generator=g) * scale).to(device=device, dtype=dtype)
    wide = (torch.randn((*shape[:-1], shape[-1] * 2), generator=g) * scale).to(device=device, dtype=dtype)
    out = wide[..., ::2]
    assert not out.is_contiguous() or out.numel() <= 1
    return out


def _interpreter_broken() -> str | None:
    """Triton 3.6's interpreter turns scalar kernel arguments into 1-element arrays and calls int() on
    them (``range(K)``), which NumPy >= 2.4 refuses; the GPU machine has that pair."""
    import numpy
    import triton

    major_minor = tuple(int(p) for p in triton.__version__.split(".")[:2])
    numpy_version = tuple(int(p) for p in numpy.__version__.split(".")[:2])
    if major_minor < (3, 7) and numpy_version >= (2, 4):
        return f"Triton {triton.__version__}'s interpreter cannot run with NumPy {numpy.__version__}"
    return None


def run_interpreted(args: list[str], timeout: float | None = 600) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root with TRITON_INTERPRET=1 (set before Triton is
    imported, which a running test process cannot do); asserts that it exits 0. Skips where the
    installed Triton's interpreter cannot run at all (``_interpreter_broken``)."""
    broken = _interpreter_broken()
    if broken:
        pytest.skip(broken)
    run = subprocess.run([sys.executable, *args], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                         text=True, cwd=ROOT, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def run_interpreted_tests(files: list[str], select: str = "", at_least: int = 1,
                          timeout: float | None = 600) -> subprocess.CompletedProcess:
    """The test ``files`` of tests/ops (cases matching ``select``) under Triton's interpreter;
    asserts that at least ``at_least`` of them passed."""
    paths = [str(ROOT / "tests" / "ops" / f) for f in files]
    run = run_interpreted(["-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *paths,
                           *(["-k", select] if select else [])], timeout)
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and int(summary.split(" passed")[0].split()[-1]) >= at_least, summary
    return run


def fresh_choice_cache(forget, tmp_path, monkeypatch):
    """For a fixture (``yield from``): ``$NINEFOLD_CACHE_DIR`` at ``tmp_path``, and a tuner's in-memory choices
    dropped (``forget``) before the test and after it; yields ``tmp_path``."""
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))
    forget()
    yield tmp_path
    forget()


def decode_mlp_operands(rows: int, d: int, f: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """bfloat16 CUDA operands of a decode step's MLP half: ``x``, ``residual`` ``[rows, d]``, the norm's gain
    ``[d]``, the gate/up weight ``[2f, d]`` and the down weight ``[d, f]`` (scaled to keep activations near 1)."""
    def draw(*shape):
        return torch.randn(*shape, device="cuda", generator=generator)

    x, residual = draw(rows, d).to(torch.bfloat16), draw(rows, d).to(torch.bfloat16)
    gain = (1 + 0.1 * draw(d)).to(torch.bfloat16)
    return x, residual, gain, (draw(2 * f, d) * d**-0.5).to(torch.bfloat16), (draw(d, f) * f**-0.5).to(torch.bfloat16)
