"""Small hand kernels on the cpu and interpret backends against float64 torch references."""

import pytest
import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor, block_size, examples

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

add = examples.add_kernel()
row_sum = examples.row_sum_kernel(rows=(1, 8), cols=(4, 64))
mm = examples.mm_kernel(m=(16, 64), n=(16, 64), k=(16, 64))
axpy = examples.axpy_kernel()
softmax_rows = examples.softmax_rows_kernel()
BLOCK = block_size()
WIDTH = Symbol("WIDTH", constexpr=True)


def square_arrangement(x, y, BLOCK=BLOCK):
    return x.tile((BLOCK,)), y.tile((BLOCK,))


def square_application(x, y):
    y = x * x + x  # noqa: F841


square = nd.make(square_arrangement, square_application, (Tensor(1), Tensor(1)))


def random(shape, dtype, seed, noncontiguous=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    if noncontiguous:
        big = torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=torch.float64)
        big[..., ::2] = t
        t = big[..., ::2]
    return t.to(dtype)


def close(got, want, dtype, scale=1.0):
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype] * scale, rtol=TOL[dtype] * scale)


CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
BACKENDS = [("cpu", d) for d in CPU_DTYPES] + [("interpret", torch.float32), ("interpret", torch.float16)]


@pytest.mark.parametrize("backend, dtype", BACKENDS)
@pytest.mark.parametrize("blocks", [{}, {"BLOCK": 32}])
def test_vector_add(backend, dtype, blocks):
    n = 1000 if backend == "cpu" else 203
    x, y = random((n,), dtype, 0, noncontiguous=True), random((n,), dtype, 1)
    z = torch.empty(n, dtype=dtype)
    add(x, y, z, backend=backend, **blocks)
    close(z, x.double() + y.double(), dtype)


@pytest.mark.parametrize("backend, dtype", BACKENDS)
@pytest.mark.parametrize("blocks", [{}, {"ROWS": 4, "COLS": 8}])
def test_tiled_row_reduction(backend, dtype, blocks):
    x = random((37, 53), dtype, 2, noncontiguous=True)
    out = torch.empty(37, dtype=dtype)
    row_sum(x, out, backend=backend, **blocks)
    close(out, x.double().sum(1), dtype, scale=8 if dtype != torch.float64 else 1e7)  # accumulates in float32


@pytest.mark.parametrize("backend, dtype", BACKENDS)
@pytest.mark.parametrize("blocks", [{}, {"BM": 16, "BN": 32, "BK": 16}])
def test_matmul_loops_over_the_middle_level(backend, dtype, blocks):
    a = random((45, 70), dtype, 3, noncontiguous=True)
    b = random((70, 38), dtype, 4).t().contiguous().t()
    c = torch.empty(45, 38, dtype=dtype)
    mm(a, b, c, backend=backend, **blocks)
    close(c, a.double() @ b.double(), dtype, scale=10 if dtype != torch.float64 else 1e6)


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_augmented_assignment_loads_adds_and_stores(backend):
    x, y = random((77,), torch.float32, 5), random((77,), torch.float32, 6)
    want = y.double() + 2.5 * x.double()
    axpy(x, 2.5, y, backend=backend, BLOCK=16)
    close(y, want, torch.float32)


def test_parameter_read_twice_in_a_statement_is_loaded_once():
    source = square.source
    assert source.count("tl.load(") == 1
    x = random((50,), torch.float32, 7)
    y = torch.empty(50)
    square(x, y)
    close(y, x.double() ** 2 + x.double(), torch.float32)


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_jit_softmax_with_a_non_power_of_two_constexpr(backend):
    x = random((9, 21), torch.float32, 8)
    y = torch.empty_like(x)
    softmax_rows(x, y, WIDTH=21, backend=backend)
    close(y, torch.softmax(x.double(), dim=1), torch.float32)


def test_identical_makes_generate_identical_code():
    again = examples.mm_kernel(m=(16, 64), n=(16, 64), k=(16, 64))
    assert again.source == mm.source
    assert "BLOCK_SIZE" not in mm.source and "BM: tl.constexpr" in mm.source


