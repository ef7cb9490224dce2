"""ninefold.ops on the CPU at its edges: bad inputs (named errors, data checks of paged and packed attention, rope positions), non-contiguous and odd-size numerics against the float64 references, no aliasing."""

from __future__ import annotations

import warnings

import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import references as R
from ninefold.ops import registry

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _cpu_impls(op):
    return [i.name for i in registry.implementations(op) if "cpu" in i.devices]


def _close(out, ref, dtype):
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.dtype == dtype and o.shape == r.shape
        torch.testing.assert_close(o.double(), r, atol=4 * TOL[dtype], rtol=4 * TOL[dtype])


def _cases(dtype):
    g = torch.Generator().manual_seed(0)

    def rn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x = rn(37, 5).t()  # [5, 37], transposed (last stride 5), odd size
    res = rn(37, 5).t()
    w = rn(37)
    q = rn(3, 5, 24).transpose(0, 1)  # [5, 3, 24] non-contiguous
    k = rn(5, 1, 48)[..., ::2]  # strided head dim
    pos = torch.tensor([0, 3, 1, 7, 2])
    cache = torch.randn(9, 16, generator=g)  # partial rotary (R=16 < D=24)
    return {
        "rms_norm": (x, w, 1e-6),
        "add_rms_norm": (x, res, w, 1e-6),
        "silu_and_mul": (rn(7, 3, 46).transpose(0, 1),),
        "softmax": (rn(13, 9), 0),
        "linear": (rn(19, 5).t(), rn(19, 7).t(), rn(14)[::2]),
        "rope": (q, k, pos, cache, False),
    }


PARAMS = [pytest.param(op, impl, dt, id=f"{op}-{impl}-{str(dt)[6:]}")
          for dt in (torch.float32, torch.bfloat16)
          for op in ("rms_norm", "add_rms_norm", "silu_and_mul", "softmax", "linear", "rope")
          for impl in _cpu_impls(op)]


@pytest.mark.parametrize("op,impl,dtype", PARAMS)
def test_noncontiguous_odd_sizes_match_reference_and_leave_inputs_alone(op, impl, dtype):
    args = _cases(dtype)[op]
    if impl == "cpu_row":  # one-row implementation: feed it one (strided) row
        args = (args[0][:1], *(a[:1] if op == "add_rms_norm" and i == 0 else a for i, a in enumerate(args[1:])))
    chosen = [c.name for c in ops.candidates(op, *args)]
    if impl not in chosen:
        pytest.skip(f"{impl} does not run these inputs here: {chosen}")
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = ops.run(op, impl, *args)
    _close(out, getattr(R, op)(*args), dtype)
    for a, b in zip(args, before):  # out-of-place: inputs untouched, outputs do not alias them
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
            for o in (out if isinstance(out, tuple) else (out,)):
                assert o.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


def _rows_of_no_values(shape) -> dict:
    x = torch.randn(shape)
    return {"rms_norm": (x, torch.ones(0), 1e-6), "add_rms_norm": (x, torch.randn(shape), torch.ones(0), 1e-6),
            "silu_and_mul": (x,), "softmax": (x, -1), "linear": (x, torch.randn(3, 0), torch.randn(3))}


EMPTY_ROW_PARAMS = [pytest.param(op, impl, shape, id=f"{op}-{impl}-{'x'.join(map(str, shape))}")
                    for op in ("rms_norm", "add_rms_norm", "silu_and_mul", "softmax", "linear")
                    for impl in _cpu_impls(op) for shape in ((4, 0), (2, 3, 0), (0,))]


@pytest.mark.parametrize("op,impl,shape", EMPTY_ROW_PARAMS)
def test_an_x_whose_last_dimension_is_0_is_declined_or_computed(op, impl, shape):
    """Pinned or chosen, an implementation says no to rows of no values (dispatch runs another) or computes the
    empty result: the DSL kernels reshaped to [-1, 0], cpu_row divided by the row's length, cpu_native's checks
    reshaped to [-1, 0]."""
    args = _rows_of_no_values(shape)[op]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the pin's fallback to another implementation)
        with ops.use(**{op: impl}):
            out = getattr(ops, op)(*args)
    # (the softmax reference takes each row's maximum, which a row of no values lacks)
    want = torch.softmax(args[0].double(), -1) if op == "softmax" else getattr(R, op)(*args)
    _close(out, want, torch.float32)


