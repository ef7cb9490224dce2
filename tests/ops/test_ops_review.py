"""Review of the operator library's plumbing: pins, the registry, tuning tables and caches (with real
concurrent processes), trimmed builds and the DSL's ahead-of-time artifacts they carry."""

import gc
import json
import os
import subprocess
import sys
import textwrap
import warnings
import weakref

import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import build, dispatch, registry, tuning

x = torch.randn(3, 8)
w = torch.ones(8)


def _python(code: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **(env or {})},
                         capture_output=True, text=True, timeout=300)
    if check:
        assert run.returncode == 0, run.stderr
    return run


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A fresh user cache directory for this test, forgotten afterwards."""
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path / "cache"))
    tuning.reload()
    yield tmp_path / "cache"
    monkeypatch.delenv("NINEFOLD_CACHE_DIR")
    tuning.reload()


# ------------------------------------------------------------------ pins
def test_an_operator_pinned_twice_to_different_implementations_is_refused(monkeypatch):
    with pytest.raises(ops.OpError, match=r"NINEFOLD_OPS: rms_norm is pinned twice, to 'dsl' and to 'vendor'"):
        dispatch.parse_pins("rms_norm=dsl, rms_norm=vendor")
    assert dispatch.parse_pins(" rms_norm = vendor ,, rms_norm=vendor,") == {"rms_norm": "vendor"}
    with pytest.raises(ops.OpError, match=r"expected entries like 'rms_norm=dsl', got 'rms_norm==dsl'"):
        dispatch.parse_pins("rms_norm==dsl")
    monkeypatch.setenv("NINEFOLD_OPS", "softmax=vendor,softmax=dsl")
    ops.reload_environment()
    try:
        with pytest.raises(ops.OpError, match="softmax is pinned twice"):
            ops.softmax(x)
    finally:
        monkeypatch.delenv("NINEFOLD_OPS")
        ops.reload_environment()


def test_a_pin_that_is_not_a_name_is_a_type_error():
    with pytest.raises(TypeError, match=r"ops.use: the pin of rms_norm must be an implementation name \(str\), got 3"):
        with ops.use(rms_norm=3):
            pass


def _cuda_only_supports(x, weight, eps):
    assert x.device.type == "cuda", "supports() called with tensors of a device the implementation does not run on"
    return None


def test_a_pin_for_another_device_falls_back_naming_the_device_without_asking_supports():
    registry.register("rms_norm", "gpuonly", devices=("cuda",), supports=_cuda_only_supports)(lambda *a: None)
    try:
        with ops.use(rms_norm="gpuonly"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = torch.randn(5, 7)
            out = ops.rms_norm(a, torch.ones(7))
        message = str(caught[0].message)
        assert "pinned implementation 'gpuonly' cannot run these inputs (it runs on cuda, not cpu)" in message
        torch.testing.assert_close(out, ops.run("rms_norm", "vendor", a, torch.ones(7)))
    finally:
        registry.unregister("rms_norm", "gpuonly")


# ------------------------------------------------------------------ registry
def test_register_takes_a_single_device_or_dtype_as_one():
    registry.register("rms_norm", "probe", devices="cpu", dtypes=torch.float32)(lambda x, w, e: x * 0 + 7)
    try:
        (impl,) = [i for i in registry.all_implementations("rms_norm") if i.name == "probe"]
        assert impl.devices == ("cpu",) and impl.dtypes == frozenset({torch.float32})
        with ops.use(rms_norm="probe"):
            assert ops.choose("rms_norm", x, w) == "probe"
            assert (ops.rms_norm(x, w) == 7).all()
    finally:
        registry.unregister("rms_norm", "probe")


@pytest.mark.parametrize("op,name,kwargs,message", [
    ("rmsnorm", "probe", {}, r"unknown operator 'rmsnorm'; known: .*rms_norm"),
    ("rms_norm", "my impl", {}, r"implementation name must be .*got 'my impl'"),
    ("rms_norm", "a=b", {}, r"implementation name must be"),
    ("rms_norm", "", {}, r"implementation name must be"),
    ("rms_norm", "probe", {"devices": ()}, r"devices is empty"),
    ("rms_norm", "probe", {"devices": ("cpu", 3)}, r"devices must be torch device types .*got 3"),
    ("rms_norm", "probe", {"dtypes": ("float32",)}, r"dtypes must be torch dtypes .*got float32"),
    ("rms_norm", "probe", {"supports": "yes"}, r"supports must be callable"),
    ("rms_norm", "probe", {"priority": {"cpu": "high"}}, r"priority must map device types to ints"),
])
def test_register_refuses_bad_names_and_arguments(op, name, kwargs, message):
    before = registry.operators(), [i.name for i in registry.all_implementations("rms_norm")]
    with pytest.raises((ValueError, TypeError), match=message):
        registry.register(op, name, **kwargs)(lambda *a: None)
    assert (registry.operators(), [i.name for i in registry.all_implementations("rms_norm")]) == before


def test_registering_a_name_again_replaces_it_and_dispatch_sees_the_new_one():
    registry.register("rms_norm", "probe", devices=("cpu",), priority={"cpu": 50})(lambda x, w, e: x * 0 + 1)
    try:
        assert (ops.rms_norm(x, w) == 1).all()
        registry.register("rms_norm", "probe", devices=("cpu",), priority={"cpu": 50})(lambda x, w, e: x * 0 + 2)
        assert [i.name for i in registry.all_implementations("rms_norm")].count("probe") == 1
        assert (ops.rms_norm(x, w) == 2).all()  # the cached choice was dropped
    finally:
        registry.unregister("rms_norm", "probe")
    torch.testing.assert_close(ops.rms_norm(x, w), ops.run("rms_norm", "vendor", x, w))


def test_the_dispatch_cache_does_not_keep_quantized_weights_alive():
    codes = torch.randint(0, 16, (8, 64))
    weight = ops.Int4Weight(codes, torch.rand(8, 2), torch.rand(8, 2), 32)
    a = torch.randn(2, 64)
    first = ops.linear_int4(a, weight)
    torch.testing.assert_close(ops.linear_int4(a, weight), first)  # the cached path
    ref = weakref.ref(weight)
    del weight
    gc.collect()
    assert ref() is None
    other = ops.Int4Weight(torch.randint(0, 16, (4, 32)), torch.rand(4, 1), torch.rand(4, 1), 32)
    assert ops.linear_int4(torch.randn(2, 32), other).shape == (2, 4)  # a new weight validates afresh


# ------------------------------------------------------------------ tuning tables
BAD_TABLES = {
    "not json": ("{not json", "cannot read the tuning table"),
    "a list": ("[1, 2]", "not a tuning table (a JSON list"),
    "another format": (json.dumps({"format": 99, "entries": []}), "tuning table format 99, expected 1"),
    "entries not a list": (json.dumps({"format": 1, "entries": {}}), "'entries' must be a list"),
    "entry without device": (json.dumps({"format": 1, "entries": [{"op": "rms_norm", "dtype": "float32", "bucket": [4, 8],
                                                                    "impl": "vendor"}]}), "entry 0 needs a string 'device'"),
    "bucket not ints": (json.dumps({"format": 1, "entries": [{"op": "rms_norm", "device": "cpu", "dtype": "float32",
                                                               "bucket": "4x8", "impl": "vendor"}]}), "'bucket' as a list"),
}


@pytest.mark.parametrize("body,message", list(BAD_TABLES.values()), ids=list(BAD_TABLES))
def test_an_unreadable_user_tuning_cache_is_skipped_with_a_warning_naming_it(own_cache, body, message):
    path = tuning.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(body)
    with pytest.raises(ValueError) as error:
        tuning.read_table(path)
    assert str(path) in str(error.value) and message in str(error.value)
    tuning.reload()
    with pytest.warns(UserWarning, match="ignoring a tuning table") as caught:
        out = ops.rms_norm(x, w)
    assert str(path) in str(caught[0].message)
    torch.testing.assert_close(out, ops.run("rms_norm", "vendor", x, w))


def test_recording_over_an_unreadable_cache_keeps_it_aside_and_writes_a_good_one(own_cache):
    path = tuning.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text("{truncated")
    entry = {"op": "softmax", "device": "Card", "dtype": "float16", "bucket": [1, 64], "impl": "vendor"}
    with pytest.warns(UserWarning, match="replacing an unreadable tuning table"):
        tuning.record([entry])
    assert list(tuning.read_table(path).values()) == [entry]
    assert path.with_name(path.name + ".bad").read_text() == "{truncated"
    with pytest.raises(ValueError, match=r"tuning.record: entry 0 needs a string 'impl'"):
        tuning.record([{"op": "softmax", "device": "Card", "dtype": "float16", "bucket": [1, 64]}])
    assert list(tuning.read_table(path).values()) == [entry]


BARRIER = """
import pathlib, sys, time
def barrier(folder, who, count):  # every process ready before any starts writing
    folder = pathlib.Path(folder)
    (folder / f"ready-{who}").touch()
    while len(list(folder.glob("ready-*"))) < count:
        time.sleep(0.001)
