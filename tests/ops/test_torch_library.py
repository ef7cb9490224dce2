"""torch.ops.ninefold.*: eager results match ninefold.ops, and torch.compile(fullgraph=True) traces."""

import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import workloads

ops.register_torch_library()
nf = torch.ops.ninefold


def _block(x, residual, w_norm, w_up, w_down, cache, positions):
    """A transformer-ish block written only with torch.ops.ninefold calls."""
    h, res = nf.add_rms_norm(x, residual, w_norm, 1e-5)
    q, k = nf.rope(h.view(h.shape[0], 4, 16), h.view(h.shape[0], 4, 16), positions, cache, True)
    up = nf.linear(q.reshape(h.shape), w_up)
    y = nf.linear(nf.silu_and_mul(up), w_down)
    return nf.softmax(nf.mul(nf.add(y, res), y), -1), nf.argmax(y, -1)


def _inputs():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    return (x, r, torch.randn(64, generator=g), torch.randn(96, 64, generator=g) / 8,
            torch.randn(64, 48, generator=g) / 7, workloads.cos_sin_cache(32, 16), torch.arange(5))


def test_registering_twice_is_harmless():
    ops.register_torch_library()
    assert hasattr(torch.ops.ninefold, "attention_decode")


def test_eager_torch_ops_match_ninefold_ops():
    x, r, w, *_ = _inputs()
    out, total = nf.add_rms_norm(x, r, w, 1e-5)
    want, want_total = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(out, want) and torch.equal(total, want_total)


def test_compile_fullgraph_traces_through_the_ops():
    args = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(_block, fullgraph=True, backend="aot_eager")
    got, got_idx = compiled(*args)
    want, want_idx = _block(*args)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_idx, want_idx)


def test_compile_fullgraph_attention_and_cache_write():
    shapes = workloads.shapes("tiny")
    q, k_cache, v_cache, tables, lens = next(workloads.cases("attention_decode", shapes, "cpu", torch.float32)).args
    key = torch.randn(q.shape[0], k_cache.shape[2], k_cache.shape[3])
    slots = tables[:, 0].long() * k_cache.shape[1]

    def step(q, key, k_cache, v_cache, slots, tables, lens):
        nf.reshape_and_cache(key, key, k_cache, v_cache, slots)
        out = nf.attention_decode(q, k_cache, v_cache, tables, lens, None)
        return nf.sample(out.flatten(1), torch.zeros(q.shape[0]))

    eager_caches = (k_cache.clone(), v_cache.clone())
    want = step(q, key, *eager_caches, slots, tables, lens)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, key, k_cache, v_cache, slots, tables, lens)
    assert torch.equal(got, want)
    assert torch.equal(k_cache, eager_caches[0])


def _odd_layouts() -> dict:
    """Per operator: arguments whose tensors are transposed or strided views."""
    g = torch.Generator().manual_seed(1)
    transposed, strided = torch.randn(16, 4, generator=g).t(), torch.randn(4, 32, generator=g)[:, ::2]
    heads = torch.randn(3, 16, 2, generator=g).transpose(1, 2)
    return {
        "add": (nf.add.default, (transposed, transposed)),
        "add broadcast": (nf.add.default, (transposed, torch.randn(16, generator=g))),
        "mul": (nf.mul.default, (transposed, strided)),
        "rms_norm": (nf.rms_norm.default, (strided, torch.ones(16), 1e-6)),
        "add_rms_norm": (nf.add_rms_norm.default, (transposed, strided, torch.ones(16), 1e-6)),
        "silu_and_mul": (nf.silu_and_mul.default, (transposed,)),
        "gelu_and_mul": (nf.gelu_and_mul.default, (transposed, "tanh")),
        "softmax": (nf.softmax.default, (transposed, 0)),
        "linear": (nf.linear.default, (transposed, torch.randn(3, 16, generator=g))),
        "rope": (nf.rope.default, (heads, heads[:, :1], torch.arange(3), workloads.cos_sin_cache(4, 16), True)),
        "argmax": (nf.argmax.default, (transposed, 0)),
    }


@pytest.mark.parametrize("case", list(_odd_layouts()))
def test_fake_and_real_results_agree_for_inputs_of_any_layout(case):
    """torch.compile plans with the fakes' shapes and strides: the real results must have them (the fakes said
    contiguous while torch.add kept a transposed input's strides, and compiled graphs failed)."""
    op, args = _odd_layouts()[case]
    torch.library.opcheck(op, args)
