"""``linear`` through CUTLASS's Hopper GEMMs (``ninefold.ops.cutlass``): the build's toolchain checks and
generated table, the binding's refusals, and on an sm_90 GPU with a built library every configuration
and decomposition against float64, CUDA-graph replay and the tuner's persisted choice."""

import json
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

import ninefold.ops as ops
from ninefold.ops import cutlass
from ninefold.ops.cutlass import binding, build, tuning

from .helpers import decode_mlp_operands, fresh_choice_cache

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_library = pytest.mark.skipif(not HOPPER or binding.unavailable() is not None,
                                   reason="needs an sm_90 GPU and a built CUTLASS library (NINEFOLD_CUTLASS_LIB)")


def test_configurations_have_distinct_names_and_their_modes():
    names = [c.name for c in build.CONFIGS]
    assert len(set(names)) == len(names), names
    for config in build.CONFIGS:
        assert config.modes == (("data_parallel", "split_k", "stream_k") if config.scheduler == "stream_k"
                                else ("data_parallel",))
        assert f"-DNF_SWAP={int(config.swapped)}" in config.macros(0)
    want = sum(1 + len(tuning.SPLITS) + 1 if c.scheduler == "stream_k" else 1 for c in build.CONFIGS)
    assert len(tuning.candidates()) == want
    assert tuning.describe((1, "split_k", 3)) == f"{build.CONFIGS[1].name}/split_k3"


def test_dispatch_table_lists_every_configuration_in_order():
    source = build.dispatch_source()
    entries = [line.strip() for line in source.splitlines() if line.strip().startswith('{"')]
    assert entries == [f'{{"{c.name}", nf_cutlass_workspace_{i}, nf_cutlass_run_{i}}},'
                       for i, c in enumerate(build.CONFIGS)]
    assert 'extern "C" int nf_cutlass_run(int config' in source


def test_missing_toolchain_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "cutlass_library", None)
    with pytest.raises(build.BuildError, match="CUTLASS_DIR"):
        build.find_cutlass()
    for var in ("NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NVCC", str(tmp_path / "no-nvcc"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "nvidia", None)
    with pytest.raises(build.BuildError, match="nvcc not found"):
        build.find_nvcc()


def test_cutlass_version_is_read_and_old_ones_refused(tmp_path):
    (tmp_path / "cutlass").mkdir()
    header = tmp_path / "cutlass" / "version.h"
    header.write_text("#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 1\n")
    assert build.cutlass_version(tmp_path) == "4.2.1"
    header.write_text("#define CUTLASS_MAJOR 2\n#define CUTLASS_MINOR 11\n#define CUTLASS_PATCH 0\n")
    with pytest.raises(build.BuildError, match="CUTLASS 3.0 or newer"):
        build.cutlass_version(tmp_path)


def test_build_key_follows_the_sources_and_toolchain():
    key = build.build_key("13.5", "4.2.0")
    assert key == build.build_key("13.5", "4.2.0")
    assert key != build.build_key("12.8", "4.2.0") and key != build.build_key("13.5", "3.9.2")
    assert build.sources_hash(build.CONFIGS[:2]) != build.sources_hash()


def test_library_path_and_a_clear_error_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv("NINEFOLD_CUTLASS_LIB", str(tmp_path))
    assert binding.library_path() == tmp_path / build.LIBRARY
    monkeypatch.delenv("NINEFOLD_CUTLASS_LIB")
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))
    assert binding.library_path() is None
    stale = tmp_path / "cutlass" / "old"
    stale.mkdir(parents=True)
    (stale / build.LIBRARY).write_bytes(b"")
    (stale / "manifest.json").write_text(json.dumps({"key": "x", "sources": "not these sources"}))
    assert binding.library_path() is None  # built from other sources: never picked
    monkeypatch.setattr(binding, "_state", {})
    with pytest.raises(binding.CutlassError, match="python -m ninefold.ops.cutlass.build"):
        binding.library()
    assert "not built" in binding.unavailable()


def test_matmul_names_bad_arguments():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="x: expected a contiguous 2-D bfloat16 CUDA tensor"):
        binding.matmul(x, w, torch.empty(4, 8), 0)
    with pytest.raises(ValueError, match="mode: got 'fast'"):
        binding._checked(0, "fast", 1)
    with pytest.raises(ValueError, match="config: got -1"):
        binding._checked(-1, "heuristic", 1)
    with pytest.raises(ValueError, match="splits: got 0"):
        binding._checked(0, "split_k", 0)
    persistent = next(i for i, c in enumerate(build.CONFIGS) if c.scheduler == "persistent")
    with pytest.raises(ValueError, match="not 'split_k'"):
        binding._checked(persistent, "split_k", 2)
    assert binding._checked(0, "split_k", 3) == (binding.MODES["split_k"], 3)


