"""The ``cpu`` backend (and, at tiny sizes, ``interpret``) on kernels a NineToothed/Triton user writes:
ragged sizes and non-contiguous inputs, ``other`` in reductions, overlapping/dilated/padded/permuted
arrangements, in-application semantics that must match Triton's (loads are values, ``+=`` rebinds,
integer ``//`` and ``%`` truncate, tensor members such as ``x.T`` and ``x.sum(axis=1)``), call-time errors.

Every numeric result is compared with torch in float64.
"""

import pytest
import torch
import torch.nn.functional as F

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor, examples
from ninefold.dsl.backends import cpu as cpu_backend

B = Symbol("B", meta=True, lower_bound=1)
BM = Symbol("BM", meta=True, lower_bound=1)
BN = Symbol("BN", meta=True, lower_bound=1)
W = Symbol("W", constexpr=True)
K, S, D, P = (Symbol(n, constexpr=True) for n in "KSDP")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _layout(t, kind):
    """``t`` as a contiguous tensor, a column-major one ("T") or a view with step 2 in every dim."""
    if kind == "contig":
        return t.clone()
    if kind == "T":
        return t.T.contiguous().T
    big = torch.full([2 * s for s in t.shape], float("nan"), dtype=t.dtype)
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


def _close(got, want, tol=1e-5):
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


# ---------------------------------------------------------------- kernels used below


def _ew_arrangement(x, y, z, BM=BM, BN=BN):
    return x.tile((BM, BN)), y.tile((BM, BN)), z.tile((BM, BN))


def _ew_application(x, y, z):
    z = x * 2 + y  # noqa: F841


elementwise = nd.make(_ew_arrangement, _ew_application, (Tensor(2), Tensor(2), Tensor(2)), name="ew")


def _row_arrangement(x, s, m, a, BM=BM):
    return x.tile((BM, W)), s.tile((BM, 1)), m.tile((BM, 1)), a.tile((BM, 1))


def _row_application(x, s, m, a):
    m = nl.max(x, axis=1, keep_dims=True)  # noqa: F841
    a = nl.argmax(x, axis=1, keep_dims=True)  # noqa: F841
    s = nl.sum(nl.where(x == float("-inf"), 0.0, x), axis=1, keep_dims=True)  # noqa: F841


row_reduce = nd.make(
    _row_arrangement, _row_application, (Tensor(2, other=float("-inf")), Tensor(2), Tensor(2), Tensor(2)), name="rows"
)


def _col_arrangement(x, m, BM=BM, BN=BN):
    t = x.tile((BM, BN)).tile((-1, 1))  # programs: column tiles; middle level: the row tiles
    t.dtype = t.dtype.squeeze(1)
    return t.squeeze(0), m.tile((BN,))


def _col_application(x, m):
    acc = nl.full(m.shape, float("-inf"), dtype=nl.float32)
    for i in range(x.shape[0]):
        acc = nl.maximum(acc, nl.max(x[i], axis=0))
    m = acc  # noqa: F841


col_max = nd.make(_col_arrangement, _col_application, (Tensor(2, other=float("-inf")), Tensor(1)), name="colmax")


def _pair_arrangement(x, y, B=B):
    return x.tile((B,)), y.tile((B,))


# ---------------------------------------------------------------- (a) ragged sizes, non-contiguous inputs


@pytest.mark.parametrize("shape", [(5, 7), (13, 3)])
def test_elementwise_ragged_and_noncontiguous(shape):
    x, y = torch.randn(shape, generator=_gen(1)), torch.randn(shape, generator=_gen(2))
    for lx, lz in [("contig", "T"), ("T", "step"), ("step", "contig")]:
        for blocks in ({"BM": 4, "BN": 4}, {"BM": 2, "BN": 8}, {}):
            z = _layout(torch.full(shape, float("nan")), lz)
            elementwise(_layout(x, lx), _layout(y, "step"), z, **blocks)
            _close(z, x.double() * 2 + y.double())


