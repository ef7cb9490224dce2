"""KVCachePool: block bookkeeping as a hypothesis state machine, swaps, sizing and errors."""

import re
import subprocess
import sys

import psutil
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ninefold.runtime import KVCacheExhausted, KVCachePool

from .helpers import cpu_peak_of_temporary

LAYERS, HEADS, DIM, BLOCK = 2, 2, 4, 3


def make_pool(num_blocks=8, **kwargs):
    return KVCachePool(LAYERS, HEADS, DIM, BLOCK, torch.float32, "cpu", num_blocks, **kwargs)


def tag_block(pool, block, tag):
    for layer in range(pool.num_layers):
        pool.k_cache(layer)[block] = tag + 0.25 * layer
        pool.v_cache(layer)[block] = -tag - 0.25 * layer


def block_tag_ok(pool, block, tag):
    return all(
        bool((pool.k_cache(layer)[block] == tag + 0.25 * layer).all())
        and bool((pool.v_cache(layer)[block] == -tag - 0.25 * layer).all())
        for layer in range(pool.num_layers)
    )


class PoolMachine(RuleBasedStateMachine):
    """A model of the pool: ref-counts per block, a data tag per held block, host blocks' tags."""

    def __init__(self):
        super().__init__()
        self.pool = make_pool(num_blocks=6, policy="swap", num_host_blocks=4)
        self.refs = {}  # block -> ref count (held blocks only)
        self.tags = {}  # block -> tag written into it
        self.host = {}  # host id -> tag
        self.next_tag = 1.0

    @rule(n=st.integers(0, 8))
    def allocate(self, n):
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(KVCacheExhausted) as err:
                self.pool.allocate(n)
            assert (err.value.needed, err.value.available) == (n, free_before)
            return
        ids = self.pool.allocate(n)
        assert len(ids) == len(set(ids)) == n
        for i in ids:
            assert i not in self.refs, f"block {i} handed out while held"
            self.refs[i] = 1
            self.tags[i] = self.next_tag
            tag_block(self.pool, i, self.next_tag)
            self.next_tag += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.refs)), min_size=1, max_size=3))
        self.pool.incref(ids)
        for i in ids:
            self.refs[i] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        block = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.free([block])
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block], self.tags[block]

    @precondition(lambda self: any(r == 1 for r in self.refs.values()))
    @rule(data=st.data())
    def preempt_and_recompute(self, data):
        # Policy "preempt": the victim's block is freed, then recomputed into whatever block comes next.
        victim = data.draw(st.sampled_from(sorted(b for b, r in self.refs.items() if r == 1)))
        tag = self.tags.pop(victim)
        del self.refs[victim]
        self.pool.free([victim])
        (block,) = self.pool.allocate(1)
        assert block not in self.refs
        tag_block(self.pool, block, tag)  # the recomputation writes the same keys and values again
        self.refs[block], self.tags[block] = 1, tag

    @rule(block=st.integers(0, 5))
    def double_free_raises(self, block):
        if block in self.refs:
            return
        with pytest.raises(ValueError, match="double free"):
            self.pool.free([block])

    @precondition(lambda self: self.refs)
    @rule(block=st.integers(0, 5))
    def over_free_in_one_call_raises_and_changes_nothing(self, block):
        if block not in self.refs:
            return
        with pytest.raises(ValueError):
            self.pool.free([block] * (self.refs[block] + 1))

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def swap_out(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.refs)), min_size=1, max_size=3, unique=True))
        if len(ids) > self.pool.num_free_host:
            with pytest.raises(KVCacheExhausted):
                self.pool.swap_out(ids)
            return
        host_ids = self.pool.swap_out(ids)
        assert len(set(host_ids)) == len(ids)
        for i, h in zip(ids, host_ids):
            assert h not in self.host
            self.host[h] = self.tags[i]
            self.refs[i] -= 1
            if self.refs[i] == 0:
                del self.refs[i], self.tags[i]

    @precondition(lambda self: self.host)
    @rule(data=st.data())
    def swap_in(self, data):
        host_ids = data.draw(st.lists(st.sampled_from(sorted(self.host)), min_size=1, max_size=3, unique=True))
        if len(host_ids) > self.pool.num_free:
            with pytest.raises(KVCacheExhausted):
                self.pool.swap_in(host_ids)
            return
        ids = self.pool.swap_in(host_ids)
        for i, h in zip(ids, host_ids):
            assert i not in self.refs
            tag = self.host.pop(h)
            assert block_tag_ok(self.pool, i, tag), f"block {i} lost its data in the swap round trip"
            self.refs[i], self.tags[i] = 1, tag

    @invariant()
    def counts_match_the_model(self):
        pool = self.pool
        for i in range(pool.num_blocks):
            assert pool.ref_count(i) == self.refs.get(i, 0)
        assert pool.num_free == pool.num_blocks - len(self.refs)  # no leak
        assert pool.num_free_host == pool.num_host_blocks - len(self.host)
        assert pool.usage == pytest.approx(len(self.refs) / pool.num_blocks)

    @invariant()
    def held_blocks_keep_their_data(self):
        for i, tag in self.tags.items():
            assert block_tag_ok(self.pool, i, tag)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_storage_shapes_and_views():
    pool = make_pool(num_blocks=5)
    for layer in range(LAYERS):
        for cache in (pool.k_cache(layer), pool.v_cache(layer)):
            assert cache.shape == (5, BLOCK, HEADS, DIM) and cache.is_contiguous() and cache.dtype == torch.float32
    pool.k_cache(1)[2, 0, 1, 3] = 7.0
    assert pool.k_cache(1)[2, 0, 1, 3] == 7.0 and pool.v_cache(1).abs().sum() == 0 and pool.k_cache(0).abs().sum() == 0
    assert pool.bytes_per_block == 2 * LAYERS * BLOCK * HEADS * DIM * 4


