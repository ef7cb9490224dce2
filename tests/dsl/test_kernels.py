"""The example kernels of ninefold.ops.kernels against torch computed in float64.

Every kernel runs on the ``cpu`` backend (float32 tight, float16/bfloat16 with per-dtype
tolerances, contiguous and strided inputs, sizes that are not multiples of the blocks, with the
tuner's blocks and with small forced blocks that overhang), on the ``interpret`` backend at tiny
sizes, and on CUDA (``-k cuda``) when a GPU is present.
"""

import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from ninefold.ops.kernels import activation, add, attention, conv2d, mm, pool, rms_norm, rope, softmax

TOLERANCES = {  # (atol, rtol) per output dtype for one rounding to that dtype
    torch.float64: (1e-5, 1e-5),  # the kernels compute in float32 on purpose (reductions, dots)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def strided(t):
    """A copy of ``t`` whose last dimension has stride 2 (so the tensor is not contiguous)."""
    big = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
    big[..., ::2] = t
    view = big[..., ::2]
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


@dataclass
class Case:
    name: str
    shapes: tuple  # input shapes for the cpu backend
    run: object  # (inputs, blocks) -> output or tuple of outputs
    ref: object  # (float64 inputs, dtype under test) -> float64 output(s)
    blocks: dict = field(default_factory=dict)  # small blocks that overhang the shapes above
    tiny: tuple | None = None  # shapes for the interpret backend (default: shapes)
    scale: float = 1.0  # tolerance factor (reductions, dots)
    make: object = None  # (shape, dtype, generator) -> tensor; default randn


def _randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _positions_and_cache(t, r, gen):
    positions = torch.randint(0, 64, (t,), generator=gen)
    angles = torch.rand((64, r // 2), generator=gen, dtype=torch.float64) * 6.3
    return positions, torch.cat([angles.cos(), angles.sin()], dim=1)


def _rope_ref(x, cos, sin, interleaved):
    rot = 2 * cos.shape[1]
    if interleaved:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
    else:
        a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
    c, s = cos[:, None, :], sin[:, None, :]
    first, second = a * c - b * s, b * c + a * s
    out = x.clone()
    if interleaved:
        out[..., 0:rot:2], out[..., 1:rot:2] = first, second
    else:
        out[..., : rot // 2], out[..., rot // 2 : rot] = first, second
    return out


def _rope_run(interleaved):
    def run(inputs, blocks):
        q, k = inputs
        gen = torch.Generator().manual_seed(7)
        positions, cache = _positions_and_cache(q.shape[0], 12, gen)
        positions, cache = positions.to(q.device), cache.to(device=q.device, dtype=q.dtype)
        return rope.rope(q, k, positions, cache, is_neox=not interleaved, **blocks)

    def ref(inputs, dtype):
        q, k = inputs
        gen = torch.Generator().manual_seed(7)
        positions, cache = _positions_and_cache(q.shape[0], 12, gen)
        table = cache.to(dtype).double()[positions]  # the cache as the kernel sees it
        cos, sin = table[:, :6], table[:, 6:]
        return _rope_ref(q, cos, sin, interleaved), _rope_ref(k, cos, sin, interleaved)

    return run, ref


def _sdpa_ref(q, k, v, causal):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[-2], k.shape[-2]
        keep = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _add_rms_norm_ref(x, residual, weight, dtype):
    summed = (x + residual).to(dtype).double()  # the kernel rounds the sum to x's dtype first
    return F.rms_norm(summed, (x.shape[-1],), weight, 1e-5), summed


_rope_neox, _rope_neox_ref = _rope_run(False)
_rope_inter, _rope_inter_ref = _rope_run(True)

CASES = [
    Case(
        "add_flat",
        ((3001,), (3001,)),
        lambda i, b: add.add(*i, **b),
        lambda i, dt: i[0] + i[1],
        {"BLOCK": 1024},
        tiny=((1100,), (1100,)),
    ),
    Case(
        "add_broadcast",
        ((3, 37, 50), (50,)),
        lambda i, b: add.add(*i, **b),
        lambda i, dt: i[0] + i[1],
        {"BLOCK_M": 4, "BLOCK_N": 64},
        tiny=((9, 70), (70,)),
    ),
    Case(
        "silu",
        ((37, 150),),
        lambda i, b: activation.silu(*i, **b),
        lambda i, dt: F.silu(i[0]),
        {"BLOCK_M": 4, "BLOCK_N": 64},
        tiny=((9, 70),),
    ),
    Case(
        "silu_and_mul",
        ((5, 7, 86),),
        lambda i, b: activation.silu_and_mul(*i, **b),
        lambda i, dt: F.silu(i[0][..., :43]) * i[0][..., 43:],
        {"BLOCK_M": 4, "BLOCK_N": 64},
        tiny=((9, 86),),
    ),
    Case(
        "mm",
        ((70, 50), (50, 90)),
        lambda i, b: mm.mm(*i, **b),
        lambda i, dt: i[0] @ i[1],
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32},
        scale=4,
    ),
    Case(
        "bmm",
        ((3, 70, 50), (3, 50, 90)),
        lambda i, b: mm.bmm(*i, **b),
        lambda i, dt: i[0] @ i[1],
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32},
        tiny=((2, 70, 40), (2, 40, 65)),
        scale=4,
    ),
    Case(
        "addmm",
        ((90,), (70, 50), (50, 90)),
        lambda i, b: mm.addmm(*i, beta=0.5, alpha=-1.5, **b),
        lambda i, dt: 0.5 * i[0] + -1.5 * (i[1] @ i[2]),
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32},
        scale=6,
    ),
    Case(
        "conv2d",
        ((2, 5, 11, 9), (7, 5, 3, 3)),
        lambda i, b: conv2d.conv2d(*i, **b),
        lambda i, dt: F.conv2d(*i),
        {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64},
        tiny=((1, 3, 9, 8), (5, 3, 3, 3)),
        scale=4,
    ),
    Case(
        "conv2d_stride_pad",
        ((2, 5, 11, 9), (7, 5, 3, 2)),
        lambda i, b: conv2d.conv2d(*i, stride=(2, 1), padding=(1, 2), **b),
        lambda i, dt: F.conv2d(*i, stride=(2, 1), padding=(1, 2)),
        {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64},
        tiny=((1, 3, 9, 8), (5, 3, 3, 2)),
        scale=4,
    ),
    Case(
        "softmax",
        ((37, 150),),
        lambda i, b: softmax.softmax(*i, **b),
        lambda i, dt: torch.softmax(i[0], dim=-1),
        tiny=((9, 70),),
    ),
    Case(
        "softmax_dim0",
        ((37, 5, 6),),
        lambda i, b: softmax.softmax(i[0], dim=0, **b),
        lambda i, dt: torch.softmax(i[0], dim=0),
        tiny=((9, 3, 4),),
    ),
    Case(
        "softmax_chunked",
        ((5, 3000),),
        lambda i, b: softmax.softmax(i[0], **(b or {"BLOCK": 1024})),
        lambda i, dt: torch.softmax(i[0], dim=-1),
        {"BLOCK": 1024},
        tiny=((3, 2500),),
    ),
    Case(
        "rms_norm",
        ((3, 37, 150), (150,)),
        lambda i, b: rms_norm.rms_norm(*i, 1e-5, **b),
        lambda i, dt: F.rms_norm(i[0], (i[0].shape[-1],), i[1], 1e-5),
        tiny=((9, 70), (70,)),
        scale=2,
    ),
    Case(
        "add_rms_norm",
        ((37, 150), (37, 150), (150,)),
        lambda i, b: rms_norm.add_rms_norm(*i, 1e-5, **b),
        # the sum is rounded to the input dtype before the norm; ref() sees that rounding
        lambda i, dt: _add_rms_norm_ref(*i, dt),
        tiny=((9, 70), (9, 70), (70,)),
        scale=2,
    ),
    Case(
        "rope_neox",
        ((37, 5, 16), (37, 3, 16)),
        _rope_neox,
        _rope_neox_ref,
        {"BLOCK_T": 4, "BLOCK_H": 4},
        tiny=((9, 5, 16), (9, 3, 16)),
        scale=2,
    ),
    Case(
        "rope_interleaved",
        ((37, 5, 16), (37, 3, 16)),
        _rope_inter,
        _rope_inter_ref,
        {"BLOCK_T": 4, "BLOCK_H": 4},
        tiny=((9, 5, 16), (9, 3, 16)),
        scale=2,
    ),
    Case(
        "sdpa",
        ((2, 3, 70, 16), (2, 3, 90, 16), (2, 3, 90, 16)),
        lambda i, b: attention.scaled_dot_product_attention(*i, **b),
        lambda i, dt: _sdpa_ref(*i, causal=False),
        {"BLOCK_M": 64, "BLOCK_N": 32},
        tiny=((1, 2, 70, 16), (1, 2, 40, 16), (1, 2, 40, 16)),
        scale=4,
    ),
    Case(
        "sdpa_causal",
        ((2, 3, 70, 16), (2, 3, 90, 16), (2, 3, 90, 16)),
        lambda i, b: attention.scaled_dot_product_attention(*i, is_causal=True, **b),
        lambda i, dt: _sdpa_ref(*i, causal=True),
        {"BLOCK_M": 64, "BLOCK_N": 32},
        tiny=((1, 2, 70, 16), (1, 2, 70, 16), (1, 2, 70, 16)),
        scale=4,
    ),
    Case(
        "max_pool2d",
        ((2, 3, 11, 10),),
        lambda i, b: pool.max_pool2d(i[0], 3, **b),
        lambda i, dt: F.max_pool2d(i[0], 3),
        {"BLOCK": 64},
        tiny=((1, 2, 11, 10),),
    ),
    Case(
        "max_pool2d_ceil_pad",
        ((2, 3, 11, 10),),
        lambda i, b: pool.max_pool2d(i[0], (3, 2), stride=2, padding=1, ceil_mode=True, **b),
        lambda i, dt: F.max_pool2d(i[0], (3, 2), stride=2, padding=1, ceil_mode=True),
        {"BLOCK": 64},
        tiny=((1, 2, 11, 10),),
    ),
]
CASE_IDS = [c.name for c in CASES]


def _inputs(case, shapes, dtype, device, noncontiguous, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = [_randn(s, dtype, gen) for s in shapes]
    if case.name.startswith("softmax"):  # a wide range makes the row maximum matter
        tensors[0] = tensors[0] * 8
    tensors = [t.to(device) for t in tensors]
    if noncontiguous:
        tensors = [strided(t) for t in tensors]
    return tensors


USES_DOT = {"mm", "bmm", "addmm", "conv2d", "conv2d_stride_pad", "sdpa", "sdpa_causal"}


def _check(case, shapes, dtype, device, noncontiguous, blocks, seed=0):
    inputs = _inputs(case, shapes, dtype, device, noncontiguous, seed)
    got = case.run(inputs, blocks)
    want = case.ref([t.cpu().double() for t in inputs], dtype)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    atol, rtol = TOLERANCES[dtype]
    if device == "cuda" and dtype == torch.float32 and case.name in USES_DOT:
        atol, rtol = TOLERANCES[torch.float16]  # Triton's tl.dot may use TF32 for float32 tiles
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.device == inputs[0].device
        assert g.shape == w.shape
        torch.testing.assert_close(g.cpu().double(), w, atol=atol * case.scale, rtol=rtol * case.scale)


@pytest.fixture
def cpu_backend(monkeypatch):
    monkeypatch.setenv("NINEFOLD_DSL_BACKEND", "cpu")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "strided"])
