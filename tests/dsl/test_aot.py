"""AOT: the compile half on this CPU machine (cubin + metadata), and the launch plan of a load."""

import json

import pytest
import torch

from ninefold.dsl import aot

from .test_backends import add, mm


def test_compile_writes_cubins_and_metadata(tmp_path):
    signatures = [
        tuple(torch.empty(64, 64, dtype=torch.float16, device="meta") for _ in range(3)),
        {"args": tuple(torch.empty(8, 8) for _ in range(3)), "kwargs": {"BM": 32, "BN": 32, "BK": 32}},
    ]
    paths = aot.compile(mm, signatures, target="cuda:90", out=tmp_path)
    assert [p.name for p in paths] == ["mm_0.json", "mm_1.json"]
    meta = json.loads(paths[1].read_text())
    assert (tmp_path / meta["cubin"]).read_bytes()[:4] == b"\x7fELF"
    assert meta["function"] == "mm_kernel" and meta["target"] == "cuda:90"
    assert meta["dtypes"] == {"a": "float32", "b": "float32", "c": "float32"}
    assert len(meta["ptx_params"]) >= sum(not a["constexpr"] for a in meta["arguments"])

    kernel = aot.load(tmp_path)
    a, b, c = torch.empty(100, 70), torch.empty(70, 90), torch.empty(100, 90)
    grid, launch = kernel.artifacts[1].plan((a, b, c), {})
    assert grid == 4 * 3  # cdiv(100, 32) * cdiv(90, 32)
    assert [t for t, _ in launch[:3]] == ["*fp32"] * 3 and launch[0][1] is a
    assert ("i32", 70) in launch
    with pytest.raises(ValueError, match="compiled for float16"):
        kernel.artifacts[0].plan((a, b, c), {})
    with pytest.raises(ValueError, match="no AOT artifact matches"):
        kernel(a.double(), b.double(), c.double())


def test_compile_checks_its_arguments(tmp_path):
    x = torch.empty(16)
    with pytest.raises(ValueError, match="target must look like"):
        aot.compile(add, [(x, x, x)], target="sm90", out=tmp_path)
    with pytest.raises(ValueError, match="out"):
        aot.compile(add, [(x, x, x)])
    aot.compile(add, [(x, x, x)], out=tmp_path / "add")
    aot.compile(mm, [(torch.empty(8, 8),) * 3], out=tmp_path / "add")
    with pytest.raises(ValueError, match="pass kernel_name"):
        aot.load(tmp_path / "add")
    assert aot.load(tmp_path / "add", "add").artifacts
