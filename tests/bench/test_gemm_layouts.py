"""``ninefold.bench.gemm_layouts``: every layout computes ``x @ W^T`` (CPU), and a bad one is named."""

from __future__ import annotations

import pytest
import torch

from ninefold.bench.gemm_layouts import LAYOUTS, layout_call


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_compute_the_same_product(layout):
    x, w = torch.randn(5, 64, dtype=torch.float64), torch.randn(48, 64, dtype=torch.float64)
    got = layout_call(layout, x, w)()
    assert got.shape == (5, 48) and got.is_contiguous()
    torch.testing.assert_close(got, x @ w.T)


def test_unknown_layout_is_named():
    with pytest.raises(ValueError, match="layout: got 'tt'; supported: tn, nn, swap"):
        layout_call("tt", torch.zeros(1, 32), torch.zeros(2, 32))