def test_cpu_backend(case, dtype, noncontiguous, cpu_backend):
    _check(case, case.shapes, dtype, "cpu", noncontiguous, blocks={})


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "strided"])
def test_cpu_backend_overhanging_blocks(case, noncontiguous, cpu_backend):
    """Small fixed blocks that do not divide the sizes, so every boundary mask matters."""
    blocks = case.blocks
    if case.name == "add_flat" and noncontiguous:
        blocks = {"BLOCK_M": 4, "BLOCK_N": 64}  # strided operands take the 2-D kernel
    _check(case, case.shapes, torch.float32, "cpu", noncontiguous, blocks)
    if case.name == "silu" and not noncontiguous:
        _check(case, case.shapes, torch.float32, "cpu", False, {"BLOCK": 1024})  # the flat kernel


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cpu_backend_float64(case, cpu_backend):
    _check(case, case.shapes, torch.float64, "cpu", False, blocks={})


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_interpret_backend(case, dtype, monkeypatch):
    monkeypatch.setenv("NINEFOLD_DSL_BACKEND", "interpret")
    noncontiguous = dtype == torch.float32  # one strided run per kernel keeps this quick
    blocks = case.blocks
    if case.name == "add_flat" and noncontiguous:
        blocks = {"BLOCK_M": 4, "BLOCK_N": 64}
    _check(case, case.tiny or case.shapes, dtype, "cpu", noncontiguous, blocks)


