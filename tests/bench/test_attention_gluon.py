"""``ninefold.bench.attention_gluon``'s kernel, compiled for sm_90 on the CPU (running it needs the GPU)."""

import re

import pytest

pytest.importorskip("triton.experimental.gluon")


def _ptx(config) -> str:
    from ninefold.bench import attention_gluon

    return attention_gluon.compiled(*config).asm["ptx"]


@pytest.mark.parametrize("pingpong", [True, False])
def test_partitions_load_through_tma_and_multiply_on_warpgroups(pingpong):
    ptx = _ptx((128, 2, pingpong, 24, 240, 168, 1))
    assert ".reqntid 384" in ptx  # the default consumer warpgroup, the producer's and the second consumer's
    # registers handed from the producer to the consumers
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx)  # keys, values, queries by TMA
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx)  # the output too
    # two products per key tile (scores, then probabilities times values), 64 keys wide and 128 values wide
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx)
    # the probabilities go to the second product from registers, not through shared memory
    assert len(re.findall(r"st\.shared", ptx)) <= 4
    # only the scores are awaited while the previous tile's second product still runs
    assert re.search(r"wgmma\.wait_group\.sync\.aligned 1;", ptx)


def test_pingpong_passes_the_turn_through_mbarriers():
    arrives = {pp: len(re.findall(r"mbarrier\.arrive", _ptx((128, 2, pp, 24, 240, 168, 1)))) for pp in (True, False)}
    assert arrives[True] > arrives[False]


def test_every_configuration_fits_in_shared_memory():
    from ninefold.bench import attention_gluon

    for config in attention_gluon.CONFIGS:
        assert attention_gluon.compiled(*config).metadata.shared <= 227 * 1024
