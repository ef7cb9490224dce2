"""Prebuilt Triton binaries of a trimmed build: what the build writes, which binary serves a call,
and the errors for a build that cannot serve one. Built here for cuda:90 (no GPU needed); the
launch itself is checked by the CUDA test at the end."""

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("prebuilt binaries are for compiled Triton, not its interpreter", allow_module_level=True)

import ninefold.ops  # noqa: E402,F401
import ninefold.ops.triton  # noqa: E402,F401
from ninefold.ops import build  # noqa: E402
from ninefold.ops.triton import aot, decode, launch, norm, prebuilt  # noqa: E402

MANIFEST = """
target = "cuda:90"
shapes = "smollm2"
uncovered = "{uncovered}"
[ops.rms_norm]
dtypes = ["bfloat16"]
impls = ["triton"]
[ops.attention_decode]
dtypes = ["bfloat16"]
impls = ["triton"]
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("prebuilt")
    (root / "ops.toml").write_text(MANIFEST.format(uncovered="jit"))
    build.build(root / "ops.toml", root / "b")
    return root / "b"


def _library(directory, uncovered=None):
    active = build.Build.load(directory)
    return prebuilt.Library(directory, active.target, uncovered or active.uncovered, active.pdl)


def _launches(fn, *args, pdl=False):
    with launch.recording(pdl) as calls:
        fn(*args)
    return calls


def _norm_call(rows=8, d=576, offset=0):
    x = torch.empty(rows * d + offset, dtype=torch.bfloat16)[offset:].view(rows, d)
    (kernel, values, warps, stages), = _launches(norm.rms_norm, x, torch.ones(d, dtype=torch.bfloat16), 1e-5)
    return kernel, values, warps, stages


def test_build_writes_checked_binaries_with_the_jit_specialisation(built):
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["target"] == "cuda:90" and manifest["uncovered"] == "jit"
    metas = [(p, json.loads(p.read_text())) for p in sorted((built / "kernels" / "triton").rglob("*.json"))]
    # Decode attention is one launch (the last split merges in place): no merge kernel to build.
    assert {m["function"] for _, m in metas} == {"rms_norm_rows_kernel", "decode_split_kernel"}
    for path, meta in metas:
        assert meta["target"] == "cuda:90" and meta["format"] == prebuilt.FORMAT
        cubin = path.with_name(meta["binary"]).read_bytes()
        assert cubin[:4] == b"\x7fELF"
        import hashlib
        assert hashlib.sha256(cubin).hexdigest() == meta["sha256"]
        runtime = [s for s in meta["spec"] if s[0] != "constexpr"]
        assert len(runtime) <= len(meta["ptx_params"]) <= len(runtime) + 2
        pointers = [s for s in meta["spec"] if s[0].startswith("*")]
        # fresh tensors are 16-byte aligned (None: a pointer the kernel does not specialise)
        assert pointers and all(attr in ("D", None) for _, attr in pointers) and any(a == "D" for _, a in pointers)
    exact = [m for _, m in metas if m["exact"]]
    # SmolLM2 rows of 576: sizes and strides divisible by 16 are specialised like the JIT does.
    rows = next(m for m in exact if m["function"] == "rms_norm_rows_kernel")
    assert rows["spec"][rows["params"].index("stride_x")] == ["i32", "D"]
    assert rows["spec"][rows["params"].index("n_rows")] == ["i32", None]  # do_not_specialize


def test_aligned_call_gets_the_exact_binary_and_others_a_covering_one(built):
    lib = _library(built)
    binary, why = lib.find(*_norm_call())
    assert why == "" and binary.meta["exact"]
    assert binary.spec == prebuilt.specialisation(_norm_call()[0], _norm_call()[1])
    # Rows of 580 (not a multiple of 16) at the same block size: the relaxed binary, still aligned pointers.
    kernel, values, warps, stages = _norm_call(d=580)
    binary, why = lib.find(kernel, values, warps, stages)
    assert binary is not None and not binary.meta["exact"]
    assert binary.spec[kernel.arg_names.index("stride_x")] == ("i32", "")
    assert binary.spec[kernel.arg_names.index("x_ptr")] == ("*bf16", "D")


def test_misaligned_call_is_not_served_and_says_why(built):
    lib = _library(built)
    binary, why = lib.find(*_norm_call(offset=1))
    assert binary is None and "x_ptr is not 16-byte aligned" in why
    before = prebuilt.STATS["jit"]
    assert lib.select(*_norm_call(offset=1)) is None  # uncovered = "jit": handed to the JIT, counted
    assert prebuilt.STATS["jit"] == before + 1
    strict = _library(built, uncovered="error")
    with pytest.raises(prebuilt.BuildError, match=r'rms_norm_rows_kernel: .*x_ptr is not 16-byte aligned.*uncovered = "error"'):
        strict.select(*_norm_call(offset=1))


def test_other_constexprs_or_dtypes_are_not_served(built):
    lib = _library(built)
    kernel, values, warps, stages = _norm_call(d=2048)  # another block size
    binary, why = lib.find(kernel, values, warps, stages)
    assert binary is None and "built for" in why
    x = torch.ones(8, 576, dtype=torch.float16)
    (kernel, values, warps, stages), = _launches(norm.rms_norm, x, torch.ones(576, dtype=torch.float16), 1e-5)
    binary, why = lib.find(kernel, values, warps, stages)
    assert binary is None and "is *fp16, built for *bf16" in why


def test_directly_launched_kernels_are_recorded_and_served(built):
    from ninefold.ops import workloads

    lib = _library(built)
    case = next(workloads.cases("attention_decode", workloads.shapes("smollm2"), "meta", torch.bfloat16))
    with aot.sized_as(aot.TARGET_SMS["cuda:90"]):
        calls = _launches(decode.attention_decode, *case.args, None)
    assert [c[0].fn.__name__ for c in calls] == ["decode_split_kernel"]
    for call in calls:
        binary, why = lib.find(*call)
        assert binary is not None and binary.meta["exact"], why


def _decode_launches(cache_dtype, block_size=16):
    from dataclasses import replace

    from ninefold.ops import workloads

    case = next(workloads.cases("attention_decode", replace(workloads.shapes("smollm2"), block_size=block_size),
                                "meta", torch.bfloat16, cache_dtype=cache_dtype))
    with aot.sized_as(aot.TARGET_SMS["cuda:90"]):
        return _launches(decode.attention_decode, *case.args, None)


def test_fp8_cache_kernels_are_built_where_the_manifest_names_them(built, tmp_path):
    """``kv_cache_dtypes = ["fp8"]`` (or its alias "fp8_e4m3"): the cache operators are built over FP8 caches and
    the model's dtype alike, the prefill attention for the chunks an engine's warm-up runs; by default only over the
    model's dtype."""
    (tmp_path / "ops.toml").write_text('kv_cache_dtypes = ["fp8_e4m3"]\n' + MANIFEST.format(uncovered="jit")
                                       + '[ops.reshape_and_cache]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n'
                                       + '[ops.attention_prefill]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n')
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["kv_cache_dtypes"] == ["fp8"]
    metas = [json.loads(p.read_text()) for p in (tmp_path / "b" / "kernels" / "triton").rglob("*.json")]
    fp8 = {m["function"] for m in metas if ["*fp8e4nv", "D"] in m["spec"]}
    assert fp8 == {"decode_split_kernel", "reshape_and_cache_kernel", "prefill_kernel"}
    both, default = _library(tmp_path / "b"), _library(built)
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):  # the model's dtype is always built too
        for call in _decode_launches(cache_dtype):
            binary, why = both.find(*call)
            assert binary is not None and binary.meta["exact"], why
        for call in _engine_prefill_launches(cache_dtype):
            binary, why = both.find(*call)
            assert binary is not None, why
    (call,) = _decode_launches(torch.float8_e4m3fn)
    binary, why = default.find(*call)
    assert binary is None and "is *fp8e4nv, built for *bf16" in why