def test_a_library_from_other_sources_is_refused(tmp_path, monkeypatch):
    (tmp_path / build.LIBRARY).write_bytes(b"not loaded")
    (tmp_path / "manifest.json").write_text(json.dumps({"key": "k", "sources": "other sources"}))
    monkeypatch.setenv("NINEFOLD_CUTLASS_LIB", str(tmp_path))
    monkeypatch.setattr(binding, "_state", {})
    with pytest.raises(binding.CutlassError, match="built from other sources"):
        binding.library()


def test_linear_on_cpu_is_f_linear():
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    assert cutlass.supports(x, w) == "CUDA tensors only"
    assert torch.equal(cutlass.linear(x, w), F.linear(x, w))
    names = [i.name for i in ops.registry.all_implementations("linear")]
    assert ("cutlass" in names) == torch.cuda.is_available(), names


def _toolchain() -> str | None:
    try:
        build.find_nvcc(), build.find_cutlass()
    except build.BuildError as error:
        return str(error)
    return None


@pytest.mark.skipif(_toolchain() is not None, reason=f"no CUTLASS toolchain: {_toolchain()}")
def test_one_configuration_builds_into_a_library(tmp_path):
    path = build.build(tmp_path, configs=build.CONFIGS[:1], quiet=True)
    assert path.is_file() and path.stat().st_size > 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["configs"] == [build.CONFIGS[0].name]
    assert manifest["sources"] == build.sources_hash(build.CONFIGS[:1])
    assert build.build(tmp_path, configs=build.CONFIGS[:1], quiet=True) == path  # up to date: reused


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    yield from fresh_choice_cache(tuning.forget, tmp_path, monkeypatch)


@needs_library
@pytest.mark.parametrize("m, n, k", [(64, 1536, 1024), (77, 1536, 1024), (200, 1544, 1032)])
def test_every_candidate_matches_float64(m, n, k):
    """Every configuration and decomposition runs, also where the sizes are no multiple of its tile (n, k: of 8 only)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    for cand in tuning.candidates():
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        binding.matmul(x, w, out, *cand)
        err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-2, (tuning.describe(cand), err)


@needs_library
def test_matmul_refuses_misaligned_and_mismatched_operands():
    x = torch.randn(64, 264, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x: starts at an address 2 bytes past"):
        binding.matmul(x.view(-1)[1:].as_strided((64, 256), (256, 1)), w, out, 0)
    with pytest.raises(ValueError, match="shapes: x"):
        binding.matmul(x, w, out, 0)
    with pytest.raises(ValueError, match="config: got 99"):
        binding.matmul(x[:, :256].contiguous(), w, out, 99)
    with pytest.raises(ValueError, match="splits: got 2"):
        binding.matmul(x[:, :256].contiguous(), w, out, 0, "stream_k", 2)
    persistent = next(i for i, c in enumerate(build.CONFIGS) if c.scheduler == "persistent")
    with pytest.raises(ValueError, match="mode: .* not 'stream_k'"):
        binding.matmul(x[:, :256].contiguous(), w, out, persistent, "stream_k")


@needs_library
def test_linear_runs_the_persisted_configuration(fresh_cache, monkeypatch):
    from ninefold.ops.dispatch import device_model

    m, n, k = 96, 2048, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
    pick = next(c for c in tuning.candidates() if c[1] == "data_parallel")  # deterministic: two runs, same bits
    tuning.CACHE.store(tuning.key(device_model(x.device), m, n, k), list(pick))
    tuning.forget()  # read back from the file, as a new process would
    want = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    binding.matmul(x, w, want, *pick)
    ran = []
    real = binding.matmul
    monkeypatch.setattr(binding, "matmul", lambda *a, **kw: ran.append(a[3:]) or real(*a, **kw))
    got = cutlass.linear(x, w)
    assert ran == [pick]  # the persisted candidate, not F.linear
    assert torch.equal(got, want)


@needs_library
def test_stream_k_replays_in_a_cuda_graph():
    m, n, k = 160, 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cand = next(c for c in tuning.candidates() if c[1] == "stream_k")
    binding.matmul(x, w, out, *cand)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        binding.matmul(x, w, out, *cand)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        want = x.float() @ w.float().T
        assert (out.float() - want).abs().max().item() < 2e-2 * want.abs().max().item()


@needs_library
def test_tuning_persists_and_linear_uses_it(fresh_cache):
    m, n, k = 192, 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    assert tuning.choice(m, n, k, x.device) is None  # outside autotune: not tuned, F.linear
    assert tuning.choice(8, n, k, x.device) is None  # below TUNED_ROWS: never tuned
    result = tuning.tune(m, n, k, x.device, progress=False)
    assert tuning.VENDOR in result["times_us"] and all(t > 0 for t in result["times_us"].values())
    assert len(list((fresh_cache / "ops").glob("cutlass-*.json"))) == 1
    tuning.forget()
    picked = tuning.choice(m, n, k, x.device)  # read back from the file
    assert picked == (None if result["choice"] == tuning.VENDOR else tuple(result["choice"]))
    got, want = cutlass.linear(x, w), F.linear(x, w)
    assert (got.float() - want.float()).abs().max().item() < 2e-2 * want.float().abs().max().item()
    with ops.use(linear="cutlass"):
        assert ops.choose("linear", x, w) == "cutlass"
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(cutlass.linear(x, w, b), F.linear(x, w, b))  # a bias: F.linear


def _decode_chain(x, residual, gain, w_up, w_down, configs, pdl):
    """add+RMSNorm, gate_up GEMM, SwiGLU, down GEMM, add+RMSNorm: a batched decode step's MLP half."""
    from ninefold.ops.triton import activation, norm

    h, residual = norm.add_rms_norm(x, residual, gain, 1e-5)
    up = torch.empty(h.shape[0], w_up.shape[0], device="cuda", dtype=torch.bfloat16)
    binding.matmul(h, w_up, up, configs[0], "data_parallel", 1, pdl=pdl)
    a = activation.silu_and_mul(up)
    down = torch.empty(a.shape[0], w_down.shape[0], device="cuda", dtype=torch.bfloat16)
    binding.matmul(a, w_down, down, configs[1], "data_parallel", 1, pdl=pdl)
    return norm.add_rms_norm(down, residual, gain, 1e-5)