_RESIDENT_PROBE = """
import psutil
import torch
from ninefold.runtime import KVCachePool
rss = psutil.Process().memory_info().rss
pool = KVCachePool(4, 8, 64, 16, torch.float32, "cpu", 2048)  # 512 MiB
fresh = psutil.Process().memory_info().rss - rss
pool.k_cache(3)[:1024] = 1.0  # one layer's keys in half the blocks: 32 MiB
touched = psutil.Process().memory_info().rss - rss
print(fresh, touched, float(pool.v_cache(3).abs().sum()), float(pool.k_cache(3).sum()))
"""


def test_host_pool_is_resident_only_where_written():
    """A host pool takes its zeros from the kernel page by page: a 512 MiB budget costs nothing
    until blocks are written, then about what was written. Measured in a fresh process."""
    probe = subprocess.run([sys.executable, "-c", _RESIDENT_PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    fresh, touched, untouched_sum, written_sum = probe.stdout.split()
    assert int(fresh) < 16 * 2**20
    assert 28 * 2**20 < int(touched) < 64 * 2**20
    assert float(untouched_sum) == 0.0 and float(written_sum) == 1024 * 16 * 8 * 64


def test_free_returns_blocks_only_at_zero_references():
    pool = make_pool(num_blocks=4)
    a, b = pool.allocate(2)
    pool.incref([a, a])
    pool.free([a])
    assert pool.ref_count(a) == 2 and pool.num_free == 2
    pool.free([a, a, b])
    assert pool.ref_count(a) == 0 and pool.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        pool.free([a])
    with pytest.raises(ValueError, match="is free"):
        pool.incref([b])


def test_watermark_keeps_headroom():
    pool = make_pool(num_blocks=10, watermark=0.2)
    assert pool.watermark_blocks == 2
    assert pool.can_allocate(8) and not pool.can_allocate(9)
    assert len(pool.allocate(9)) == 9  # allocate itself only needs the blocks to exist


def test_preempt_policy_refuses_swaps():
    pool = make_pool(num_blocks=4)
    ids = pool.allocate(1)
    with pytest.raises(ValueError, match="policy"):
        pool.swap_out(ids)


def test_swap_round_trip_preserves_bf16_data_and_shared_blocks():
    pool = KVCachePool(3, 2, 8, 4, torch.bfloat16, "cpu", 6, policy="swap", num_host_blocks=3)
    ids = pool.allocate(3)
    expected = torch.randn(3, 2, len(ids), 4, 2, 8, dtype=torch.float64).to(torch.bfloat16)
    for layer in range(3):
        pool.k_cache(layer)[ids] = expected[layer, 0]
        pool.v_cache(layer)[ids] = expected[layer, 1]
    pool.incref([ids[0]])  # shared: swapping it out drops only this holder's reference
    host = pool.swap_out(ids)
    assert pool.ref_count(ids[0]) == 1 and pool.num_free == 5
    back = pool.swap_in(host)
    for j, i in enumerate(back):
        for layer in range(3):
            assert torch.equal(pool.k_cache(layer)[i], expected[layer, 0, j])
            assert torch.equal(pool.v_cache(layer)[i], expected[layer, 1, j])
    assert pool.num_free_host == 3
    with pytest.raises(ValueError, match="holds nothing"):
        pool.swap_in(host[:1])


def test_from_memory_fails_at_once_with_numbers():
    free, total = psutil.virtual_memory().available, psutil.virtual_memory().total
    per_block = 2 * 4 * 16 * 8 * 64 * 2
    with pytest.raises(KVCacheExhausted) as err:
        KVCachePool.from_memory(4, 8, 64, 16, torch.float16, "cpu", num_blocks=2 * total // per_block)
    assert err.value.unit == "bytes" and err.value.needed == (2 * total // per_block) * per_block
    assert err.value.available < err.value.needed and "need" in str(err.value)
    with pytest.raises(KVCacheExhausted):
        KVCachePool.from_memory(4, 8, 64, 16, torch.float16, "cpu", reserved_bytes=free)


def test_from_memory_counts_headroom_and_reserve():
    per_block = 2 * 2 * 16 * 2 * 32 * 4
    free, total = psutil.virtual_memory().available, psutil.virtual_memory().total
    # Leave a budget of 512 MiB: the pool must take about that much (other processes move free memory a little).
    reserve = free - int(total * 0.1) - 512 * 2**20
    pool = KVCachePool.from_memory(2, 2, 32, 16, torch.float32, "cpu", memory_fraction=0.9, reserved_bytes=reserve)
    assert abs(pool.num_blocks * per_block - 512 * 2**20) < 384 * 2**20
    assert pool.k_cache(0).shape == (pool.num_blocks, 16, 2, 32)


_ACTIVATION_PROBE = """
import torch
from ninefold.runtime import Device, KVCacheExhausted, KVCachePool
gib = 2**30
# Fixed free/total figures: other processes allocating and freeing must not move the budget.
Device.available_bytes = lambda self: 2 * gib
Device.memory_info = lambda self: (2 * gib, 4 * gib)
args = (2, 2, 32, 16, torch.float32, "cpu")
reserve = 2 * gib - int(4 * gib * 0.1) - 100 * 2**20  # leaves 100 MiB for the KV cache
print("without", KVCachePool.from_memory(*args, reserved_bytes=reserve).num_blocks)
try:
    KVCachePool.from_memory(*args, reserved_bytes=reserve, profile_fn=lambda: torch.ones(64 * 2**20).sum())  # 256 MiB
    print("with none")
except KVCacheExhausted as e:
    print("with raised", "activation peak" in str(e), e.available)
"""


def test_from_memory_subtracts_profiled_activation_peak():
    assert cpu_peak_of_temporary(16 * 2**20) >= 60 * 2**20  # the 64 MiB tensor was resident at the peak
    # In a fresh process, as cpu_peak_of_temporary: a test worker may hold freed memory (or run threads
    # of earlier tests that free theirs) while the profiled forward runs, so its peak would not show.
    probe = subprocess.run([sys.executable, "-c", _ACTIVATION_PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    without, with_peak = probe.stdout.strip().splitlines()[-2:]
    assert int(without.split()[1]) > 0
    assert with_peak == "with raised True 0", with_peak


def test_instance_fraction_bounds_the_owner_not_the_device(monkeypatch):
    """vLLM's gpu_memory_utilization: the owner may hold ``fraction * total`` in all, whatever else the device
    holds, and never more than is free. Fixed free/total figures keep the arithmetic exact."""
    from ninefold.runtime import Device

    gib = 2**30
    monkeypatch.setattr(Device, "available_bytes", lambda self: 2 * gib)
    monkeypatch.setattr(Device, "memory_info", lambda self: (2 * gib, 4 * gib))
    args = (2, 2, 32, 16, torch.float32, "cpu")
    per_block = 2 * 2 * 16 * 2 * 32 * 4

    def blocks(**kwargs):
        return KVCachePool.from_memory(*args, **kwargs).num_blocks

    # half of 4 GiB, of which the owner's weights hold 1 GiB: 1 GiB left, though 2 GiB are free
    assert blocks(instance_fraction=0.5, instance_used_bytes=gib) == gib // per_block
    assert blocks(instance_fraction=0.5, instance_used_bytes=gib, reserved_bytes=gib // 2) == gib // 2 // per_block
    # the device-wide fraction would have given 2 GiB - 0.5 * 4 GiB = nothing; the instance's is not cut by others
    with pytest.raises(KVCacheExhausted, match="memory_fraction=0.5"):
        blocks(memory_fraction=0.5)
    assert blocks(instance_fraction=1.0) == 2 * gib // per_block  # all of the device, but only what is free
    # the reserves come out of what is free too, and the owner's holdings only out of its share
    assert blocks(instance_fraction=1.0, reserved_bytes=gib // 2) == (2 * gib - gib // 2) // per_block
    assert blocks(instance_fraction=0.75, instance_used_bytes=gib) == 2 * gib // per_block
    assert blocks(instance_fraction=0.5, memory_fraction=0.1) == 2 * gib // per_block  # memory_fraction unused
    with pytest.raises(KVCacheExhausted, match=r"instance_fraction=0.25\) and holds 1073741824"):
        blocks(instance_fraction=0.25, instance_used_bytes=gib)
    for bad in (0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match=rf"instance_fraction: expected None or a fraction in \(0, 1\], got "
                                             rf"{re.escape(repr(bad))}"):
            blocks(instance_fraction=bad)


@pytest.mark.parametrize("kwargs, error", [
    (dict(num_blocks=0), ValueError),
    (dict(num_blocks=2.5), TypeError),
    (dict(policy="evict"), ValueError),
    (dict(policy="swap"), ValueError),
    (dict(num_host_blocks=2), ValueError),
    (dict(watermark=1.5), ValueError),
])
def test_bad_arguments_name_themselves(kwargs, error):
    args = dict(num_blocks=4) | kwargs
    with pytest.raises(error, match=next(iter(kwargs))):
        make_pool(**args)


def test_bad_block_ids_and_layers():
    pool = make_pool(num_blocks=4)
    with pytest.raises(ValueError, match="ids"):
        pool.free([4])
    with pytest.raises(ValueError, match="layer"):
        pool.k_cache(LAYERS)
    with pytest.raises(TypeError, match="dtype"):
        KVCachePool(1, 1, 1, 1, torch.int64, "cpu", 1)
    with pytest.raises(ValueError, match="memory_fraction"):
        KVCachePool.from_memory(1, 1, 1, 1, torch.float32, "cpu", memory_fraction=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_swap_round_trip_on_copy_stream():
    pool = KVCachePool(2, 2, 64, 16, torch.bfloat16, "cuda", 8, policy="swap", num_host_blocks=4)
    assert pool.host_block(0).is_pinned()
    ids = pool.allocate(4)
    data = torch.randn(2, 2, 4, 16, 2, 64, device="cuda").to(torch.bfloat16)
    for layer in range(2):
        pool.k_cache(layer)[ids] = data[layer, 0]
        pool.v_cache(layer)[ids] = data[layer, 1]
    host = pool.swap_out(ids)
    reused = pool.allocate(8)  # takes the swapped-out blocks too: must wait for their copies first
    for layer in range(2):
        pool.k_cache(layer)[reused] = 0
        pool.v_cache(layer)[reused] = 0
    pool.free(reused)  # the swap-in copy must wait for the zeroing queued on the compute stream
    back = pool.swap_in(host)
    got = torch.stack([torch.stack([pool.k_cache(i)[back], pool.v_cache(i)[back]]) for i in range(2)])
    torch.testing.assert_close(got, data, rtol=0, atol=0)


def test_an_fp8_pool_reads_writes_copies_and_swaps_its_codes():
    """FP8 codes (``kv_cache_dtype="fp8"``) move as bytes through every indexed copy of the pool (indexing float8
    is not implemented everywhere): read/write, copy, swap out and back in keep every code."""
    fp8 = torch.float8_e4m3fn
    pool = KVCachePool(LAYERS, HEADS, DIM, BLOCK, fp8, "cpu", 6, policy="swap", num_host_blocks=4)
    ids = pool.allocate(3)
    codes = (8 * torch.randn(3, *pool.block_shape, generator=torch.Generator().manual_seed(0))).to(fp8)
    pool.write_blocks(ids, codes)
    assert torch.equal(pool.read_blocks(ids).view(torch.uint8), codes.view(torch.uint8))
    spare = pool.allocate(1)
    pool.copy_blocks(ids[:1], spare)
    assert torch.equal(pool.read_blocks(spare).view(torch.uint8), codes[:1].view(torch.uint8))
    host = pool.swap_out(ids)
    back = pool.swap_in(host)
    assert torch.equal(pool.read_blocks(back).view(torch.uint8), codes.view(torch.uint8))