"""

WRITER = BARRIER + """
from ninefold.ops import tuning
path, who, n, sync, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
barrier(sync, who, count)
for i in range(n):
    tuning.record([{"op": "softmax", "device": who, "dtype": "float32", "bucket": [i, 8], "impl": "vendor"}], path)
"""


def test_processes_recording_at_once_keep_every_entry(tmp_path):
    path, sync, n = tmp_path / "shared.json", tmp_path / "sync", 30
    sync.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), who, str(n), str(sync), "3"],
                              stderr=subprocess.PIPE, text=True) for who in ("A", "B", "C")]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    table = tuning.read_table(path)
    assert sorted(table) == sorted(("softmax", who, "float32", (i, 8)) for who in "ABC" for i in range(n))
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


STORE = BARRIER + """
from ninefold.ops.choice_cache import ChoiceCache
who, n, sync = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cache = ChoiceCache("review", "NINEFOLD_REVIEW_AUTOTUNE")
cache.choices()  # read before the others write: what they store must not be lost
barrier(sync, who, 2)
for i in range(n):
    cache.store(f"{who}-{i}", [i, who])
"""


def test_choice_caches_stored_by_several_processes_keep_every_choice(tmp_path):
    env = {**os.environ, "NINEFOLD_CACHE_DIR": str(tmp_path)}
    sync, n = tmp_path / "sync", 30
    sync.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", STORE, who, str(n), str(sync)], env=env,
                              stderr=subprocess.PIPE, text=True) for who in ("A", "B")]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    (path,) = (tmp_path / "ops").glob("review-*.json")
    choices = json.loads(path.read_text())["choices"]
    assert choices == {f"{who}-{i}": [i, who] for who in "AB" for i in range(n)}


# ------------------------------------------------------------------ trimmed builds
def test_a_bad_target_on_the_command_line_is_named(tmp_path, capsys):
    from ninefold.cli.main import main

    (tmp_path / "ops.toml").write_text('[ops.rms_norm]\nimpls = ["vendor"]\n')
    code = main(["ops", "build", "--manifest", str(tmp_path / "ops.toml"), "--out", str(tmp_path / "b"),
                 "--target", "sm_90"])
    assert code != 0
    assert "--target: target must be 'cpu' or a GPU like 'cuda:90' (or 'hip:gfx942'), got 'sm_90'" in capsys.readouterr().err
    assert not (tmp_path / "b" / "manifest.json").exists()


@pytest.mark.parametrize("manifest,message", [
    ({"ops": {"rms_norm": {"dtypes": ["float32"]}}}, "ops.rms_norm.impls must be a list of names, got None"),
    ({"ops": {"rms_norm": {"dtypes": ["int8"], "impls": ["vendor"]}}}, "ops.rms_norm.dtypes lists ['int8']"),
    ({"ops": {"rms_norm": ["vendor"]}}, "ops.rms_norm must be an object"),
    ({"ops": {}, "fallback": "cpu"}, "fallback must be one of ('error', 'vendor'), got 'cpu'"),
    ({"ops": {}, "target": "sm90"}, "target 'sm90' is not 'cpu' or a GPU"),
    ([1], "a JSON list, not an object"),
])
def test_a_malformed_build_manifest_is_refused_when_loaded(tmp_path, manifest, message):
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as error:
        build.Build.load(tmp_path)
    assert str(tmp_path / "manifest.json") in str(error.value) and message in str(error.value)
    run = _python("import torch, ninefold.ops as ops\nops.rms_norm(torch.ones(2, 4), torch.ones(4))",
                  {"NINEFOLD_OPS_BUILD": str(tmp_path)}, check=False)
    assert run.returncode != 0 and message in run.stderr and "is not a build manifest" in run.stderr


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a machine where the Triton kernels do not register")
def test_a_kept_operator_whose_kernels_this_machine_lacks_is_not_called_missing_from_the_build(tmp_path):
    manifest = {"target": "cuda:90", "fallback": "error", "uncovered": "jit", "shapes": "tiny",
                "ops": {"silu_and_mul": {"dtypes": ["float32"], "impls": ["triton"]},
                        "rms_norm": {"dtypes": ["float32"], "impls": ["vendor"]}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    run = _python("""
        import torch, ninefold.ops as ops
        print(ops.rms_norm(torch.ones(2, 4), torch.ones(4)).sum().item())
        for call in (lambda: ops.silu_and_mul(torch.ones(2, 8)), lambda: ops.softmax(torch.ones(2, 8))):
            try:
                call()
            except ops.UnsupportedError as error:
                print(error)
    """, {"NINEFOLD_OPS_BUILD": str(tmp_path)})
    total, kept, absent = run.stdout.strip().splitlines()
    assert round(float(total), 3) == 8.0
    assert kept.startswith(f"silu_and_mul: the trimmed build at {tmp_path} (NINEFOLD_OPS_BUILD) keeps its "
                           "implementations triton for float32, and none of them is available in this process")
    assert "not part of the trimmed build" not in kept
    assert absent.startswith("softmax: not part of the trimmed build at ") and absent.endswith("it holds: rms_norm")


def test_a_failed_rebuild_leaves_no_manifest_of_the_old_build(tmp_path):
    pytest.importorskip("triton")
    (tmp_path / "ops.toml").write_text('target = "cpu"\n[ops.rms_norm]\ndtypes = ["float32"]\nimpls = ["vendor"]\n')
    out = tmp_path / "b"
    build.build(tmp_path / "ops.toml", out)
    assert build.Build.load(out).ops == {"rms_norm": {"dtypes": ["float32"], "impls": ["vendor"]}}
    (out / "kernels").write_text("in the way")  # the rebuild cannot write its binaries
    (tmp_path / "ops.toml").write_text('target = "cuda:90"\nshapes = "tiny"\n[ops.rms_norm]\ndtypes = ["float32"]\n'
                                       'impls = ["triton"]\n')
    with pytest.raises(OSError):
        build.build(tmp_path / "ops.toml", out)
    with pytest.raises(ValueError, match="holds no manifest.json"):
        build.Build.load(out)


# ------------------------------------------------------------------ AOT artifacts
@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    pytest.importorskip("triton")
    from ninefold.dsl import aot, examples

    kernel = examples.add_kernel()
    directory = tmp_path_factory.mktemp("aot")
    x = torch.empty(4096, dtype=torch.float16)
    aot.compile(kernel, [(x, x, x)], target="cuda:90", out=directory)
    return kernel, directory


def _copy(directory, tmp_path):
    import shutil

    shutil.copytree(directory, tmp_path / "a")
    return tmp_path / "a", json.loads((tmp_path / "a" / "add_0.json").read_text())


def test_artifacts_record_the_cubin_digest_and_load(artifacts):
    from ninefold.dsl import aot

    kernel, directory = artifacts
    meta = json.loads((directory / "add_0.json").read_text())
    import hashlib

    assert meta["cubin_sha256"] == hashlib.sha256((directory / meta["cubin"]).read_bytes()).hexdigest()
    assert aot.load(directory).artifacts[0].meta == meta


@pytest.mark.parametrize("damage,message", [
    ("json", "add_0.json: cannot be read"),
    ("missing cubin", "its cubin {cubin} is missing or unreadable"),
    ("not a cubin", "{cubin} is not a cubin (no ELF header)"),
    ("flipped byte", "{cubin} is corrupt (its SHA-256 differs"),
    ("format", "format 7, this ninefold reads format 1"),
    ("target", "target 'sm90' is not a CUDA target like 'cuda:90'"),
    ("fields", "fields ['grid'] are missing"),
])
def test_damaged_artifacts_are_refused_naming_the_file(artifacts, tmp_path, damage, message):
    from ninefold.dsl import aot

    kernel, directory = artifacts
    copy, meta = _copy(directory, tmp_path)
    cubin = copy / meta["cubin"]
    if damage == "json":
        (copy / "add_0.json").write_text('{"format": 1, "kern')
    elif damage == "missing cubin":
        cubin.unlink()
    elif damage == "not a cubin":
        cubin.write_bytes(b"<html>404</html>")
    elif damage == "flipped byte":
        data = bytearray(cubin.read_bytes())
        data[len(data) // 2] ^= 0xFF
        cubin.write_bytes(bytes(data))
    else:
        if damage == "format":
            meta["format"] = 7
        elif damage == "target":
            meta["target"] = "sm90"
        else:
            del meta["grid"]
        (copy / "add_0.json").write_text(json.dumps(meta))
    expected = message.format(cubin=cubin)
    for call in (lambda: aot.load(copy), lambda: aot.register(copy)):
        with pytest.raises(ValueError) as error:
            call()
        assert expected in str(error.value) and str(copy / "add_0.json") in str(error.value)
    aot.unregister_all()
    assert aot.find(kernel, (torch.empty(64, dtype=torch.float16),) * 3, {}) is None


def test_an_artifact_for_another_gpu_names_both_targets(artifacts):
    from ninefold.dsl import aot

    assert aot.target_problem("cuda:90", (9, 0)) is None
    assert aot.target_problem("cuda:90", (8, 0)) == "compiled for cuda:90, this GPU is cuda:80"
    assert aot.target_problem("cuda:90", (10, 0)) == "compiled for cuda:90, this GPU is cuda:100"
    kernel, directory = artifacts
    artifact = aot.load(directory).artifacts[0]
    assert artifact.target_problem((torch.empty(8, dtype=torch.float16),) * 3) is None  # CPU tensors: no GPU


def test_a_build_with_a_damaged_dsl_artifact_fails_naming_it(tmp_path):
    pytest.importorskip("triton")
    (tmp_path / "ops.toml").write_text('target = "cuda:90"\nshapes = "tiny"\n[ops.softmax]\ndtypes = ["float16"]\n'
                                       'impls = ["dsl", "vendor"]\n')
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    (cubin,) = (tmp_path / "b" / "kernels" / "dsl" / "softmax" / "float16").glob("*.cubin")
    assert _python("import torch, ninefold.ops as ops\nops.softmax(torch.ones(2, 8).half())",
                   {"NINEFOLD_OPS_BUILD": str(tmp_path / "b")}).returncode == 0
    cubin.unlink()
    run = _python("import torch, ninefold.ops as ops\nops.softmax(torch.ones(2, 8).half())",
                  {"NINEFOLD_OPS_BUILD": str(tmp_path / "b")}, check=False)
    assert run.returncode != 0 and f"its cubin {cubin} is missing" in run.stderr


def test_tune_takes_one_operator_name_and_refuses_an_empty_list():
    from ninefold.ops.tune import tune

    # a str was split into letters ('r', 'm', 's', ...), and [] meant "every operator"
    with pytest.raises(ValueError, match=r"ops: empty"):
        tune([], device="cpu", dtypes=(torch.float32,), progress=False)
    with pytest.raises(ValueError, match=r"unknown operator\(s\) rmsnorm"):
        tune("rmsnorm", device="cpu", dtypes=(torch.float32,), progress=False)


def test_workload_cases_of_an_unknown_operator_name_it():
    from ninefold.ops import workloads

    with pytest.raises(ValueError, match=r"op: 'nope' has no workloads; known: .*rms_norm"):
        next(workloads.cases("nope", workloads.shapes("llama-8b"), "cpu", torch.float32))


@pytest.mark.parametrize("target", ["cuda:abc", "cuda:9x", "cuda:"])
def test_a_cuda_target_whose_architecture_is_not_a_number_is_named(target):
    pytest.importorskip("triton")
    from ninefold.ops.triton.aot import parse_target

    with pytest.raises(ValueError, match=r"--target: expected cuda:<sm>"):
        parse_target(target)
