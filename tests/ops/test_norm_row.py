"""The one-row CPU rms_norm / add_rms_norm ("cpu_row") against the float64 references."""

import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import references as ref

from .helpers import DTYPE_IDS, DTYPES, assert_close, call, randn


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,strided", [((576,), False), ((1, 576), False), ((1, 1, 130), True), ((1, 3), False)])
def test_one_row_matches_reference(dtype, shape, strided):
    x = randn(*shape, dtype=dtype, strided=strided, seed=1, scale=3)
    r = randn(*shape, dtype=dtype, seed=2)
    w = randn(shape[-1], dtype=dtype, seed=3)
    out = call("rms_norm", "cpu_row", x, w, 1e-5)
    assert out.shape == x.shape
    assert_close(out, ref.rms_norm(x, w, 1e-5), dtype)
    normed, total = call("add_rms_norm", "cpu_row", x, r, w, 1e-5)
    want_normed, want_total = ref.add_rms_norm(x, r, w, 1e-5)
    assert_close(total, want_total, dtype)
    assert_close(normed, want_normed, dtype)


def test_offered_for_one_row_on_cpu_only():
    w = torch.ones(64)
    assert "cpu_row" in [i.name for i in ops.candidates("rms_norm", torch.randn(1, 64), w, 1e-6)]
    assert "cpu_row" not in [i.name for i in ops.candidates("rms_norm", torch.randn(2, 64), w, 1e-6)]
    assert ops.choose("rms_norm", torch.randn(1, 64), w, 1e-6) == "vendor"  # below vendor by default
    (impl,) = [i for i in ops.registry.all_implementations("rms_norm") if i.name == "cpu_row"]
    assert impl.reason((torch.randn(3, 64), w, 1e-6)) == "more than one row (3)"


@pytest.mark.parametrize("shape,reason", [((5, 0), "more than one row (5)"), ((0, 8), "no row"),
                                          ((1, 0), "an empty row (last dimension 0)"),
                                          ((0,), "an empty row (last dimension 0)")])
def test_declines_what_is_not_one_row_with_values(shape, reason):
    # a [5, 0] x was taken for one row (numel == last dimension) and divided by its length, 0
    x, w = torch.randn(shape), torch.ones(shape[-1])
    (impl,) = [i for i in ops.registry.all_implementations("rms_norm") if i.name == "cpu_row"]
    assert impl.reason((x, w, 1e-6)) == reason
    with pytest.warns(UserWarning, match=r"pinned implementation 'cpu_row' cannot run these inputs"):
        with ops.use(rms_norm="cpu_row", add_rms_norm="cpu_row"):
            assert ops.rms_norm(x, w, 1e-6).shape == shape
            assert [t.shape for t in ops.add_rms_norm(x, x, w, 1e-6)] == [shape, shape]