def test_bad_inputs_that_are_handled_well():
    x = torch.randn(2, 8)
    with pytest.raises(ops.OpError, match="eps"):
        ops.rms_norm(x, torch.ones(8), 0.0)
    with pytest.raises(ops.OpError, match=r"ids must lie in \[0, 5\)"):
        ops.embedding(torch.tensor([0, 5]), torch.randn(5, 4))
    with pytest.raises(ops.OpError, match="slot_mapping holds 8"):
        ops.reshape_and_cache(torch.randn(3, 1, 8), torch.randn(3, 1, 8), torch.zeros(2, 4, 1, 8),
                              torch.zeros(2, 4, 1, 8), torch.tensor([0, 1, 8]))
    with pytest.raises(ops.OpError, match="head size 8 differs from q's 4"):
        ops.attention_decode(torch.randn(1, 2, 4), torch.randn(3, 4, 1, 8), torch.randn(3, 4, 1, 8),
                             torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ops.OpError, match=r"positions must lie in \[0, 4\)"):
        ops.run("rope", "vendor", torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.tensor([0, 9]),
                torch.randn(4, 8))


# ---- bugs -------------------------------------------------------------------------------------

def _paged(num_blocks=3, bs=4):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 2, 8, generator=g), torch.randn(num_blocks, bs, 1, 8, generator=g),
            torch.randn(num_blocks, bs, 1, 8, generator=g))


@pytest.mark.parametrize("block", [5, -1])
def test_decode_out_of_range_block_table_raises(block):
    q, kc, vc = _paged()
    with pytest.raises((ops.OpError, IndexError), match="block_tables"):
        ops.attention_decode(q, kc, vc, torch.tensor([[block, 0]], dtype=torch.int32),
                             torch.tensor([6], dtype=torch.int32))


@pytest.mark.parametrize("length", [20, 0])
def test_decode_bad_context_lens_raise(length):
    q, kc, vc = _paged()
    with pytest.raises(ops.OpError, match="context_lens"):
        ops.attention_decode(q, kc, vc, torch.tensor([[0, 1]], dtype=torch.int32),
                             torch.tensor([length], dtype=torch.int32))


def test_decode_empty_batch():
    _, kc, vc = _paged()
    out = ops.attention_decode(torch.randn(0, 2, 8), kc, vc, torch.zeros(0, 2, dtype=torch.int32),
                               torch.zeros(0, dtype=torch.int32))
    assert out.shape == (0, 2, 8)


@pytest.mark.parametrize("cu", [(0, 3), (1, 5)])
def test_prefill_cu_seqlens_not_covering_q_raise(cu):
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    c = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(ops.OpError, match="cu_seqlens"):
        ops.attention_prefill(q, k, v, c, c)


def test_prefill_cu_seqlens_k_past_k_raises_operror():
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    with pytest.raises(ops.OpError, match="cu_seqlens_k"):
        ops.attention_prefill(q, k, v, torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32))


def test_prefill_out_of_range_block_table_names_it():
    _, kc, vc = _paged()
    c = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises((ops.OpError, IndexError), match="block_tables"):
        ops.attention_prefill(torch.randn(5, 2, 8), None, None, c, c, k_cache=kc, v_cache=vc,
                              block_tables=torch.tensor([[0, 7]], dtype=torch.int32))


def test_rope_dsl_out_of_range_positions_name_them():
    with pytest.raises(ops.OpError, match="positions"):
        ops.run("rope", "dsl", torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.tensor([0, 9]), torch.randn(4, 8))


def test_linear_non_tensor_bias_is_type_error():
    with pytest.raises(TypeError, match="bias"):
        ops.linear(torch.randn(2, 4), torch.randn(3, 4), [1.0, 2.0, 3.0])


@pytest.mark.parametrize("name, values, row", [
    ("temperature", [1.0, -0.5, 0.0], 1),  # a negative temperature was taken as greedy
    ("temperature", [float("nan"), 1.0, 0.0], 0),
    ("top_p", [1.0, 0.5, 0.0], 2),
    ("top_p", [1.5, 0.5, 1.0], 0),
    ("min_p", [0.0, -0.1, 0.5], 1),
    ("min_p", [0.0, 0.5, 2.0], 2),
])
def test_sample_rejects_out_of_range_row_values_naming_the_row(name, values, row):
    logits = torch.randn(3, 11)
    kwargs = {"temperature": torch.ones(3), name: torch.tensor(values)}
    temperature = kwargs.pop("temperature")
    with pytest.raises(ValueError, match=rf"sample: {name}\[{row}\] is"):
        ops.sample(logits, temperature, **kwargs)


def test_sample_accepts_the_boundary_values():
    logits = torch.randn(3, 11)
    got = ops.sample(logits, torch.tensor([0.0, 1.0, 0.5]), top_p=torch.tensor([1.0, 1.0, 1e-6]),
                     min_p=torch.tensor([0.0, 1.0, 0.0]), top_k=torch.tensor([0, -1, 3]))
    assert got[0] == logits[0].argmax()  # temperature 0: greedy
    assert got[1] == logits[1].argmax()  # min_p 1 keeps only the most likely token
    assert got[2] == logits[2].argmax()  # top_p near 0 keeps only the most likely token