class _Recorder:
    """Stands in for a kernel object: records the launch instead of running it."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, *args, **kwargs):
        self.calls.append((self.name, args, kwargs))


# one case per distinct kernel (the other cases differ only in constexpr values)
SAME_KERNEL_AS_ANOTHER_CASE = {"softmax_dim0", "conv2d_stride_pad", "max_pool2d_ceil_pad", "sdpa"}


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.name not in SAME_KERNEL_AS_ANOTHER_CASE], ids=lambda c: c.name
)
def test_generated_triton_compiles_for_sm90(case, monkeypatch):
    """The launches a public function makes, compiled for cuda:90 by triton.compile on this CPU."""
    from ninefold.dsl.backends.triton import compile_for_target
    from ninefold.dsl.kernel import Kernel

    calls = []
    modules = (activation, add, attention, conv2d, mm, pool, rms_norm, rope, softmax)
    kernels = {}
    for module in modules:
        for attr, value in list(vars(module).items()):
            if isinstance(value, Kernel):
                kernels[(module.__name__, attr)] = value
                monkeypatch.setattr(module, attr, _Recorder((module.__name__, attr), calls))
    inputs = _inputs(case, case.tiny or case.shapes, torch.float16, "cpu", False, seed=0)
    case.run(inputs, {})
    assert calls, "the public function launched no kernel"
    for name, args, kwargs in calls:
        compiled, generated, _ = compile_for_target(kernels[name], args, kwargs, target="cuda:90")
        assert compiled.asm["cubin"], name
        assert "@triton.jit" in generated.source or "triton.jit" in generated.source


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "strided"])
def test_cuda_triton_backend(case, dtype, noncontiguous):
    _check(case, case.shapes, dtype, "cuda", noncontiguous, blocks={})
    if dtype == torch.float32:
        blocks = case.blocks
        if case.name == "add_flat" and noncontiguous:
            blocks = {"BLOCK_M": 4, "BLOCK_N": 64}
        _check(case, case.shapes, dtype, "cuda", noncontiguous, blocks, seed=1)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_attention_large(causal):
    """A realistic head dim and sequence length, against torch's own SDPA."""
    q, k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = attention.scaled_dot_product_attention(q, k, v, is_causal=causal)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


