"""The measured few-row CPU ``linear``: where it applies, both forms agree, the choice persists."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ninefold import ops
from ninefold.ops import cpu_linear

from .helpers import fresh_choice_cache

BIG = (1 << 22) // 512  # rows of a 512-wide weight at the size threshold


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    yield from fresh_choice_cache(cpu_linear.CACHE.forget, tmp_path, monkeypatch)


def test_applies_to_few_rows_of_a_large_weight_only():
    w_big, w_small = torch.empty(BIG, 512), torch.empty(BIG - 1, 512)
    assert cpu_linear.supports(torch.empty(4, 512), w_big) is None
    assert "rows" in cpu_linear.supports(torch.empty(1, 512), w_big)
    assert "rows" in cpu_linear.supports(torch.empty(65, 512), w_big)
    assert "elements" in cpu_linear.supports(torch.empty(4, 512), w_small)
    assert ops.choose("linear", torch.empty(3, 512), w_big) == "cpu_measured"
    assert ops.choose("linear", torch.empty(3, 512), w_small) == "vendor"
    assert ops.choose("linear", torch.empty(100, 512), w_big) == "vendor"
    assert [cpu_linear.bucket(r) for r in (2, 3, 4, 5, 33, 64)] == [2, 4, 4, 8, 64, 64]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_both_forms_compute_linear(dtype, tol, with_bias):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 512, dtype=dtype)
    w = torch.randn(BIG, 512, dtype=dtype) / 16
    b = torch.randn(BIG, dtype=dtype) if with_bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = cpu_linear.swapped(x.reshape(-1, 512), w, b).reshape(2, 3, BIG)
    assert got.is_contiguous() and got.dtype == dtype
    scale = want.abs().max()
    assert (got.double() - want).abs().max() / scale < tol
    via_ops = ops.linear(x, w, b)
    assert via_ops.shape == (2, 3, BIG) and (via_ops.double() - want).abs().max() / scale < tol


def test_choice_is_measured_once_and_persists_across_processes(fresh_cache):
    w = torch.randn(BIG, 512)
    ops.linear(torch.randn(5, 512), w)
    files = list((fresh_cache / "ops").glob("cpu-linear-*.json"))
    assert len(files) == 1
    choices = json.loads(files[0].read_text())["choices"]
    (key, picked), = choices.items()
    assert key.endswith(f"|float32|8|{BIG}|512|0") and picked in (cpu_linear.LINEAR, cpu_linear.SWAPPED)
    # another process with tuning off still runs the stored form (it reads the file, measures nothing)
    code = ("import torch; from ninefold.ops import cpu_linear; "
            f"w = torch.randn({BIG}, 512); print(cpu_linear.choice(7, w, None))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NINEFOLD_CACHE_DIR": str(fresh_cache),
                               "NINEFOLD_CPU_LINEAR_AUTOTUNE": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == picked


def test_a_stored_choice_is_followed_and_tuning_can_be_switched_off(fresh_cache, monkeypatch):
    w = torch.randn(BIG, 512)
    key = cpu_linear._key(torch.float32, 3, BIG, 512, False)
    cpu_linear.CACHE.store(key, cpu_linear.SWAPPED)
    assert cpu_linear.choice(3, w, None) == cpu_linear.SWAPPED
    monkeypatch.setenv("NINEFOLD_CPU_LINEAR_AUTOTUNE", "0")
    assert cpu_linear.choice(16, w, None) == cpu_linear.LINEAR  # untuned, not measured
    assert len(cpu_linear.CACHE.choices()) == 1
