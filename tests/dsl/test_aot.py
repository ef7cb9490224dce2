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


def test_artifacts_assume_what_the_jit_would_specialize(tmp_path):
    x = torch.empty(4096, dtype=torch.float16)
    (path,) = aot.compile(add, [(x, x, x)], out=tmp_path)
    arguments = {a["name"]: a for a in json.loads(path.read_text())["arguments"]}
    strides = [a for n, a in arguments.items() if "_stride_" in n]
    assert strides and all(a["constexpr"] and a["value"] == 1 for a in strides)  # unit strides: constants
    assert all(a.get("divisible") == 16 for a in arguments.values() if a["kind"] == "pointer")
    artifact = aot.load(tmp_path).artifacts[0]
    y = torch.empty(8192, dtype=torch.float16)
    artifact.plan((y[:100], y[:100], y[:100]), {})  # any size, aligned and contiguous: accepted
    with pytest.raises(ValueError, match="16-byte aligned"):
        artifact.plan((y[1:101], y[:100], y[:100]), {})
    with pytest.raises(ValueError, match="stride"):
        artifact.plan((y[::2], y[:4096], y[:4096]), {})
    (loose,) = aot.compile(add, [(x, x, x)], out=tmp_path / "loose", assume=())
    assert not any(a.get("divisible") or (a["constexpr"] and "_stride_" in a["name"]) for a in json.loads(loose.read_text())["arguments"])
    aot.load(tmp_path / "loose").artifacts[0].plan((y[1:101], y[::2][:100], y[:100]), {})
    with pytest.raises(ValueError, match="assume"):
        aot.compile(add, [(x, x, x)], out=tmp_path / "bad", assume=("everything",))


def test_registered_artifacts_are_found_by_kernel_source_and_call(tmp_path):
    x = torch.empty(4096, dtype=torch.float16)
    aot.compile(add, [(x, x, x)], out=tmp_path / "add")
    aot.compile(mm, [(torch.empty(64, 64, dtype=torch.float16),) * 3], out=tmp_path / "mm")
    try:
        assert aot.register(tmp_path / "add") == 1
        assert aot.register(tmp_path / "add") == 0  # already there
        y = torch.empty(1000, dtype=torch.float16)
        assert aot.find(add, (y, y, y), {}) is not None
        assert aot.find(add, (y[1:], y[1:], y[1:]), {}) is None  # misaligned: the JIT path
        assert aot.find(add, (y.float(),) * 3, {}) is None  # another dtype
        a = torch.empty(64, 64, dtype=torch.float16)
        assert aot.find(mm, (a, a, a), {}) is None  # not registered
        assert aot.register(tmp_path / "mm") == 1 and aot.find(mm, (a, a, a), {}) is not None
        old = tmp_path / "old"
        old.mkdir()
        meta = json.loads((tmp_path / "add" / "add_0.json").read_text())
        del meta["source_hash"]
        (old / "add_0.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match="source_hash"):
            aot.register(old)
    finally:
        aot.unregister_all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_calls_launch_registered_artifacts_without_the_jit(tmp_path):
    major, minor = torch.cuda.get_device_capability()
    x = torch.randn(5000, device="cuda", dtype=torch.float16)
    y = torch.randn(5000, device="cuda", dtype=torch.float16)
    aot.compile(add, [(x, y, torch.empty_like(x))], target=f"cuda:{major}{minor}", out=tmp_path)
    try:
        aot.register(tmp_path)
        before = aot.stats()
        z = torch.empty_like(x)
        add(x, y, z)
        add(x, y, z)  # the warm call reuses the artifact's launcher
        torch.testing.assert_close(z.double(), x.double() + y.double(), rtol=1e-3, atol=1e-3)
        after = aot.stats()
        assert after["aot_launchers"] == before["aot_launchers"] + 1
        assert after["jit_prepared"] == before["jit_prepared"]
    finally:
        aot.unregister_all()
