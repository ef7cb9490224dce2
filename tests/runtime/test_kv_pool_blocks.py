"""KVCachePool.read_blocks / write_blocks: block contents out of one pool and into another."""

from __future__ import annotations

import pytest
import torch

from ninefold.runtime.kv_pool import KVCachePool

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_copied_between_pools_land_in_the_named_blocks(device, dtype):
    src = KVCachePool(3, 2, 8, 4, dtype, device, 10)
    for layer in range(3):
        src.k_cache(layer).normal_()
        src.v_cache(layer).normal_()
    data = src.read_blocks([7, 2, 5])
    assert data.shape == (3, *src.block_shape) and data.is_contiguous() and data.device.type == device
    for j, block in enumerate([7, 2, 5]):
        for layer in range(3):
            assert torch.equal(data[j, layer, 0], src.k_cache(layer)[block])
            assert torch.equal(data[j, layer, 1], src.v_cache(layer)[block])
    dst = KVCachePool(3, 2, 8, 4, dtype, device, 6)
    dst.write_blocks([4, 0, 1], data.cpu())  # from another device too
    for j, block in enumerate([4, 0, 1]):
        for layer in range(3):
            assert torch.equal(dst.k_cache(layer)[block], src.k_cache(layer)[[7, 2, 5][j]])
            assert torch.equal(dst.v_cache(layer)[block], src.v_cache(layer)[[7, 2, 5][j]])
    assert dst.k_cache(0)[2:4].abs().sum() == 0 and dst.k_cache(2)[5].abs().sum() == 0  # others untouched
    assert src.read_blocks([]).shape == (0, *src.block_shape)


def test_write_blocks_names_what_is_wrong():
    pool = KVCachePool(2, 1, 4, 2, torch.float32, "cpu", 4)
    good = torch.zeros(2, *pool.block_shape)
    with pytest.raises(ValueError, match=r"data: expected shape \(2, 2, 2, 2, 1, 4\)"):
        pool.write_blocks([0, 1], torch.zeros(2, 2, 2, 2, 1, 8))
    with pytest.raises(TypeError, match="data: expected torch.float32 like the pool, got torch.float16"):
        pool.write_blocks([0, 1], good.half())
    with pytest.raises(ValueError, match=r"ids: expected distinct block ids, got \[1, 1\]"):
        pool.write_blocks([1, 1], good)
    with pytest.raises(ValueError, match=r"ids: expected block ids in \[0, 4\), got 4"):
        pool.write_blocks([0, 4], good)
    with pytest.raises(TypeError, match="data: expected a torch.Tensor"):
        pool.write_blocks([0, 1], [[0.0]])
    with pytest.raises(ValueError, match=r"ids: expected block ids in \[0, 4\), got -1"):
        pool.read_blocks([-1])