def test_backend_from_environment(monkeypatch):
    monkeypatch.setenv("NINEFOLD_DSL_BACKEND", "nonsense")
    x = torch.ones(4)
    with pytest.raises(ValueError, match="backend"):
        add(x, x, torch.empty(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_runs_programs_in_chunks(monkeypatch, dtype):
    from ninefold.dsl.backends import cpu

    monkeypatch.setattr(cpu, "CHUNK_BYTES", 256)
    monkeypatch.setattr(cpu, "MAX_CHUNKS", 1000)
    x, y = random((1001,), dtype, 10, noncontiguous=True), random((1001,), dtype, 11)
    z = torch.empty(1001, dtype=dtype)
    add(x, y, z, BLOCK=32)
    close(z, x.double() + y.double(), dtype)
    a = random((45, 70), dtype, 12, noncontiguous=True)
    b = random((70, 38), dtype, 13)
    c = torch.empty(45, 38, dtype=dtype)
    mm(a, b, c, BM=16, BN=16, BK=16)
    close(c, a.double() @ b.double(), dtype, scale=10)
    s = random((9, 21), dtype, 14)
    t = torch.empty_like(s)
    softmax_rows(s, t, WIDTH=21)
    close(t, torch.softmax(s.double(), dim=1), dtype)
    w = random((77,), dtype, 15)
    want = w.double() + 2.5 * x[:77].double()
    axpy(x[:77], 2.5, w, BLOCK=16)
    close(w, want, dtype)


def _scaled_exp(v, factor):
    return nl.exp(v.to(nl.float32) * factor)


def helper_application(x, y):
    y = _scaled_exp(x, 0.5)  # noqa: F841


helper = nd.make(square_arrangement, helper_application, (Tensor(1), Tensor(1)))


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_application_may_call_plain_helper_functions(backend):
    x = random((300,), torch.float32, 16)
    y = torch.empty(300)
    helper(x, y, backend=backend)
    close(y, torch.exp(0.5 * x.double()), torch.float32)
    assert "@triton.jit\ndef _scaled_exp(v, factor):" in helper.source


def branch_application(x, y):
    if nl.max(x) > 0:
        y = x  # noqa: F841
    else:
        y = -x  # noqa: F841


branch = nd.make(square_arrangement, branch_application, (Tensor(1), Tensor(1)))


def test_cpu_if_on_a_per_program_value():
    x = torch.arange(1.0, 9.0)
    y = torch.empty(8)
    branch(x, y, BLOCK=4)
    assert torch.equal(y, x)
    x[:4] = -x[:4]
    with pytest.raises(ValueError, match="use nl.where"):
        branch(x, y, BLOCK=4)


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_empty_tensors_launch_nothing(backend):
    x = torch.empty(0)
    add(x, x, torch.empty(0), backend=backend)
    c = torch.full((0, 5), 1.0)
    mm(torch.empty(0, 3), torch.empty(3, 5), c, backend=backend)


def mean_arrangement(x, y):
    return x.tile((1, WIDTH)), y.tile((1, WIDTH))


def mean_application(x, y):
    centered = x - nl.sum(x) / x.shape[-1]  # the real width, not the padded one
    y = centered + nl.zeros(x.shape, dtype=nl.float32)  # noqa: F841  (padded: a valid Triton shape)


centering = nd.make(mean_arrangement, mean_application, (Tensor(2), Tensor(2)))


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_tile_shape_is_the_real_size_outside_shape_arguments(backend):
    x = random((5, 21), torch.float32, 17)
    y = torch.empty_like(x)
    centering(x, y, WIDTH=21, backend=backend)
    close(y, x.double() - x.double().mean(1, keepdim=True), torch.float32)


def bias_arrangement(x, b, y):
    return x.tile((1, WIDTH)), b.tile((WIDTH,)).unsqueeze(0).expand((x.source.shape[0], -1)), y.tile((1, WIDTH))


def bias_application(x, b, y):
    top = nl.full((), float("-inf"), dtype=nl.float32)
    top = nl.maximum(top, nl.max(x))  # a per-program scalar
    y = x + b - top  # noqa: F841  (a (WIDTH,) vector broadcasts against the (1, WIDTH) tile, as in Triton)


bias = nd.make(bias_arrangement, bias_application, (Tensor(2), Tensor(1), Tensor(2)))


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_scalars_and_lower_rank_tiles_broadcast_like_triton(backend):
    x, b = random((6, 16), torch.float32, 18), random((16,), torch.float32, 19)
    y = torch.empty_like(x)
    bias(x, b, y, WIDTH=16, backend=backend)
    close(y, x.double() + b.double() - x.double().amax(1, keepdim=True), torch.float32)


def _row_centered(v):
    return v - (nl.sum(v, axis=1) / v.shape[1])[:, None]


def centered_application(x, y):
    y = _row_centered(x.to(nl.float32))  # noqa: F841


centered = nd.make(mean_arrangement, centered_application, (Tensor(2), Tensor(2)))


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_helper_functions_index_and_measure_tiles_like_the_application(backend):
    x = random((7, 16), torch.float32, 20)
    y = torch.empty_like(x)
    centered(x, y, WIDTH=16, backend=backend)
    close(y, x.double() - x.double().mean(1, keepdim=True), torch.float32)


def scale_arrangement(x, factor, y, BLOCK=BLOCK):
    return x.tile((BLOCK,)), factor, y.tile((BLOCK,))


def scale_application(x, factor, y):
    y = x * factor  # noqa: F841


scale3 = nd.make(scale_arrangement, scale_application, (Tensor(1), Tensor(0, constexpr=True, value=3), Tensor(1)))


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_constexpr_scalar_with_a_value_is_not_passed(backend):
    x = random((50,), torch.float32, 21)
    y = torch.empty(50)
    scale3(x, y, backend=backend)
    close(y, 3 * x.double(), torch.float32)
    assert "factor = 3" in scale3.source
    with pytest.raises(TypeError, match=r"takes 2 positional arguments \(x, y\), got 3"):
        scale3(x, 3, y, backend=backend)


def reverse_tiles_arrangement(x, y, BLOCK=BLOCK):
    return x.tile((BLOCK,))[::-1], y.tile((BLOCK,))


def copy_application(x, y):
    y = x  # noqa: F841


reverse_tiles = nd.make(reverse_tiles_arrangement, copy_application, (Tensor(1), Tensor(1)))


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_programs_walking_tiles_backwards(backend):
    """A negative step on the outermost level: program i reads tile n-1-i (cpu: flipped views)."""
    x = random((64,), torch.float32, 15)
    y = torch.empty(64)
    reverse_tiles(x, y, BLOCK=16, backend=backend)
    want = x.reshape(4, 16).flip(0).reshape(64)
    close(y, want.double(), torch.float32)