@needs_library
@pytest.mark.parametrize("rows", [64, 200])
def test_pdl_launches_give_the_plain_launches_bits_eagerly_and_in_a_cuda_graph(rows, monkeypatch):
    """GEMMs launched with PDL between PDL row kernels wait for their inputs: the same bits as plain launches."""
    pytest.importorskip("triton")
    from ninefold.ops.triton import pdl

    if not pdl.wanted(torch.device("cuda"), "NINEFOLD_ROWS_PDL"):
        pytest.skip("PDL is not available on this card or Triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    d, f = 4096, 3584
    x, residual, gain, w_up, w_down = decode_mlp_operands(rows, d, f, g)
    pingpong = [i for i, c in enumerate(build.CONFIGS) if c.schedule == "pingpong" and c.pdl]
    cooperative = [i for i, c in enumerate(build.CONFIGS) if c.schedule == "cooperative" and c.pdl]
    for configs in ((pingpong[0], pingpong[-1]), (cooperative[0], cooperative[-1])):
        def plain(configs=configs):
            monkeypatch.setenv("NINEFOLD_ROWS_PDL", "0")
            out = _decode_chain(x, residual, gain, w_up, w_down, configs, pdl=False)
            monkeypatch.setenv("NINEFOLD_ROWS_PDL", "1")
            return out

        want = plain()
        got = _decode_chain(x, residual, gain, w_up, w_down, configs, pdl=True)
        for a, b in zip(got, want):
            assert torch.equal(a, b), [build.CONFIGS[c].name for c in configs]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _decode_chain(x, residual, gain, w_up, w_down, configs, pdl=True)
        for _ in range(3):
            x.copy_(torch.randn(rows, d, device="cuda", generator=g).to(torch.bfloat16))
            graph.replay()
            want = plain()
            torch.cuda.synchronize()
            for a, b in zip(captured, want):
                assert torch.equal(a, b), [build.CONFIGS[c].name for c in configs]


@needs_library
def test_linear_launches_with_pdl_only_when_asked_and_available(fresh_cache, monkeypatch):
    pytest.importorskip("triton")
    from ninefold.ops.dispatch import device_model
    from ninefold.ops.triton import pdl

    m, n, k = 96, 2048, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
    pick = next(c for c in tuning.candidates() if c[1] == "data_parallel")
    tuning.CACHE.store(tuning.key(device_model(x.device), m, n, k), list(pick))
    tuning.forget()
    flags = []
    real = binding.matmul
    monkeypatch.setattr(binding, "matmul", lambda *a, **kw: flags.append(kw.get("pdl")) or real(*a, **kw))
    monkeypatch.delenv("NINEFOLD_CUTLASS_PDL", raising=False)
    cutlass.linear(x, w)  # off by default
    monkeypatch.setenv("NINEFOLD_CUTLASS_PDL", "1")
    want = pdl.wanted(x.device, "NINEFOLD_CUTLASS_PDL")
    cutlass.linear(x, w)
    assert flags == [False, want]


def test_min_gain_is_read_from_the_environment_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv("NINEFOLD_CUTLASS_MIN_GAIN", raising=False)
    assert tuning.min_gain() == tuning.MIN_GAIN
    monkeypatch.setenv("NINEFOLD_CUTLASS_MIN_GAIN", "-0.1")
    assert tuning.min_gain() == -0.1
    for bad in ("1.5", "fast", "-1"):
        monkeypatch.setenv("NINEFOLD_CUTLASS_MIN_GAIN", bad)
        with pytest.raises(ValueError, match=f"NINEFOLD_CUTLASS_MIN_GAIN: got '{bad}'"):
            tuning.min_gain()
