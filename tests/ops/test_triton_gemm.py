"""The split-K Triton GEMM behind ``linear`` for 17..512 rows: float64 parity in the interpreter
(every split, ragged M/N/K, bias, strided rows), sm_90 compilation, candidate sets and the tuner."""

import pytest
import torch

triton = pytest.importorskip("triton")

from .helpers import run_interpreted  # noqa: E402

# Runs in a child process with TRITON_INTERPRET=1 (set before Triton is imported).
CHECK = r"""
import torch
from ninefold.ops.triton import gemm, gemm_tuning
torch.manual_seed(0)
cases = [  # m, n, k, bias, (block_m, block_n, block_k, split_k)
    (17, 40, 64, False, (16, 16, 16, 1)),
    (18, 40, 64, False, (16, 16, 16, 2)),   # even m: rows with a padded stride (TMA: 16-byte aligned)
    (33, 50, 200, True, (16, 32, 32, 7)),   # K not a multiple of BLOCK_K: the last step is masked
    (20, 24, 96, False, (32, 16, 16, 3)),   # one row tile wider than M
    (48, 64, 256, True, (16, 16, 32, 4)),
    (40, 30, 80, False, (16, 16, 16, 5)),   # one step per split
]
count = gemm.counters(torch.device("cpu"))
for m, n, k, with_bias, (bm, bn, bk, split) in cases:
    x = torch.randn(m, k) if m % 2 else torch.randn(m, k + 8)[:, :k]  # even m: rows with a padded stride
    w = torch.randn(n, k)
    b = torch.randn(n) if with_bias else None
    assert gemm.supports(x, w, b) is None, gemm.supports(x, w, b)
    for tma in (False, True):
        cfg = {"block_m": bm, "block_n": bn, "block_k": bk, "split_k": split, "num_warps": 4, "num_stages": 2,
               "tma": tma}
        with gemm_tuning.forced(cfg):
            y = gemm.linear(x, w, b)
        ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
        err = (y.double() - ref).abs().max().item()
        assert y.shape == (m, n) and y.dtype == torch.float32, (y.shape, y.dtype)
        assert err < 1e-3 * k ** 0.5, (m, n, k, split, tma, err)
        assert int(count.abs().sum()) == 0, "arrival counters not reset"
x = torch.randn(3, 7, 40)
w = torch.randn(24, 40)
with gemm_tuning.forced({"block_m": 16, "block_n": 16, "block_k": 16, "split_k": 3, "num_warps": 4, "num_stages": 2}):
    y = gemm.linear(x, w)
assert y.shape == (3, 7, 24) and torch.allclose(y, x @ w.T, atol=1e-4)
try:
    with gemm_tuning.forced({"block_m": 16, "block_n": 16, "block_k": 16, "split_k": 3, "num_warps": 4,
                             "num_stages": 2}):
        gemm.linear(x, w)  # 40 = 3 steps of 16 (the last partial) split 3 ways: fine
        gemm.linear(torch.randn(20, 64), torch.randn(24, 64))  # 4 steps cannot split 3 ways
    raise AssertionError("a split that does not divide K's steps was accepted")
except ValueError as error:
    assert "split_k=3" in str(error) and "4 steps" in str(error), error
with gemm_tuning.forced("vendor"):
    assert torch.equal(gemm.linear(x, w), torch.nn.functional.linear(x, w))
print("gemm ok")
"""


def test_gemm_matches_float64_in_the_interpreter():
    run = run_interpreted(["-c", CHECK], timeout=300)
    assert "gemm ok" in run.stdout, run.stdout[-2000:]


def test_supports_names_the_rows_and_layout():
    from ninefold.ops.triton import gemm

    w = torch.randn(24, 40)
    assert gemm.supports(torch.randn(17, 40), w) is None
    assert "16 rows" in gemm.supports(torch.randn(16, 40), w)
    assert "513 rows" in gemm.supports(torch.randn(513, 40), w)
    assert "contiguous" in gemm.supports(torch.randn(40, 32).T, w)


