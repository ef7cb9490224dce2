import pytest
import torch

from ninefold.ops import references as ref

from .helpers import DTYPE_IDS, DTYPES, assert_close, call, impl_params, randn


def cos_sin_cache(max_pos: int, rotary: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device,impl", impl_params("rope"))
@pytest.mark.parametrize("t,hq,hk,d,rotary,strided", [(1, 1, 1, 2, 2, False), (7, 6, 2, 16, 16, False),
                                                      (5, 4, 4, 24, 12, True)])
def test_rope_matches_reference(device, impl, dtype, is_neox, t, hq, hk, d, rotary, strided):
    q = randn(t, hq, d, dtype=dtype, device=device, strided=strided, seed=1)
    k = randn(t, hk, d, dtype=dtype, device=device, seed=2)
    positions = torch.randint(0, 40, (t,), generator=torch.Generator().manual_seed(3)).to(device)
    cache = cos_sin_cache(40, rotary).to(device)
    q_out, k_out = call("rope", impl, q, k, positions, cache, is_neox)
    q_want, k_want = ref.rope(q, k, positions, cache, is_neox)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert_close(q_out, q_want, dtype)
    assert_close(k_out, k_want, dtype)
