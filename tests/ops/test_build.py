"""Trimmed builds: ninefold ops build writes only its manifest's kernels; NINEFOLD_OPS_BUILD restricts the registry."""

import json
import os
import subprocess
import sys

import pytest
import torch

import ninefold.ops as ops
from ninefold.cli.main import main
from ninefold.ops import build

MANIFEST = """
target = "cuda:90"
shapes = "smollm2"
[ops.rms_norm]
dtypes = ["bfloat16", "float32"]
impls = ["triton", "vendor"]
[ops.silu_and_mul]
dtypes = ["bfloat16"]
impls = ["triton"]
"""

PROBE = """
import torch, ninefold.ops as ops
print(round(ops.rms_norm(torch.ones(2, 4), torch.ones(4)).sum().item(), 3))
for call in (lambda: ops.rms_norm(torch.ones(2, 4).half(), torch.ones(4)), lambda: ops.softmax(torch.ones(3))):
    try:
        call()
        print("ran")
    except ValueError as error:
        print(error)
"""


def _probe(directory, code=PROBE):
    env = {**os.environ, "NINEFOLD_OPS_BUILD": str(directory)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()


def test_build_for_sm90_holds_only_its_manifest(tmp_path, capsys):
    pytest.importorskip("triton")
    (tmp_path / "ops.toml").write_text(MANIFEST)
    out = tmp_path / "build"
    assert main(["ops", "build", "--manifest", str(tmp_path / "ops.toml"), "--out", str(out)]) == 0
    report = capsys.readouterr().out
    assert "rms_norm" in report and "silu_and_mul" in report and "total" in report
    binaries = sorted((out / "kernels" / "triton").rglob("*.cubin"))
    folders = sorted({str(p.parent.relative_to(out / "kernels" / "triton")) for p in binaries})
    assert folders == ["rms_norm/bfloat16", "rms_norm/float32", "silu_and_mul/bfloat16"]
    # Rows of 576 (SmolLM2): four rows per program; the JIT's specialisation and a relaxed one.
    metas = [json.loads(p.with_suffix(".json").read_text()) for p in binaries]
    assert {m["function"] for m in metas} == {"rms_norm_rows_kernel", "gated_kernel"}
    assert all(m["spec"][m["params"].index("BLOCK_R")] == ["constexpr", 4] for m in metas
               if m["function"] == "rms_norm_rows_kernel")
    assert any(m["exact"] for m in metas) and not all(m["exact"] for m in metas)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["ops"] == {"rms_norm": {"dtypes": ["bfloat16", "float32"], "impls": ["triton", "vendor"]},
                               "silu_and_mul": {"dtypes": ["bfloat16"], "impls": ["triton"]}}
    listed = _probe(out, "from ninefold.cli.main import main; main(['ops', 'list'])")
    # silu_and_mul is triton-only: listed only where CUDA registers the Triton kernels.
    expected = ["rms_norm", "silu_and_mul"] if torch.cuda.is_available() else ["rms_norm"]
    assert [line.split()[0] for line in listed[1:]] == expected
    assert listed[0] == (f"trimmed build: {out} (target cuda:90; paged kernels for KV caches auto, block sizes 16; "
                         f"launches with and without PDL)")
    first, half, softmax = _probe(out)
    assert first == "8.0"
    assert half.startswith("rms_norm: float16 is not supported on cpu in the trimmed build at ")
    assert half.endswith("; supported: bfloat16, float32")
    assert softmax.startswith("softmax: not part of the trimmed build at ") and "it holds: rms_norm" in softmax


def test_a_failed_first_build_leaves_nothing_the_next_build_keeps(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    (tmp_path / "ops.toml").write_text('target = "cuda:90"\nshapes = "smollm2"\n[ops.rms_norm]\n'
                                       'dtypes = ["float32"]\nimpls = ["triton"]\n')
    out = tmp_path / "build"

    def fail(*args):
        raise RuntimeError("compiler crashed")
    monkeypatch.setattr(build, "_compile_dsl", fail)  # after the Triton kernels were written
    with pytest.raises(RuntimeError, match="compiler crashed"):
        build.build(tmp_path / "ops.toml", out)
    assert list((out / "kernels").rglob("*.cubin")) and not (out / "manifest.json").exists()
    monkeypatch.undo()
    (tmp_path / "cpu.toml").write_text('target = "cpu"\n[ops.rms_norm]\ndtypes = ["float32"]\n')
    build.build(tmp_path / "cpu.toml", out)
    assert not (out / "kernels").exists() and (out / "manifest.json").exists()
    unrelated = tmp_path / "mine"
    (unrelated / "kernels").mkdir(parents=True)
    (unrelated / "kernels" / "notes.txt").write_text("not a build")
    build.build(tmp_path / "cpu.toml", unrelated)
    assert (unrelated / "kernels" / "notes.txt").exists()  # never ours: left alone


def test_vendor_fallback_serves_calls_outside_the_build(tmp_path):
    (tmp_path / "ops.toml").write_text('target = "cpu"\nfallback = "vendor"\n[ops.rms_norm]\ndtypes = ["float32"]\n'
                                       'impls = ["vendor"]\n')
    assert main(["ops", "build", "--manifest", str(tmp_path / "ops.toml"), "--out", str(tmp_path / "b")]) == 0
    assert _probe(tmp_path / "b") == ["8.0", "ran", "ran"]


@pytest.mark.parametrize("fallback", ["error", "vendor"])
def test_an_fp8_engine_is_refused_before_loading_under_a_build_without_linear_fp8(tmp_path, fallback):
    """``quantization="fp8"`` runs every projection on ``ops.linear_fp8``: a build that keeps none of its
    implementations is refused before the model loads; ``fallback = "vendor"`` keeps its portable one
    (``dequantize``: it has no vendor implementation), which then serves the call."""
    from ninefold.llm import engine
    from ninefold.llm.config import EngineConfig

    (tmp_path / "ops.toml").write_text(f'target = "cpu"\nfallback = "{fallback}"\n[ops.rms_norm]\n'
                                       'dtypes = ["float32"]\nimpls = ["vendor"]\n')
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    build.activate(tmp_path / "b")
    try:
        engine._check_ops_build(EngineConfig(), torch.device("cpu"))  # unquantized: nothing missing
        weight = ops.Fp8Weight.quantize(torch.randn(8, 16))
        x = torch.randn(3, 16)
        if fallback == "error":
            with pytest.raises(ValueError, match=r"quantization: 'fp8' runs ops.linear_fp8, which NINEFOLD_OPS_BUILD="
                                                 r".* does not keep; add \[ops.linear_fp8\] to the manifest"):
                engine._check_ops_build(EngineConfig(quantization="fp8"), torch.device("cpu"))
            with pytest.raises(ops.UnsupportedError, match="linear_fp8: not part of the trimmed build"):
                ops.linear_fp8(x, weight)
        else:
            engine._check_ops_build(EngineConfig(quantization="fp8"), torch.device("cpu"))
            assert ops.choose("linear_fp8", x, weight) == "dequantize"
            torch.testing.assert_close(ops.linear_fp8(x, weight), x @ weight.dequantize().T)
    finally:
        build.activate(None)


@pytest.mark.parametrize("text,message", [
    ('[ops.rmsnorm]\ndtypes = ["float32"]', "unknown operator 'rmsnorm'"),
    ('[ops.rms_norm]\ndtypes = ["int8"]', "rms_norm lists dtype 'int8'; accepted: float16, bfloat16, float32"),
    ('[ops.rms_norm]\nimpls = ["cudnn"]', "rms_norm has no implementation 'cudnn'; it has: "),
    ('fallback = "cpu"\n[ops.rms_norm]\n', "fallback must be one of ('error', 'vendor'), got 'cpu'"),
    ('target = "cpu"\n', "needs at least one [ops.<name>] table"),
    ('[ops.rms_norm', "cannot read"),
    ('fallbak = "vendor"\n[ops.rms_norm]\n', "unknown key 'fallbak'; accepted: target, fallback"),
    ('[ops.rms_norm]\nimpl = ["vendor"]\n', "[ops.rms_norm] has unknown key 'impl'; accepted: dtypes, impls"),
    ('[ops.rms_norm]\nimpls = "vendor"\n', "[ops.rms_norm] impls must be a non-empty list of names"),
    ('[ops.rms_norm]\nimpls = []\n', "[ops.rms_norm] impls must be a non-empty list of names"),
    ('[ops.rms_norm]\ndtypes = "float32"\n', "[ops.rms_norm] dtypes must be a non-empty list of names"),
    ('[ops.rms_norm]\ndtypes = []\n', "[ops.rms_norm] dtypes must be a non-empty list of names"),
    ('ops.rms_norm = "vendor"\n', "ops.rms_norm must be a table"),
    ('target = "sm90"\n[ops.rms_norm]\n', "target must be 'cpu' or a GPU like 'cuda:90'"),
    ('target = 90\n[ops.rms_norm]\n', "target must be 'cpu' or a GPU like 'cuda:90'"),
    ('shapes = "huge"\n[ops.rms_norm]\n', "shapes must be one of llama-8b, smollm2, tiny, got 'huge'"),
])
def test_manifest_errors_name_the_entry(tmp_path, text, message):
    path = tmp_path / "ops.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        build.read_manifest(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_build_directory_without_manifest_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no manifest.json"):
        build.Build.load(tmp_path)


def test_build_compiles_dsl_kernels_ahead_of_time(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("ninefold.dsl.aot")
    (tmp_path / "ops.toml").write_text('target = "cuda:90"\nshapes = "tiny"\n[ops.softmax]\ndtypes = ["float16"]\n'
                                       'impls = ["dsl"]\n')
    report = build.build(tmp_path / "ops.toml", tmp_path / "b")
    files = sorted(str(p.relative_to(tmp_path / "b" / "kernels")) for p in (tmp_path / "b" / "kernels").rglob("*.*"))
    assert files and all(f.startswith("dsl/softmax/float16/") for f in files)
    assert any(f.endswith(".cubin") for f in files)
    assert report.sizes["softmax (dsl)"][1] == sum(p.stat().st_size for p in (tmp_path / "b" / "kernels").rglob("*.*"))


def test_a_manifest_may_name_cublaslt_on_a_machine_without_cuda(tmp_path):
    """cuBLASLt registers only where CUDA is; a build for a GPU is made anywhere (a typo is still refused)."""
    (tmp_path / "ops.toml").write_text('target = "cuda:90"\n[ops.linear]\nimpls = ["cublaslt", "vendor"]\n'
                                       'dtypes = ["bfloat16"]\n')
    out = tmp_path / "build"
    assert main(["ops", "build", "--manifest", str(tmp_path / "ops.toml"), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["ops"] == {"linear": {"dtypes": ["bfloat16"], "impls": ["cublaslt", "vendor"]}}
    (tmp_path / "typo.toml").write_text('target = "cuda:90"\n[ops.linear]\nimpls = ["cublaslT"]\n')
    assert main(["ops", "build", "--manifest", str(tmp_path / "typo.toml"), "--out", str(tmp_path / "b2")]) != 0


COMPOSITES = """
target = "cpu"
[ops.rope_and_cache]
dtypes = ["float32"]
impls = ["vendor"]
[ops.add_rms_norm_linear]
dtypes = ["float32"]
impls = ["vendor"]
[ops.silu_and_mul_linear]
dtypes = ["bfloat16"]
impls = ["vendor"]
"""

COMPOSITE_PROBE = """
import torch, ninefold.ops as ops
q, k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
ops.rope_and_cache(q, k, v, torch.arange(3), torch.randn(16, 8), kc, vc, torch.arange(3))
ops.add_rms_norm_linear(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), torch.randn(5, 8))
ops.silu_and_mul_linear(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(5, 4, dtype=torch.bfloat16))
ops.add_rms_norm_linear(torch.randn(1, 8), torch.randn(1, 8), torch.ones(8), ops.Fp8Weight.quantize(torch.randn(5, 8)))
print("ran")
"""


def test_a_kept_composite_brings_the_operators_its_implementation_calls(tmp_path):
    """The vendor rope_and_cache, add_rms_norm_linear and silu_and_mul_linear call other operators through
    dispatch: a build keeping them keeps those, for their dtypes, with the vendor implementation only (linear_fp8,
    for FP8 weights, with dequantize: it has no vendor one)."""
    (tmp_path / "ops.toml").write_text(COMPOSITES)
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    kept = json.loads((tmp_path / "b" / "manifest.json").read_text())["ops"]
    assert kept == {"rope_and_cache": {"dtypes": ["float32"], "impls": ["vendor"]},
                    "add_rms_norm_linear": {"dtypes": ["float32"], "impls": ["vendor"]},
                    "silu_and_mul_linear": {"dtypes": ["bfloat16"], "impls": ["vendor"]},
                    "rope": {"dtypes": ["float32"], "impls": ["vendor"]},
                    "reshape_and_cache": {"dtypes": ["float32"], "impls": ["vendor"]},
                    "add_rms_norm": {"dtypes": ["float32"], "impls": ["vendor"]},
                    "linear": {"dtypes": ["float32", "bfloat16"], "impls": ["vendor"]},
                    "linear_fp8": {"dtypes": ["float32", "bfloat16"], "impls": ["dequantize"]},
                    "silu_and_mul": {"dtypes": ["bfloat16"], "impls": ["vendor"]}}
    assert _probe(tmp_path / "b", COMPOSITE_PROBE) == ["ran"]


def test_a_listed_operator_a_composite_calls_must_cover_its_dtypes(tmp_path):
    path = tmp_path / "ops.toml"
    path.write_text('[ops.rope_and_cache]\ndtypes = ["float32", "bfloat16"]\nimpls = ["vendor"]\n'
                    '[ops.rope]\ndtypes = ["bfloat16"]\nimpls = ["vendor"]\n')
    with pytest.raises(ValueError, match=r"rope_and_cache's 'vendor' implementation calls rope, and \[ops.rope\] "
                                         r"leaves out rope_and_cache's dtypes float32; add them to \[ops.rope\] dtypes"):
        build.read_manifest(path)
    path.write_text('[ops.rope_and_cache]\ndtypes = ["float32"]\nimpls = ["vendor"]\n'
                    '[ops.rope]\ndtypes = ["float32", "bfloat16"]\nimpls = ["vendor"]\n')
    assert build.read_manifest(path)["ops"]["rope"] == {"dtypes": ["float32", "bfloat16"], "impls": ["vendor"]}