@pytest.mark.parametrize("layout", ["contig", "T", "step"])
def test_row_and_column_reductions_with_other_minus_inf(layout, monkeypatch):
    # all-negative rows: an overhang read as 0 instead of -inf would win the max
    x = -torch.rand(7, 6, generator=_gen(3)) - 0.5
    x[2, 5] = 3.0
    xv = _layout(x, layout)
    for width in (6, 8):  # 8: the tile overhangs every row by two columns
        s, m, a = torch.empty(7, 1), torch.empty(7, 1), torch.empty(7, 1, dtype=torch.int64)
        row_reduce(xv, s, m, a, BM=4, W=width)
        _close(m[:, 0], x.double().amax(1))
        _close(s[:, 0], x.double().sum(1))
        assert torch.equal(a[:, 0], x.double().argmax(1))
    monkeypatch.setattr(cpu_backend, "CHUNK_BYTES", 16)  # several chunks of programs
    monkeypatch.setattr(cpu_backend, "MAX_CHUNKS", 10**6)
    m = torch.empty(6)
    col_max(xv, m, BM=4, BN=4)
    _close(m, x.double().amax(0))


def test_matmul_with_k_loop_over_middle_level():
    mm = examples.mm_kernel(m=(1, 64), n=(1, 64), k=(1, 64))
    for M, N, Kd in [(5, 7, 9), (1, 17, 3)]:
        a, b = torch.randn(M, Kd, generator=_gen(4)), torch.randn(Kd, N, generator=_gen(5))
        for la, lb in [("T", "step"), ("step", "T")]:
            for blocks in ({"BM": 4, "BN": 4, "BK": 2}, {"BM": 2, "BN": 8, "BK": 4}):
                c = _layout(torch.full((M, N), float("nan")), "T")
                mm(_layout(a, la), _layout(b, lb), c, **blocks)
                _close(c, a.double() @ b.double(), 1e-4)


def test_reduction_over_an_expanded_input():
    def arrangement(x, out):
        return x.tile((1, -1)).squeeze(1), out.tile((1,))

    def application(x, out):
        out = nl.sum(x, axis=1)  # noqa: F841

    kernel = nd.make(arrangement, application, (Tensor(2), Tensor(1)), name="rowsum_expanded")
    column = torch.randn(6, 1, dtype=torch.float64, generator=_gen(6))
    out = torch.empty(6, dtype=torch.float64)
    kernel(column.expand(6, 8), out)  # the interpret backend gets 8 * column here
    _close(out, 8 * column[:, 0])


# ---------------------------------------------------------------- (c) overlapping, dilated, padded, permuted


def _pool1d(floor):
    def arrangement(x, y, K=K, S=S, D=D, P=P):
        t = x.pad(((0, 0), (P, P))).tile((1, K), strides=(1, S), dilation=(1, D), floor_mode=floor)
        t.dtype = t.dtype.squeeze(0)
        return t, y.tile((1, 1))

    def application(x, y):
        y = nl.max(x, axis=0)  # noqa: F841

    return nd.make(arrangement, application, (Tensor(2, other=float("-inf")), Tensor(2)), name=f"pool1d_{floor}")


POOLS = {floor: _pool1d(floor) for floor in (True, False)}


@pytest.mark.parametrize("floor", [True, False])
def test_max_pool_with_pad_overlapping_strides_and_dilation(floor):
    x = torch.randn(3, 10, generator=_gen(7))
    for k, s, d, p in [(3, 1, 1, 1), (3, 2, 1, 1), (2, 3, 1, 0), (3, 2, 2, 1), (4, 1, 2, 2)]:
        want = F.max_pool1d(x.double()[:, None], k, s, p, d, ceil_mode=not floor)[:, 0]
        y = torch.full(want.shape, float("nan"))
        POOLS[floor](_layout(x, "T"), y, K=k, S=s, D=d, P=p)
        _close(y, want)


def test_permute_flatten_and_overlapping_window_sums():
    def permuted(x, y, B=B):
        return x.permute((0, 2, 1)).flatten(1).tile((1, B)), y.tile((1, B))

    def plus_one(x, y):
        y = x + 1  # noqa: F841

    kernel = nd.make(permuted, plus_one, (Tensor(3), Tensor(2)), name="permute_flatten")
    x = torch.randn(3, 5, 4, generator=_gen(8))
    for b in (4, 32):
        y = torch.full((3, 20), float("nan"))
        kernel(x.transpose(1, 2).contiguous().transpose(1, 2), y, B=b)
        _close(y, x.double().permute(0, 2, 1).reshape(3, 20) + 1)

    def windows(x, y, K=K, S=S):
        return x.tile((K,), strides=(S,), floor_mode=True), y.tile((1,))

    def window_sum(x, y):
        y = nl.sum(x, axis=0, keep_dims=True)  # noqa: F841

    sums = nd.make(windows, window_sum, (Tensor(1), Tensor(1)), name="window_sum")
    x = torch.randn(11, generator=_gen(9))
    for k, s in [(3, 1), (4, 2), (5, 3)]:
        want = x.double().unfold(0, k, s).sum(1)
        y = torch.full(want.shape, float("nan"))
        sums(_layout(x, "step"), y, K=k, S=s)
        _close(y, want)