def _engine_prefill_launches(cache_dtype):
    """The prefill attention launches an engine's warm-up makes (SmolLM2 heads): chunks of 16, 128 and 2048 new tokens
    after one cached block, read from paged caches of ``cache_dtype``, and, over bfloat16, a packed prompt."""
    from ninefold.ops.triton import prefill

    meta, bf16, bs = "meta", torch.bfloat16, 16
    calls = []
    for new in (16, 128, 2048):
        q = torch.empty(new, 9, 64, dtype=bf16, device=meta)
        caches = torch.empty(200, bs, 3, 64, dtype=cache_dtype, device=meta)
        cu_q, cu_k = (torch.empty(2, dtype=torch.int32, device=meta) for _ in range(2))
        tables = torch.empty(1, -(-(bs + new) // bs), dtype=torch.int32, device=meta)
        calls += _launches(prefill.attention_prefill, q, None, None, cu_q, cu_k, None, caches, caches, tables, new,
                           bs + new)
        if cache_dtype == bf16:
            kv = torch.empty(new, 3, 64, dtype=bf16, device=meta)
            calls += _launches(prefill.attention_prefill, q, kv, kv, cu_q, cu_q, None, None, None, None, new, new)
    return calls


def test_paged_kernels_are_built_for_each_block_size_the_manifest_names(built, tmp_path):
    """``block_sizes = [16, 32]``: an engine with ``--block-size 32`` finds exact binaries for its paged decode
    attention and cache writes; the default build (16 only) serves them with none and says the block size differs."""
    (tmp_path / "ops.toml").write_text('block_sizes = [32, 16]\n' + MANIFEST.format(uncovered="jit")
                                       + '[ops.reshape_and_cache]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n')
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["block_sizes"] == [16, 32]
    both, default = _library(tmp_path / "b"), _library(built)
    for block_size in (16, 32):
        for call in _decode_launches(torch.bfloat16, block_size):
            binary, why = both.find(*call)
            assert binary is not None and binary.meta["exact"], why
    (call,) = _decode_launches(torch.bfloat16, 32)
    binary, why = default.find(*call)
    assert binary is None and "32" in why and "16" in why, why
    loaded = build.Build.load(tmp_path / "b")
    assert loaded.block_sizes == (16, 32) and loaded.engine_gap(32, "auto") is None
    assert loaded.engine_gap(8, "auto") == "block_size 8 (the build's paged kernels are for block_sizes [16, 32])"
    assert "kv_cache_dtype 'fp8'" in loaded.engine_gap(16, "fp8")
    from dataclasses import replace

    assert replace(loaded, target="cuda:80").engine_gap(16, "fp8") is None  # no Triton FP8 caches there to build
    assert build.Build.load(built).engine_gap(32, "auto").startswith("block_size 32")


@pytest.mark.parametrize("value", ["16", "[]", "[0]", '["16"]', "[true]", "[16.0]"])
def test_manifest_block_sizes_must_be_positive_integers(tmp_path, built, value):
    (tmp_path / "ops.toml").write_text(f"block_sizes = {value}\n[ops.rms_norm]\n")
    with pytest.raises(ValueError, match=r"block_sizes must be a non-empty list of positive integers .*got"):
        build.read_manifest(tmp_path / "ops.toml")
    shutil.copytree(built, tmp_path / "b")  # a built manifest.json edited by hand is refused alike
    data = json.loads((tmp_path / "b" / "manifest.json").read_text())
    (tmp_path / "b" / "manifest.json").write_text(json.dumps({**data, "block_sizes": json.loads(value.lower())}))
    with pytest.raises(ValueError, match=r"block_sizes must be a non-empty list of positive integers, got"):
        build.Build.load(tmp_path / "b")


@pytest.mark.parametrize("uncovered", ["jit", "error"])
def test_an_engine_whose_block_size_the_build_lacks_is_told_before_loading(built, tmp_path, uncovered):
    """Under ``NINEFOLD_OPS_BUILD`` a CUDA engine with a block size the build compiled no paged kernels for fails
    at once (``uncovered = "error"``: every paged call would) or warns that they compile on first use."""
    from ninefold.llm import engine
    from ninefold.llm.config import EngineConfig

    directory = tmp_path / "b"
    shutil.copytree(built, directory)
    data = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps({**data, "uncovered": uncovered}))
    build.activate(directory)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine._check_ops_build(EngineConfig(block_size=16), torch.device("cuda"))  # covered: silent
            engine._check_ops_build(EngineConfig(block_size=32), torch.device("cpu"))  # nothing compiled runs on a CPU
        message = r"holds no paged attention or cache kernels for this engine's block_size 32 .*block_sizes \[16\]"
        if uncovered == "error":
            with pytest.raises(ValueError, match=message):
                engine._check_ops_build(EngineConfig(block_size=32), torch.device("cuda"))
        else:
            with pytest.warns(UserWarning, match=message):
                engine._check_ops_build(EngineConfig(block_size=32), torch.device("cuda"))
    finally:
        build.activate(None)


def test_fp8_caches_in_a_build_for_a_gpu_without_fp8_are_refused(tmp_path):
    (tmp_path / "ops.toml").write_text('target = "cuda:80"\nkv_cache_dtypes = ["auto", "fp8"]\n'
                                       '[ops.reshape_and_cache]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n')
    with pytest.raises(ValueError, match=r"kv_cache_dtypes names 'fp8', which target 'cuda:80' cannot build"):
        build.build(tmp_path / "ops.toml", tmp_path / "b")
    assert not (tmp_path / "b").exists()  # refused before anything is written


@pytest.mark.parametrize("value, match", [
    ('["auto", "fp16"]', "kv_cache_dtypes lists 'fp16'; accepted: auto, fp8"),
    ('"fp8"', r"kv_cache_dtypes must be a non-empty list of names like \['auto', 'fp8', 'fp8_e4m3'\], got 'fp8'")])
def test_manifest_kv_cache_dtypes_must_be_known(tmp_path, value, match):
    (tmp_path / "ops.toml").write_text(f"kv_cache_dtypes = {value}\n[ops.rms_norm]\n")
    with pytest.raises(ValueError, match=match):
        build.read_manifest(tmp_path / "ops.toml")


def test_build_for_another_gpu_is_refused_clearly(built):
    lib = _library(built)
    lib.check_device((9, 0))
    with pytest.raises(prebuilt.BuildError, match=r"built for cuda:90, this GPU is cuda:80; rebuild with .*--target cuda:80"):
        lib.check_device((8, 0))


def test_missing_corrupt_or_stale_binaries_are_refused(built, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(built, copy)
    lib = _library(copy)
    binary, _ = lib.find(*_norm_call())
    cubin = binary.path.with_name(binary.meta["binary"])
    data = bytearray(cubin.read_bytes())
    data[100] ^= 0xFF
    cubin.write_bytes(bytes(data))
    with pytest.raises(prebuilt.BuildError, match="is corrupt"):
        binary.image()
    cubin.unlink()
    with pytest.raises(prebuilt.BuildError, match="is missing"):
        binary.image()
    meta = json.loads(binary.path.read_text())
    meta["source"] = "0" * 16
    binary.path.write_text(json.dumps(meta))
    with pytest.raises(prebuilt.BuildError, match="compiled from another version of norm.py"):
        _library(copy).find(*_norm_call())
    binary.path.write_text("{not json")
    with pytest.raises(prebuilt.BuildError, match="cannot read"):
        _library(copy)


def test_specialisation_follows_tritons_jit_rules():
    native = pytest.importorskip("triton.runtime.jit").__dict__.get("native_specialize_impl")
    if native is None:
        pytest.skip("this Triton has no native_specialize_impl")
    from triton.backends.compiler import BaseBackend

    kernel = norm.rms_norm_kernel
    params = {p.name: p for p in kernel.params}
    base = torch.empty(64, dtype=torch.bfloat16)
    for name, value in [("x_ptr", base), ("x_ptr", base[1:]), ("d", 1), ("d", 16), ("d", 24), ("d", 1 << 31),
                        ("d", -(1 << 31)), ("n_rows", 1), ("n_rows", 32), ("eps", 1e-5)]:
        p = params[name]
        want = native(BaseBackend, value, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
        got = prebuilt._arg_spec(p, value)
        assert (got[0], got[1] if got[0] != "constexpr" else got[1]) == (want[0], want[1]), (name, value)


def test_exact_binary_is_vectorised_and_the_relaxed_one_is_not():
    from ninefold.ops import workloads

    (kernel, spec, warps, stages), = aot.launches("rms_norm", torch.bfloat16, workloads.shapes("smollm2"))[0][:1]
    target = aot.parse_target("cuda:90")
    exact = aot.compile_spec(kernel, spec, warps, stages, target).asm["ptx"]
    loose = aot.compile_spec(kernel, prebuilt.relaxed(spec, kernel.params), warps, stages, target).asm["ptx"]
    def vector_loads(ptx):
        return len(re.findall(r"ld\.global[.\w:]*\.v4", ptx))
    assert vector_loads(exact) > 0 and vector_loads(loose) == 0


def test_manifest_uncovered_must_be_known(tmp_path):
    (tmp_path / "ops.toml").write_text('uncovered = "maybe"\n[ops.rms_norm]\n')
    with pytest.raises(ValueError, match=r"uncovered must be one of \('jit', 'error'\), got 'maybe'"):
        build.read_manifest(tmp_path / "ops.toml")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_first_call_from_a_build_compiles_nothing_cuda(tmp_path):
    from ninefold.bench import ops_build

    major, minor = torch.cuda.get_device_capability()
    ops_build.write_build(tmp_path / "b", f"cuda:{major}{minor}", ["rms_norm", "attention_decode"], ["rms_norm"])
    env = {**os.environ, "NINEFOLD_OPS_BUILD": str(tmp_path / "b"), "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    pairs = [("rms_norm", "triton"), ("attention_decode", "triton"), ("rms_norm", "dsl")]
    code = f"from ninefold.bench.ops_build import child; child({pairs!r}, {str(tmp_path / 'r.json')!r}, False)"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    for row in rows:
        assert "error" not in row, row
        assert row["compiles"] == 0 and row["correct"], row
        assert row["prebuilt_launches"] >= 1 if row["impl"] == "triton" else row["dsl_aot_launchers"] >= 1, row


def test_launch_arguments_follow_the_binarys_ptx_parameters(built):
    lib = _library(built)
    kernel, values, warps, stages = _norm_call()
    binary, _ = lib.find(kernel, values, warps, stages)
    arguments = prebuilt.Arguments(binary)
    assert arguments.fill(values, 2, "cpu") == []  # no scratch buffers
    holders = arguments.holders
    assert len(holders) == len(arguments.array) == len(binary.meta["ptx_params"])
    assert [arguments.array[i] for i in range(len(holders))] == [ctypes.addressof(h) for h in holders]
    names = [n for n, (kind, _) in zip(kernel.arg_names, binary.spec) if kind != "constexpr"]
    assert holders[names.index("x_ptr")].value == values[0].data_ptr()
    assert holders[names.index("d")].value == 576
    assert holders[names.index("eps")].value == pytest.approx(1e-5)  # a float32 parameter
    assert [h.value for h in holders[len(names):]] == [0, 0]  # scratch pointers: null
    other = torch.empty(8, 576, dtype=torch.bfloat16)
    arguments.fill((other, *values[1:]), 2, "cpu")  # refilled per launch
    assert holders[names.index("x_ptr")].value == other.data_ptr()


def test_bench_build_and_dry_run_serve_every_call_exactly(tmp_path, capsys):
    from ninefold.bench import ops_build

    assert ops_build.main(["--write", str(tmp_path / "b"), "--ops", "rms_norm", "silu_and_mul", "--dsl"]) == 0
    assert ops_build.stale(tmp_path / "b") == []
    assert ops_build.main(["--build", str(tmp_path / "b"), "--dry-run", "--ops", "rms_norm", "silu_and_mul"]) == 0
    lines = capsys.readouterr().out.splitlines()
    served = [line for line in lines if ".cubin" in line]
    assert len(served) == 2 and all(line.endswith("(exact)") for line in served)


PROBE_CUDA = """
import torch, ninefold.ops as ops
from ninefold.ops import references
from ninefold.ops.triton import prebuilt
x = torch.randn(16 * 4096 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(16, 4096)  # misaligned
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
try:
    y = ops.rms_norm(x, w, 1e-5)
    err = ((y.double().cpu() - references.rms_norm(x, w, 1e-5)).abs().max().item())
    print("ran", err < 5e-2, prebuilt.STATS["prebuilt"], any("not 16-byte aligned" in m for m in prebuilt.MISSES))
except prebuilt.BuildError as error:
    print("refused", "x_ptr is not 16-byte aligned" in str(error))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("uncovered,expected", [("jit", "ran True 0 True"), ("error", "refused True")])
def test_uncovered_calls_follow_the_manifest_cuda(tmp_path, uncovered, expected):
    assert _probe_rms_norm_build(tmp_path, uncovered, PROBE_CUDA) == expected


def _probe_rms_norm_build(tmp_path, uncovered: str, probe: str) -> str:
    """Build rms_norm (Triton, bfloat16) for this GPU with ``uncovered``, run ``probe`` in a fresh
    process under that build; returns the probe's last line."""
    return _probe_build(tmp_path, f'shapes = "llama-8b"\nuncovered = "{uncovered}"\n'
                                  '[ops.rms_norm]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n', probe)


def _probe_build(tmp_path, manifest: str, probe: str) -> str:
    """Build ``manifest`` (an ``ops.toml`` without its target) for this GPU, run ``probe`` in a fresh process under
    that build with an empty Triton cache; returns the probe's last line."""
    major, minor = torch.cuda.get_device_capability()
    (tmp_path / "ops.toml").write_text(f'target = "cuda:{major}{minor}"\n' + manifest)
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    env = {**os.environ, "NINEFOLD_OPS_BUILD": str(tmp_path / "b"), "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.split("\n")[-2]


def test_active_build_registers_its_dsl_binaries(tmp_path):
    from ninefold.dsl import aot as dsl_aot
    from ninefold.ops.kernels import softmax

    (tmp_path / "ops.toml").write_text('target = "cuda:90"\nshapes = "tiny"\n[ops.softmax]\ndtypes = ["float16"]\n'
                                       'impls = ["dsl"]\n')
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    x = torch.randn(5, 300, dtype=torch.float16)
    call = ((x, torch.empty_like(x)), {"ROW": 300})
    try:
        build.activate(tmp_path / "b")
        artifact = dsl_aot.find(softmax.kernel, *call)
        assert artifact is not None and artifact.directory == tmp_path / "b" / "kernels" / "dsl" / "softmax" / "float16"
        assert dsl_aot.find(softmax.kernel, (x[:, 1:], torch.empty_like(x)[:, 1:]), {"ROW": 299}) is None
    finally:
        build.activate(None)
    assert dsl_aot.find(softmax.kernel, *call) is None


def test_rebuilding_into_a_build_directory_leaves_no_stale_binaries(tmp_path):
    (tmp_path / "ops.toml").write_text('target = "cuda:90"\nshapes = "smollm2"\n[ops.rms_norm]\ndtypes = ["bfloat16"]\n'
                                       'impls = ["triton"]\n')
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    stale = tmp_path / "b" / "kernels" / "triton" / "rms_norm" / "bfloat16" / "old-0.json"
    stale.write_text("{}")
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    assert not stale.exists() and len(_library(tmp_path / "b")) > 0


PROBE_RELAXED = """
import torch, ninefold.ops as ops
from ninefold.ops import references
from ninefold.ops.triton import prebuilt
x = torch.randn(16, 4104, device="cuda", dtype=torch.bfloat16)[:, :4096]  # row stride 4104: not a multiple of 16
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
y = ops.rms_norm(x, w, 1e-5)
err = (y.double().cpu() - references.rms_norm(x, w, 1e-5)).abs().max().item()
print(err < 5e-2, prebuilt.STATS["prebuilt"], prebuilt.STATS["jit"], [b["exact"] for b in prebuilt.LOADED])
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_off_shape_call_runs_the_relaxed_binary_cuda(tmp_path):
    # served by a relaxed binary, nothing compiled
    assert _probe_rms_norm_build(tmp_path, "error", PROBE_RELAXED) == "True 1 0 [False]"


PROBE_FP8_CUDA = """
import torch, ninefold.ops as ops
from ninefold.ops import references, workloads
from ninefold.ops.triton import prebuilt
for case in list(workloads.cases("attention_decode", workloads.shapes("llama-8b"), "cuda", torch.bfloat16,
                                 cache_dtype=torch.float8_e4m3fn))[:3]:  # (contexts of 4096 and 32768 keys)
    out = ops.attention_decode(*case.args)
    err = (out.double().cpu() - references.attention_decode(*case.args)).abs().max().item()
    assert err < 3e-2, (case.label, err)
print("ran", prebuilt.STATS["prebuilt"] >= 3, prebuilt.STATS["jit"], prebuilt.MISSES[:1])
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_cache_decode_runs_from_a_build_naming_fp8_compiling_nothing_cuda(tmp_path):
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip("FP8 caches need compute capability 8.9")
    manifest = ('shapes = "llama-8b"\nuncovered = "error"\nkv_cache_dtypes = ["fp8"]\n'
                '[ops.attention_decode]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n')
    assert _probe_build(tmp_path, manifest, PROBE_FP8_CUDA) == "ran True 0 []"


PROBE_ERROR = """
def error(got, want):  # relative to |want| + 1, as bench.ops checks
    return ((got.double().cpu() - want).abs() / (want.abs() + 1)).max().item()
"""
PROBE_ROPE_CUDA = """
import torch, ninefold.ops as ops
from ninefold.ops import references, workloads
from ninefold.ops.triton import prebuilt
errors = []
""" + PROBE_ERROR + """
for case in workloads.cases("rope_cache_attention_decode", workloads.shapes("smollm2"), "cuda", torch.bfloat16):
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens = case.args
    before = k_cache.clone(), v_cache.clone()
    out = ops.rope_cache_attention_decode(*case.args)
    rq, rk = references.rope(q, k, positions, cos_sin)
    kc, vc = references.reshape_and_cache(rk, v, *before, slots)
    errors.append(error(out, references.attention_decode(rq, kc, vc, tables, lens)))
for case in list(workloads.cases("rope_and_cache", workloads.shapes("smollm2"), "cuda", torch.bfloat16))[:3]:
    q, k, v, positions, cos_sin, k_cache, v_cache, slots = case.args
    rotated_q, rotated_k = ops.rope_and_cache(*case.args)
    rq, rk = references.rope(q, k, positions, cos_sin)
    cached = k_cache.view(-1, *k_cache.shape[2:])[slots]
    errors += [error(rotated_q, rq), error(cached, rk)]
print("ran", max(errors) < 1e-2, prebuilt.STATS["prebuilt"] >= 2, prebuilt.STATS["jit"], prebuilt.MISSES[:1])
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rope_cache_operators_run_from_a_build_compiling_nothing_cuda(tmp_path):
    manifest = ('shapes = "smollm2"\nuncovered = "error"\n'
                '[ops.rope_and_cache]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n'
                '[ops.rope_cache_attention_decode]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n')
    assert _probe_build(tmp_path, manifest, PROBE_ROPE_CUDA) == "ran True True 0 []"


FUSED_GEMVS = """
[ops.add_rms_norm_linear]
dtypes = ["bfloat16"]
impls = ["triton", "vendor"]
[ops.silu_and_mul_linear]
dtypes = ["bfloat16"]
impls = ["triton", "vendor"]
"""
GEMV_MANIFEST = """
shapes = "llama-8b"
uncovered = "error"
[ops.linear]
dtypes = ["bfloat16"]
impls = ["triton_row", "vendor"]
""" + FUSED_GEMVS


def _engine_gemv_launches():
    """The one-row GEMV launches of a Llama-3-8B decode step at batch 1 (the fused q/k/v and gate_up with the norm,
    down with the gate, o and lm_head plain), on meta tensors."""
    from ninefold.ops import registry

    meta, bf16 = "meta", torch.bfloat16
    row = torch.empty(1, 4096, dtype=bf16, device=meta)
    norm_weight = torch.empty(4096, dtype=bf16, device=meta)
    impl = {op: next(i for i in registry.all_implementations(op) if i.name == name).fn
            for op, name in (("linear", "triton_row"), ("add_rms_norm_linear", "triton"),
                             ("silu_and_mul_linear", "triton"))}
    weights = {(n, k): torch.empty(n, k, dtype=bf16, device=meta) for n, k in ((6144, 4096), (28672, 4096), (4096, 14336),
                                                                            (4096, 4096), (128256, 4096))}
    return (_launches(impl["add_rms_norm_linear"], row, row, norm_weight, weights[6144, 4096], 1e-5, None)
            + _launches(impl["add_rms_norm_linear"], row, row, norm_weight, weights[28672, 4096], 1e-5, None)
            + _launches(impl["silu_and_mul_linear"], torch.empty(1, 28672, dtype=bf16, device=meta),
                        weights[4096, 14336], None)
            + _launches(impl["linear"], row, weights[4096, 4096], None)
            + _launches(impl["linear"], row, weights[128256, 4096], None))


def test_the_decode_gemvs_are_built_on_a_machine_without_a_gpu(tmp_path):
    """linear's one-row GEMV (triton_row) and the fused add_rms_norm_linear / silu_and_mul_linear register wherever
    Triton is, so a build made without a GPU holds their kernels: exact binaries for every GEMV of a batch-1 decode
    step."""
    (tmp_path / "ops.toml").write_text('target = "cuda:90"\n' + GEMV_MANIFEST)
    report = build.build(tmp_path / "ops.toml", tmp_path / "b")
    assert {"linear", "add_rms_norm_linear", "silu_and_mul_linear"} <= set(report.sizes)
    library = _library(tmp_path / "b")
    calls = _engine_gemv_launches()
    assert len(calls) == 5 and {c[0].fn.__name__ for c in calls} == {"gemv_pdl_kernel"}
    for kernel, values, warps, stages in calls:
        binary, why = library.find(kernel, values, warps, stages)
        assert binary is not None and binary.meta["exact"], why


PROBE_GEMV_CUDA = """
import torch, ninefold.ops as ops
from ninefold.ops import references
from ninefold.ops.triton import prebuilt
torch.manual_seed(0)
x, residual = (torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
norm = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
errors = []
""" + PROBE_ERROR + """
for n, k in ((4096, 4096), (128256, 4096)):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    assert ops.choose("linear", x, w) == "triton_row"
    errors.append(error(ops.linear(x, w), references.linear(x, w)))
w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 4096 ** -0.5
y, total = ops.add_rms_norm_linear(x, residual, norm, w, 1e-5)
normed, want_total = references.add_rms_norm(x, residual, norm, 1e-5)
errors += [error(y, references.linear(normed, w)), error(total, want_total)]
gate = torch.randn(1, 28672, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) * 14336 ** -0.5
errors.append(error(ops.silu_and_mul_linear(gate, w), references.linear(references.silu_and_mul(gate), w)))
# A chain of dependent GEMVs in a CUDA graph (on Hopper each waits for the one before through PDL), replayed.
chain = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 4096 ** -0.5 for _ in range(3)]
def run_chain(h):
    for w in chain:
        h = ops.linear(h, w)
    return h
eager = run_chain(x)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    replayed = run_chain(x)
graph.replay()
torch.cuda.synchronize()
hopper = torch.cuda.get_device_capability()[0] >= 9
print("ran", max(errors) < 2e-2 and torch.equal(replayed, eager), prebuilt.STATS["prebuilt"] >= 4,
      (prebuilt.STATS["prebuilt_pdl"] > 0) == hopper, prebuilt.STATS["jit"], prebuilt.MISSES[:1])
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_gemvs_run_from_a_build_compiling_nothing_cuda(tmp_path):
    assert _probe_build(tmp_path, GEMV_MANIFEST, PROBE_GEMV_CUDA) == "ran True True True 0 []"


def test_an_operator_without_workloads_is_kept_and_its_report_says_nothing_was_built(tmp_path, monkeypatch):
    from ninefold.ops import workloads

    monkeypatch.setattr(workloads, "OPS", tuple(op for op in workloads.OPS if op != "rope_and_cache"))
    (tmp_path / "ops.toml").write_text('target = "cuda:90"\nshapes = "smollm2"\n'
                                       '[ops.rope_and_cache]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n')
    report = build.build(tmp_path / "ops.toml", tmp_path / "b")
    assert "rope_and_cache: no representative calls in ninefold.ops.workloads" in report.summary()
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["ops"]["rope_and_cache"]["impls"] == ["triton"]


def _engine_rope_launches(op, cache_dtype, batch=5, context=300):
    """The launches of ``op``'s Triton implementation for a CUDA engine's decode step (SmolLM2 heads, the engine's
    argument dtypes, a batch and context no workload has)."""
    from ninefold.ops import dispatch, registry

    meta, bf16, bs = "meta", torch.bfloat16, 16
    q = torch.empty(batch, 9, 64, dtype=bf16, device=meta)
    k, v = (torch.empty(batch, 3, 64, dtype=bf16, device=meta) for _ in range(2))
    positions, slots = (torch.empty(batch, dtype=torch.int64, device=meta) for _ in range(2))
    cos_sin = torch.empty(8192, 64, dtype=torch.float32, device=meta)
    caches = torch.empty(400, bs, 3, 64, dtype=cache_dtype, device=meta)
    args = (q, k, v, positions, cos_sin, caches, caches, slots)
    if op == "rope_cache_attention_decode":
        args += (torch.empty(batch, -(-context // bs), dtype=torch.int32, device=meta),
                 torch.empty(batch, dtype=torch.int32, device=meta))
    impl = next(i for i in registry.all_implementations(op) if i.name == "triton")
    with aot.sized_as(aot.TARGET_SMS["cuda:90"]):
        return _launches(impl.fn, *dispatch.operator(op).bind(*args))


def test_rope_cache_operators_are_built_for_the_engines_decode_steps(built, tmp_path):
    """``rope_and_cache`` and ``rope_cache_attention_decode`` (what a CUDA engine's decode steps call) have
    workloads: a build keeping them holds binaries for an engine's calls over its caches, FP8 ones too."""
    (tmp_path / "ops.toml").write_text('target = "cuda:90"\nshapes = "smollm2"\nkv_cache_dtypes = ["fp8"]\n'
                                       '[ops.rope_and_cache]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n'
                                       '[ops.rope_cache_attention_decode]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n')
    report = build.build(tmp_path / "ops.toml", tmp_path / "b")
    assert "no representative calls" not in report.summary()
    library = _library(tmp_path / "b")
    for op in ("rope_and_cache", "rope_cache_attention_decode"):
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            calls = _engine_rope_launches(op, cache_dtype)
            assert calls
            for call in calls:
                binary, why = library.find(*call)
                assert binary is not None, (op, cache_dtype, why)


def test_launches_say_which_representative_calls_the_triton_implementation_leaves_out():
    from ninefold.ops import workloads

    found, notes = aot.launches("linear", torch.bfloat16, workloads.shapes("smollm2"))
    assert found  # the GEMV's calls (1 and 8 rows) are recorded; the larger ones are named
    assert notes == [notes[0]] and notes[0].startswith("linear bfloat16: 9 representative calls are outside its "
                                                       "'triton' implementation (nothing built for them), e.g. linear")
    found, notes = aot.launches("linear", torch.bfloat16, workloads.shapes("llama-8b"), impl_name="triton_gemm")
    assert not found and "its 'triton_gemm' implementation launched no kernel for 5 representative calls away " \
                         "from a GPU (e.g. qkv T=256 N=6144 K=4096): it chooses its kernels on the device" in notes[1]
    with pytest.raises(ValueError, match="impl_name: 'cublaslt' runs no Triton kernels to build; accepted: triton, "):
        aot.launches("linear", torch.bfloat16, workloads.shapes("smollm2"), impl_name="cublaslt")


def test_the_decode_kernels_keep_pdl_under_a_build_that_recorded_it(monkeypatch, built):
    """Where PDL would be on (stubbed: no GPU here), a build whose manifest says it recorded the PDL launches keeps it
    on for the GEMVs and the attention side; under one made before builds did (plain launches only) it is off, and a
    launch that still asks for PDL counts as uncovered."""
    from ninefold.ops.triton import gemv_pdl, gemv_pdl_ops

    cuda = torch.device("cuda")
    monkeypatch.setattr(gemv_pdl, "pdl_available", lambda device=None: True)
    monkeypatch.setattr(launch, "_library", None)
    assert gemv_pdl_ops.use_pdl(cuda) and decode.pdl_wanted(cuda)
    assert build.Build.load(built).pdl  # (a cuda:90 build)
    monkeypatch.setattr(launch, "_library", _library(built))
    assert launch.library().pdl and gemv_pdl_ops.use_pdl(cuda) and decode.pdl_wanted(cuda)
    monkeypatch.setattr(launch, "_library", prebuilt.Library(built, "cuda:90", "error", pdl=False))
    assert not gemv_pdl_ops.use_pdl(cuda) and not decode.pdl_wanted(cuda)
    with pytest.raises(prebuilt.BuildError, match=r"gemv_pdl_kernel: launched with PDL \(pdl=True\), and the build "
                                                  r"holds plain launches only; .* uncovered = \"error\""):
        gemv_pdl._LAUNCH((1,), (torch.empty(1),), (), launch_pdl=True)


def test_a_build_for_hopper_holds_the_pdl_launches_of_the_decode_kernels(built):
    """A cuda:90 build records every representative call twice, as launched without PDL and with it (the kernels
    that use PDL then wait on the kernel before with other constexprs), so both launches find exact binaries; the
    manifest says so. Targets before sm_90 record plain launches only."""
    from ninefold.ops import workloads

    assert json.loads((built / "manifest.json").read_text())["pdl"] is True
    assert build._pdl_target("cuda:90") and not build._pdl_target("cuda:80") and not build._pdl_target("cpu")
    library = _library(built)
    case = next(workloads.cases("attention_decode", workloads.shapes("smollm2"), "meta", torch.bfloat16))
    x = torch.empty(8, 576, dtype=torch.bfloat16, device="meta")
    for pdl in (False, True):
        with aot.sized_as(aot.TARGET_SMS["cuda:90"]):
            calls = _launches(decode.attention_decode, *case.args, None, pdl=pdl)
        calls += _launches(norm.rms_norm, x, torch.empty(576, dtype=torch.bfloat16, device="meta"), 1e-5, pdl=pdl)
        assert len(calls) == 2 and all(dict(zip(c[0].arg_names, c[1]))["USE_GDC"] is pdl for c in calls)
        for kernel, values, warps, stages in calls:
            binary, why = library.find(kernel, values, warps, stages)
            assert binary is not None and binary.meta["exact"], why


FP8_MANIFEST = """
shapes = "llama-8b"
uncovered = "error"
[ops.linear_fp8]
dtypes = ["bfloat16"]
impls = ["triton_pdl", "triton_gemv", "scaled_mm", "dequantize"]
""" + FUSED_GEMVS


def _fp8_decode_launches():
    """The FP8-weight launches of a Llama-3-8B engine with quantization="fp8" on meta tensors: the few-rows GEMV
    (16 rows of down), the activation quantizer before scaled_mm (256 rows of o) and the fused one-row gate_up GEMV."""
    from ninefold.ops import registry
    from ninefold.ops.fp8 import FP8, Fp8Weight

    def impl(op, name):
        return next(i for i in registry.all_implementations(op) if i.name == name).fn

    def weight(n, k):
        return Fp8Weight(torch.empty(n, k, dtype=FP8, device="meta"), torch.empty(n, device="meta"))

    def rows(m, k):
        return torch.empty(m, k, dtype=torch.bfloat16, device="meta")

    row = rows(1, 4096)
    return (_launches(impl("linear_fp8", "triton_gemv"), rows(16, 14336), weight(4096, 14336), None)
            + _launches(impl("linear_fp8", "scaled_mm"), rows(256, 4096), weight(4096, 4096), None)
            + _launches(impl("add_rms_norm_linear", "triton"), row, row, torch.empty(4096, dtype=torch.bfloat16,
                                                                                      device="meta"),
                        weight(28672, 4096), 1e-5, None))


def test_the_fp8_linears_are_built_on_a_machine_without_a_gpu(tmp_path):
    """linear_fp8's Triton kernels (its few-rows GEMV, the quantizer of scaled_mm's input) and the fused GEMVs over
    FP8 weights register wherever Triton is and have workloads, so a build made without a GPU holds exact binaries
    for an FP8 engine's decode launches."""
    (tmp_path / "ops.toml").write_text('target = "cuda:90"\n' + FP8_MANIFEST)
    report = build.build(tmp_path / "ops.toml", tmp_path / "b")
    assert {"linear_fp8", "add_rms_norm_linear", "silu_and_mul_linear"} <= set(report.sizes)
    library = _library(tmp_path / "b")
    calls = _fp8_decode_launches()
    assert [c[0].fn.__name__ for c in calls] == ["fp8_gemv_kernel", "quantize_rows_kernel", "gemv_pdl_kernel"]
    for kernel, values, warps, stages in calls:
        binary, why = library.find(kernel, values, warps, stages)
        assert binary is not None and binary.meta["exact"], why


PROBE_FP8_LINEAR_CUDA = """
import torch, ninefold.ops as ops
from ninefold.ops import references
from ninefold.ops.fp8 import quantize_rows
from ninefold.ops.triton import prebuilt
torch.manual_seed(0)
errors = []
""" + PROBE_ERROR + """
def weight(n, k):
    return ops.Fp8Weight.quantize(torch.randn(n, k, device="cuda") * k ** -0.5)
for impl, rows, n, k in (("triton_gemv", 16, 4096, 14336), ("triton_gemv", 3, 6144, 4096),
                         ("scaled_mm", 256, 4096, 4096), ("scaled_mm", 2048, 28672, 4096)):
    x, w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), weight(n, k)
    codes, scales = quantize_rows(x)  # scaled_mm multiplies x as FP8 codes, the GEMV x itself
    xq = codes.float() * scales[:, None] if impl == "scaled_mm" else x
    errors.append(error(ops.run("linear_fp8", impl, x, w), references.linear(xq, w.dequantize())))
x, residual = (torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
norm = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
w = weight(28672, 4096)
y, total = ops.add_rms_norm_linear(x, residual, norm, w, 1e-5)
normed, _ = references.add_rms_norm(x, residual, norm, 1e-5)
errors.append(error(y, references.linear(normed, w.dequantize())))
gate, w = torch.randn(1, 28672, device="cuda", dtype=torch.bfloat16), weight(4096, 14336)
want = references.linear(references.silu_and_mul(gate), w.dequantize())
errors.append(error(ops.silu_and_mul_linear(gate, w), want))
print("ran", max(errors) < 5e-2, prebuilt.STATS["prebuilt"] >= 4, prebuilt.STATS["jit"], prebuilt.MISSES[:1])
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_linears_run_from_a_build_compiling_nothing_cuda(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 weights' Triton kernels need compute capability 8.9")
    assert _probe_build(tmp_path, FP8_MANIFEST, PROBE_FP8_LINEAR_CUDA) == "ran True True 0 []"