BAD_CALLS = [
    ("add dtypes", lambda: add.add(torch.ones(3), torch.ones(3, dtype=torch.float16)), TypeError, "y"),
    ("add shapes", lambda: add.add(torch.ones(3), torch.ones(4)), ValueError, "y"),
    ("add int", lambda: add.add(torch.ones(3, dtype=torch.int32), torch.ones(3)), TypeError, "x"),
    ("mm inner", lambda: mm.mm(torch.ones(3, 4), torch.ones(5, 6)), ValueError, "b"),
    ("mm ndim", lambda: mm.mm(torch.ones(3), torch.ones(3, 2)), ValueError, "a"),
    ("bmm batch", lambda: mm.bmm(torch.ones(2, 3, 4), torch.ones(3, 4, 5)), ValueError, "b"),
    ("addmm bias", lambda: mm.addmm(torch.ones(7), torch.ones(3, 4), torch.ones(4, 5)), ValueError, "bias"),
    (
        "conv channels",
        lambda: conv2d.conv2d(torch.ones(1, 3, 8, 8), torch.ones(4, 2, 3, 3)),
        ValueError,
        "weight",
    ),
    (
        "conv stride",
        lambda: conv2d.conv2d(torch.ones(1, 3, 8, 8), torch.ones(4, 3, 3, 3), stride=0),
        ValueError,
        "stride",
    ),
    (
        "conv too big",
        lambda: conv2d.conv2d(torch.ones(1, 3, 2, 2), torch.ones(4, 3, 3, 3)),
        ValueError,
        "weight",
    ),
    ("softmax dim", lambda: softmax.softmax(torch.ones(3, 4), dim=2), ValueError, "dim"),
    ("softmax list", lambda: softmax.softmax([1.0, 2.0]), TypeError, "x"),
    ("rms weight", lambda: rms_norm.rms_norm(torch.ones(3, 4), torch.ones(5)), ValueError, "weight"),
    ("rms eps", lambda: rms_norm.rms_norm(torch.ones(3, 4), torch.ones(4), eps=-1.0), ValueError, "eps"),
    (
        "add_rms residual",
        lambda: rms_norm.add_rms_norm(torch.ones(3, 4), torch.ones(2, 4), torch.ones(4)),
        ValueError,
        "residual",
    ),
    ("silu_and_mul odd", lambda: activation.silu_and_mul(torch.ones(3, 5)), ValueError, "x"),
    ("swiglu shapes", lambda: activation.swiglu(torch.ones(3, 5), torch.ones(3, 4)), ValueError, "up"),
    (
        "rope positions",
        lambda: rope.rope(
            torch.ones(4, 2, 8), torch.ones(4, 1, 8), torch.zeros(3, dtype=torch.int64), torch.ones(16, 8)
        ),
        ValueError,
        "positions",
    ),
    (
        "rope float positions",
        lambda: rope.rope(torch.ones(4, 2, 8), torch.ones(4, 1, 8), torch.zeros(4), torch.ones(16, 8)),
        TypeError,
        "positions",
    ),
    (
        "rope cache device",
        lambda: rope.rope(
            torch.ones(4, 2, 8),
            torch.ones(4, 1, 8),
            torch.zeros(4, dtype=torch.int64),
            torch.ones(16, 8, device="meta"),
        ),
        ValueError,
        "cos_sin_cache",
    ),
    (
        "sdpa causal",
        lambda: attention.scaled_dot_product_attention(
            torch.ones(1, 1, 5, 8), torch.ones(1, 1, 4, 8), torch.ones(1, 1, 4, 8), is_causal=True
        ),
        ValueError,
        "is_causal",
    ),
    (
        "sdpa heads",
        lambda: attention.scaled_dot_product_attention(
            torch.ones(1, 2, 5, 8), torch.ones(1, 1, 5, 8), torch.ones(1, 1, 5, 8)
        ),
        ValueError,
        "k/v",
    ),
    ("pool window", lambda: pool.max_pool2d(torch.ones(1, 1, 40, 40), 17), ValueError, "kernel_size"),
    ("pool padding", lambda: pool.max_pool2d(torch.ones(1, 1, 8, 8), 2, padding=2), ValueError, "padding"),
    ("pool type", lambda: pool.max_pool2d(torch.ones(1, 1, 8, 8), 2.5), TypeError, "kernel_size"),
]


@pytest.mark.parametrize("call, error, word", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_by_name(call, error, word):
    with pytest.raises(error, match=word):
        call()


def test_kernel_sources_import_only_the_dsl_and_each_other():
    """What lets the benchmark compile the same files with NineToothed by renaming two imports."""
    import ast
    import pathlib

    import ninefold.ops.kernels as package

    allowed = ("ninefold.dsl", "ninefold.dsl.language", "ninefold.ops.kernels")
    files = sorted(pathlib.Path(package.__file__).parent.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            for name in names:
                if name.startswith("ninefold"):
                    assert name in allowed or name.startswith("ninefold.ops.kernels."), (path.name, name)