@pytest.mark.parametrize("backend", ["cpu", "interpret", pytest.param("triton", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_tile_level_expand_then_reduce(backend):
    # The generated Triton once dropped the expanded (stride-0) tile dimension: its load had size 1 there.
    def arrangement(x, out):
        t = x.tile((1, -1))
        t.dtype = t.dtype.expand((4, -1))  # each tile: the row repeated 4 times
        return t, out.tile((1, -1))

    def application(x, out):
        out = nl.sum(x, axis=0, keep_dims=True)  # noqa: F841

    kernel = nd.make(arrangement, application, (Tensor(2), Tensor(2)), name="tile_expand")
    device = "cuda" if backend == "triton" else "cpu"
    x = torch.randn(3, 5, generator=_gen(10)).to(device)
    out = torch.empty(3, 5, device=device)
    kernel(x, out, backend=backend)
    _close(out.cpu(), 4 * x.double().cpu())


# ---------------------------------------------------------------- (d) control flow in the application


def test_augmented_store_scalars_where_and_constexpr_keywords():
    def axpy_arrangement(x, alpha, y, B=B):
        return x.tile((B,)), alpha, y.tile((B,))

    def axpy_application(x, alpha, y):
        y += alpha * x

    axpy = nd.make(axpy_arrangement, axpy_application, (Tensor(1), Tensor(0), Tensor(1)), name="axpy_review")
    x = torch.randn(10, generator=_gen(11))
    for alpha in (2, 0.5, torch.tensor(1.5, dtype=torch.float64)):
        y0 = torch.randn(10, generator=_gen(12))
        y = _layout(y0, "step")
        axpy(x, alpha, y, B=4)
        _close(y, y0.double() + float(alpha) * x.double())

    def select_arrangement(x, c, d, y):
        return x.tile((1, W)), c, d, y.tile((1, W))

    def select_application(x, c, d, y):
        y = nl.where(x > c, x * d, c) + x  # x read twice in one statement  # noqa: F841

    select = nd.make(
        select_arrangement, select_application,
        (Tensor(2), Tensor(0, constexpr=True), Tensor(0, constexpr=True, value=3), Tensor(2)), name="select",
    )
    x = torch.randn(3, 10, generator=_gen(13))
    xd = x.double()
    for width in (4, 16):
        y = torch.empty(3, 10)
        select(x, 0.25, y, W=width)
        _close(y, torch.where(xd > 0.25, xd * 3, 0.25) + xd)

    def rows_of_tiles(x, y, B=B):
        def arrange(t):
            t = t.tile((1, B)).tile((1, -1))
            t.dtype = t.dtype.squeeze(0)
            return t

        return arrange(x), arrange(y)

    def loop_application(x, y):
        for j in range(x.shape[0]):
            y[j] += x[j] * j

    loop = nd.make(rows_of_tiles, loop_application, (Tensor(2), Tensor(2)), name="loop_add")
    y0 = torch.randn(3, 10, generator=_gen(14))
    y = _layout(y0, "T")
    loop(x, y, B=4)
    _close(y, y0.double() + xd * (torch.arange(10) // 4))


def _keep_old(x, y):
    old = x
    x = old + 1  # noqa: F841
    y = old  # noqa: F841


keep_old = nd.make(_pair_arrangement, _keep_old, (Tensor(1), Tensor(1)), name="keep_old")


def test_a_loaded_value_survives_a_store_to_its_parameter():
    x = torch.arange(16, dtype=torch.float32)
    x0 = x.clone()
    y = torch.empty(16)
    keep_old(x, y, B=4)  # 16 % 4 == 0: the tile is a plain view of x
    _close(x, x0 + 1)
    _close(y, x0)


def _scale_local(x, y):
    t = x
    t *= 2
    y = t + x  # noqa: F841


scale_local = nd.make(_pair_arrangement, _scale_local, (Tensor(1), Tensor(1)), name="scale_local")


@pytest.mark.parametrize("n", [16, 10])
def test_augmented_assignment_to_a_local_copy_of_a_parameter(n):
    x = torch.arange(n, dtype=torch.float32)
    x0 = x.clone()
    y = torch.empty(n)
    scale_local(x, y, B=4)  # Triton (interpret): y == 3 * x and x unchanged
    assert torch.equal(x, x0), "the kernel overwrote its input"
    _close(y, 3 * x0.double())


def _alias_accumulator(x, y):
    acc = nl.full(y.shape, 1.0, dtype=nl.float32)
    previous = acc
    acc += x
    y = acc - previous  # noqa: F841


alias_accumulator = nd.make(_pair_arrangement, _alias_accumulator, (Tensor(1), Tensor(1)), name="alias_acc")


def test_augmented_assignment_rebinds_instead_of_mutating():
    x = torch.randn(8, generator=_gen(15))
    y = torch.empty(8)
    alias_accumulator(x, y, B=4)
    _close(y, x.double())


def _transpose_in_place(x, B=B):
    return (x.tile((B, B)),)


def _trans_application(x):
    x = nl.trans(x)  # noqa: F841


transpose_tiles = nd.make(_transpose_in_place, _trans_application, (Tensor(2),), name="transpose_tiles")


def test_store_the_transpose_of_a_tile_back_in_place():
    x = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    want = x.double().reshape(2, 4, 2, 4).transpose(1, 3).reshape(8, 8)
    transpose_tiles(x, B=4)
    _close(x, want)


def _square_tiles(x, y, B=B):
    return x.tile((B, B)), y.tile((B, B))


def _dot_with_dot_T(x, y):
    y = nl.dot(x, x.T)  # noqa: F841


def _method_sum_axis(x, y):
    y = x.sum(axis=1, keep_dims=True) + x  # noqa: F841


def _method_sum_all(x, y):
    y = x - x.sum()  # noqa: F841


dot_T = nd.make(_square_tiles, _dot_with_dot_T, (Tensor(2), Tensor(2)), name="dot_T")
MEMBERS = {
    "T": (dot_T, lambda t: t @ t.transpose(-1, -2)),
    "sum_axis": (nd.make(_square_tiles, _method_sum_axis, (Tensor(2), Tensor(2)), name="sum_axis"),
                 lambda t: t.sum(-1, keepdim=True) + t),
    "sum_all": (nd.make(_square_tiles, _method_sum_all, (Tensor(2), Tensor(2)), name="sum_all"),
                lambda t: t - t.sum((-1, -2), keepdim=True)),
}


@pytest.mark.parametrize("which", list(MEMBERS))
def test_triton_tensor_members(which):
    kernel, per_tile = MEMBERS[which]
    x = torch.randn(8, 8, generator=_gen(16))
    tiles = x.double().reshape(2, 4, 2, 4).permute(0, 2, 1, 3)  # [i, j] = tile (i, j)
    y = torch.full((8, 8), float("nan"))
    kernel(x, y, B=4)  # the interpret backend computes all three
    _close(y, per_tile(tiles).permute(0, 2, 1, 3).reshape(8, 8), 1e-4)


def _int_div(x, q, r, B=B):
    return x.tile((B,)), q.tile((B,)), r.tile((B,))


def _int_div_application(x, q, r):
    q = x // 3  # noqa: F841
    r = x % 3  # noqa: F841


int_div = nd.make(_int_div, _int_div_application, (Tensor(1), Tensor(1), Tensor(1)), name="int_div")


def test_integer_division_of_negative_values_matches_triton():
    x = torch.tensor([-7, -6, -5, -1, 0, 1, 5, 7], dtype=torch.int32)
    q, r = torch.empty_like(x), torch.empty_like(x)
    int_div(x, q, r, B=8)
    assert torch.equal(q, torch.div(x, 3, rounding_mode="trunc"))
    assert torch.equal(r, torch.fmod(x, 3))


def test_interpret_backend_agrees_at_tiny_sizes():
    """The same semantics under Triton's interpreter (the reference the cpu backend follows)."""
    x = torch.arange(16, dtype=torch.float32)
    x0 = x.clone()
    y = torch.empty(16)
    keep_old(x, y, B=4, backend="interpret")
    _close(x, x0 + 1)
    _close(y, x0)
    x = torch.randn(8, 8, generator=_gen(16))
    tiles = x.double().reshape(2, 4, 2, 4).permute(0, 2, 1, 3)
    for kernel, per_tile in MEMBERS.values():
        y = torch.empty(8, 8)
        kernel(x, y, B=4, backend="interpret")
        _close(y, per_tile(tiles).permute(0, 2, 1, 3).reshape(8, 8), 1e-4)
    x = torch.arange(16, dtype=torch.float32)
    y = torch.empty(16)
    scale_local(x, y, B=4, backend="interpret")
    assert torch.equal(x, torch.arange(16, dtype=torch.float32))
    _close(y, 3 * x.double())
    x = torch.randn(8, generator=_gen(15))
    alias_accumulator(x, y[:8], B=4, backend="interpret")
    _close(y[:8], x.double())
    x = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    want = x.double().reshape(2, 4, 2, 4).transpose(1, 3).reshape(8, 8)
    transpose_tiles(x, B=4, backend="interpret")
    _close(x, want)
    x = torch.tensor([-7, -6, -5, -1, 0, 1, 5, 7], dtype=torch.int32)
    q, r = torch.empty_like(x), torch.empty_like(x)
    int_div(x, q, r, B=8, backend="interpret")
    assert torch.equal(q, torch.div(x, 3, rounding_mode="trunc")) and torch.equal(r, torch.fmod(x, 3))
    pool = POOLS[False]
    x = torch.randn(2, 10, generator=_gen(17))
    y = torch.empty(2, 5)
    pool(x, y, K=3, S=2, D=2, P=1, backend="interpret")
    _close(y, F.max_pool1d(x.double()[:, None], 3, 2, 1, 2, ceil_mode=True)[:, 0])


def _store_through_alias(x, y, z):
    t = x
    y = t * 2  # noqa: F841
    z = t + 1  # noqa: F841


store_through_alias = nd.make(
    lambda x, y, z, B=B: (x.tile((B,)), y.tile((B,)), z.tile((B,))), _store_through_alias,
    (Tensor(1), Tensor(1), Tensor(1)), name="store_through_alias",
)


@pytest.mark.parametrize("overlap", ["same", "shifted"])
def test_a_loaded_value_survives_a_store_through_an_aliasing_parameter(overlap):
    buffer = torch.arange(9, dtype=torch.float32)
    x, y = (buffer[:8], buffer[:8]) if overlap == "same" else (buffer[1:], buffer[:8])
    x0 = x.clone()
    z = torch.empty(8)
    store_through_alias(x, y, z, B=8)  # one program, and its tiles are plain views of the buffer
    _close(z, x0 + 1)
    _close(y, x0 * 2)


def _float_mod(x, s, y):
    y = x % 3.0  # noqa: F841


def _scalar_floordiv(x, s, y):
    y = x * 0 + s // 2  # noqa: F841


def _scalar_mod(x, s, y):
    y = x * 0 + s % 2  # noqa: F841


def _cdiv_by_4(x, s, y):
    y = nl.cdiv(x, 4)  # noqa: F841


def _with_scalar(x, s, y, B=B):
    return x.tile((B,)), s, y.tile((B,))


# Triton's results (C's fmod and truncating division), as its interpreter gives them.
C_DIVISION = {
    "float tile % 3.0": (_float_mod, torch.tensor([-7.5, -1.0, 4.0, 7.25]), [-1.5, -1.0, 1.0, 1.25]),
    "int scalar // 2": (_scalar_floordiv, torch.zeros(4, dtype=torch.int32), [-1] * 4),
    "int scalar % 2": (_scalar_mod, torch.zeros(4, dtype=torch.int32), [-1] * 4),
    "nl.cdiv(int tile, 4)": (_cdiv_by_4, torch.tensor([-5, -9, 5, 9], dtype=torch.int32), [0, -1, 2, 3]),
}


@pytest.mark.parametrize("case", list(C_DIVISION))
def test_division_and_remainder_follow_triton(case):
    application, x, want = C_DIVISION[case]
    kernel = nd.make(_with_scalar, application, (Tensor(1), Tensor(0), Tensor(1)), name="c_division")
    y = torch.zeros_like(x)
    kernel(x, -3, y, B=4)
    assert y.tolist() == want


def _count_up_to_sum(n, y):
    i = 0
    v = n
    while i < nl.sum(v):
        i += 1
    y = v * 0 + i  # noqa: F841


def _pick_by_sum(n, y):
    v = n
    y = v + 1 if nl.sum(v) > 2 else v - 1  # noqa: F841


def _pick_by_tile(n, y):
    v = n
    y = v + 1 if v > 2 else v - 1  # noqa: F841


def _per_element(n, y):
    return n.tile((1,)), y.tile((1,))


PER_PROGRAM_CONTROL = {
    "while": (_count_up_to_sum, [0, 3, 5, 1]),
    "if expression": (_pick_by_sum, [-1, 4, 6, 0]),
}


@pytest.mark.parametrize("which", list(PER_PROGRAM_CONTROL))
def test_while_and_conditional_expression_on_per_program_values(which):
    application, want = PER_PROGRAM_CONTROL[which]  # the interpret backend gives these
    kernel = nd.make(_per_element, application, (Tensor(1), Tensor(1)), name="per_program_control")
    y = torch.full((4,), -9, dtype=torch.int32)
    kernel(torch.tensor([0, 3, 5, 1], dtype=torch.int32), y)
    assert y.tolist() == want


def test_conditional_expression_on_a_tile_is_refused():
    kernel = nd.make(_pair_arrangement, _pick_by_tile, (Tensor(1), Tensor(1)), name="pick_by_tile")
    with pytest.raises(ValueError, match=r"the test of `a if test else b` is a tile of shape \(2,\).*nl\.where"):
        kernel(torch.arange(4), torch.empty(4, dtype=torch.int64), B=2)


def _pad_both_ends(x, y, B=B):
    return x.pad(((1, 1),)).tile((B,)), y.tile((B,))


def _plus_one(x, y):
    y = x + 1  # noqa: F841


@pytest.mark.parametrize("other", [None, 5.0])
def test_padded_tile_of_an_empty_source_reads_other(other):
    kernel = nd.make(_pad_both_ends, _plus_one, (Tensor(1, other=other), Tensor(1)), name="pad_empty")
    y = torch.full((2,), 7.0)
    kernel(torch.zeros(0), y, B=4)
    assert y.tolist() == [(other or 0.0) + 1] * 2


def _dot_tiles(a, b, c):
    return a.tile((-1, -1)), b.tile((-1, -1)), c.tile((-1, -1))


def _dot_application(a, b, c):
    c = nl.dot(a, b)  # noqa: F841


def test_dot_of_bfloat16_tiles_returns_the_float32_accumulator():
    dot = nd.make(_dot_tiles, _dot_application, (Tensor(2, dtype=torch.bfloat16), Tensor(2, dtype=torch.bfloat16),
                                                 Tensor(2, dtype=torch.float32)), name="dot_bf16")
    a = torch.randn(8, 32, generator=_gen(19)).bfloat16()
    b = torch.randn(32, 8, generator=_gen(20)).bfloat16()
    c = torch.empty(8, 8)
    dot(a, b, c)
    _close(c, a.double() @ b.double(), 1e-5)  # a bfloat16 result would be off by about 1e-2


# ---------------------------------------------------------------- (e) call-time errors


def _squeezed_rows(x, y, B=Symbol("B", meta=True)):
    return x.tile((1, B)).squeeze(1), y.tile((1, B)).squeeze(1)


def _double(x, y):
    y = x * 2  # noqa: F841


squeezed_rows = nd.make(_squeezed_rows, _double, (Tensor(2), Tensor(2)), name="squeezed_rows")
pair = nd.make(_pair_arrangement, _double, (Tensor(1), Tensor(1)), name="pair")


def test_call_errors_name_the_parameter_and_what_was_expected():
    x = torch.ones(3, 10)
    with pytest.raises(TypeError, match=r"takes 2 positional arguments \(x, y\), got 1"):
        pair(torch.ones(4))
    with pytest.raises(ValueError, match=r"argument y has 2 dims \(shape \(4, 1\)\), expected 1"):
        pair(torch.ones(4), torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"mixed devices \(x on cpu, y on meta\)"):
        pair(torch.ones(4), torch.ones(4, device="meta"))
    with pytest.raises(ValueError, match=r"argument x: squeeze: dimension 1 must have size 1, but it is 2"):
        squeezed_rows(x, torch.empty(3, 10), B=8)


def test_tuner_picks_a_block_that_satisfies_the_squeeze():
    x = torch.randn(3, 100, generator=_gen(18))
    y = torch.empty(3, 100)
    squeezed_rows(x, y)
    _close(y, 2 * x.double())


@pytest.mark.parametrize("block", [0, -2])
def test_non_positive_block_is_refused_by_name(block):
    y = torch.full((5,), 7.0)
    with pytest.raises(ValueError, match=r"\bB\b"):
        pair(torch.ones(5), y, B=block)