def test_candidates_cover_the_sms_and_respect_the_k_steps():
    from ninefold.ops.triton import gemm_tuning

    for m, n, k in ((192, 4096, 4096), (256, 4096, 14336), (32, 6144, 4096), (512, 28672, 4096)):
        found = gemm_tuning.candidates(m, n, k, sms=132)
        assert found, (m, n, k)
        with_tma = gemm_tuning.candidates(m, n, k, sms=132, tma=True)
        assert len(with_tma) == 2 * len(found) and sum(c["tma"] for c in with_tma) == len(found)
        assert any(c["split_k"] == 1 for c in found)
        for c in found:
            tiles = -(-m // c["block_m"]) * -(-n // c["block_n"])
            assert -(-k // c["block_k"]) % c["split_k"] == 0
            if c["split_k"] > 1:
                assert tiles * c["split_k"] <= 4 * 132
                assert -(-k // c["block_k"]) // c["split_k"] >= gemm_tuning.MIN_K_STEPS
            assert c["block_m"] <= 2 * gemm_tuning.bucket(m)
    # A 4096-wide output at 192 rows has too few 128x128 tiles for the card: split-K candidates exist.
    assert any(c["split_k"] > 1 and c["block_m"] == 128 for c in gemm_tuning.candidates(192, 4096, 4096, 132))


def test_choice_runs_cublas_where_nothing_was_measured():
    from ninefold.ops.triton import gemm_tuning

    assert gemm_tuning.choice(64, 128, 256, torch.float32, torch.device("cpu"), False) is None
    cfg = {"block_m": 64, "block_n": 64, "block_k": 64, "split_k": 2, "num_warps": 4, "num_stages": 3}
    with gemm_tuning.forced(cfg):
        assert gemm_tuning.choice(64, 128, 256, torch.bfloat16, torch.device("cpu"), False) == cfg
        with gemm_tuning.forced("vendor"):
            assert gemm_tuning.choice(64, 128, 256, torch.bfloat16, torch.device("cpu"), False) is None
    assert [gemm_tuning.bucket(m) for m in (17, 32, 33, 200)] == [32, 32, 48, 208]


@pytest.mark.parametrize("gdc", [False, True])
@pytest.mark.parametrize("split", [1, 3])
def test_gemm_compiles_for_sm90(split, gdc):
    from ninefold.ops.triton import aot, gemm

    spec = []
    for name in gemm.gemm_kernel.arg_names:
        if name in ("x_ptr", "w_ptr", "b_ptr", "y_ptr"):
            spec.append(("*bf16", "D"))
        elif name == "ws_ptr":
            spec.append(("*fp32", "D"))
        elif name == "count_ptr":
            spec.append(("*i32", "D"))
        elif name in ("M", "SPLIT_K", "SPLIT_STEPS"):
            spec.append(("i32", ""))
        elif name in ("N", "K", "stride_xm", "stride_wn", "stride_ym"):
            spec.append(("i32", "D"))
        else:
            value = {"HAS_BIAS": False, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "EVEN_K": True,
                     "PRECISION": "tf32", "USE_GDC": gdc}[name]
            spec.append(("constexpr", value))
    compiled = aot.compile_spec(gemm.gemm_kernel, spec, 8, 4, aot.parse_target("cuda:90"))
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx
    assert "wgmma" in ptx or "mma" in ptx
    assert "atom" in ptx  # the arrival counter
    assert ("griddepcontrol.wait" in ptx) == gdc  # PDL: wait for the kernel before only when launched so


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_cuda_every_split_matches_float64_and_repeats_bit_exactly(dtype):
    from ninefold.ops.triton import gemm, gemm_tuning

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in ((192, 4096, 4096), (100, 4096, 14336), (17, 6144, 4096), (512, 1000, 4000)):
        x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
        b = torch.randn(n, device="cuda", generator=g).to(dtype)
        ref = x.double() @ w.double().T + b.double()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for cfg in gemm_tuning.candidates(m, n, k, sms, tma=gemm_tuning.tma_available(x.device)):
            with gemm_tuning.forced(cfg):
                first = gemm.linear(x, w, b)
                torch.testing.assert_close(first.double(), ref, atol=6e-2, rtol=6e-2, msg=lambda s, cfg=cfg: f"{cfg}: {s}")
                for _ in range(20):  # the last-arrival reduction is ordered: every call gives the same bits
                    assert torch.equal(gemm.linear(x, w, b), first), cfg
        assert int(gemm.counters(x.device).abs().sum()) == 0


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gemm_cuda_pdl_launch_gives_the_plain_launch_bits(monkeypatch):
    from ninefold.ops.triton import gemm, gemm_tuning, pdl

    if not pdl.wanted(torch.device("cuda"), "NINEFOLD_GEMM_PDL"):
        pytest.skip("PDL is not available on this card or Triton")
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(96, 4096, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(4096, 4096, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in gemm_tuning.candidates(96, 4096, 4096, sms, tma=gemm_tuning.tma_available(x.device)):
        with gemm_tuning.forced(cfg):
            monkeypatch.setenv("NINEFOLD_GEMM_PDL", "0")
            plain = gemm.linear(x, w)
            monkeypatch.setenv("NINEFOLD_GEMM_PDL", "1")
            # a chain of PDL launches: each reads what the one before wrote
            h = x
            for _ in range(3):
                h = gemm.linear(h, w)
            assert torch.equal(gemm.linear(x, w), plain), cfg
            monkeypatch.setenv("NINEFOLD_GEMM_PDL", "0")
            want = x
            for _ in range(3):
                want = gemm.linear(want, w)
            assert torch.equal(h, want), cfg


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_tuning_persists_and_dispatch_uses_it(tmp_path, monkeypatch):
    import ninefold.ops as ops
    from ninefold.ops.triton import gemm_tuning

    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))
    gemm_tuning.forget()
    try:
        x = torch.randn(96, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
        assert gemm_tuning.choice(96, 4096, 4096, x.dtype, x.device, False) is None  # not tuned, not allowed
        result = gemm_tuning.tune(96, 4096, 4096, x.dtype, x.device, progress=False)
        assert "vendor" in result["times_us"] and len(result["times_us"]) > 3
        assert list(tmp_path.glob("ops/gemm-*.json"))
        gemm_tuning.forget()  # a new process: read back from the file
        assert gemm_tuning.choice(96, 4096, 4096, x.dtype, x.device, False) == (
            None if result["choice"] == "vendor" else result["choice"])
        assert ops.choose("linear", x, w) == "vendor"  # below cuBLAS unless pinned or tuned by a table
        with ops.use(linear="triton_gemm"):
            assert ops.choose("linear", x, w) == "triton_gemm"
            torch.testing.assert_close(ops.linear(x, w).float(), x.float() @ w.float().T, atol=5e-2, rtol=5e-2)
    finally:
        gemm_tuning.forget()
