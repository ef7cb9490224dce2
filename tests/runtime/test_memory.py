"""WeightStore (one allocation, bytes, aliases) and Workspace (no allocation in a steady loop)."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ninefold.runtime.memory import WeightsDoNotFit, WeightStore, Workspace


def test_weight_store_copies_converts_and_reports_bytes():
    emb = torch.randn(7, 5, dtype=torch.float64)
    tensors = {"embed": emb, "lm_head": emb, "norm": torch.randn(5), "ids": torch.arange(3), "empty": torch.empty(0, 4)}
    store = WeightStore(tensors, "cpu", dtype=torch.bfloat16)
    assert set(store) == set(tensors) and len(store) == 5
    assert store["embed"].dtype == torch.bfloat16 and store["ids"].dtype == torch.int64
    assert torch.equal(store["embed"], emb.to(torch.bfloat16)) and torch.equal(store["ids"], torch.arange(3))
    assert store["embed"].data_ptr() == store["lm_head"].data_ptr()  # tied weights stored once
    assert store.nbytes == 7 * 5 * 2 + 5 * 2 + 3 * 8
    assert store.nbytes <= store.allocated_bytes < store.nbytes + 5 * 256
    ptrs = [store[n].data_ptr() for n in ("embed", "norm", "ids")]
    base = store._buffer.data_ptr()
    assert all(base <= p < base + store.allocated_bytes and (p - base) % 256 == 0 for p in ptrs)


def test_weight_store_errors():
    with pytest.raises(KeyError, match="missing"):
        WeightStore({"a": torch.ones(1)})["missing"]
    with pytest.raises(TypeError, match="tensors"):
        WeightStore({"a": [1.0]})
    with pytest.raises(TypeError, match="dtype"):
        WeightStore({"a": torch.ones(1)}, dtype=torch.int8)
    huge = torch.empty(2**40, dtype=torch.float32, device="meta")
    with pytest.raises(WeightsDoNotFit) as err:
        WeightStore({"huge": huge})
    assert err.value.needed == 2**42 and err.value.available < err.value.needed


def allocation_events(fn, repeat=5):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(repeat):
            fn()
    return [e.name for e in prof.events() if e.cpu_memory_usage > 0]


def test_workspace_steady_loop_allocates_nothing():
    ws = Workspace("cpu")
    a, b = torch.randn(33, 17), torch.randn(17, 9)

    def step(rows=33):
        out = ws.get("out", (rows, 9), torch.float32)
        torch.matmul(a[:rows], b, out=out)
        col = ws.get("col", (9,), torch.float32)
        torch.sum(out, dim=0, out=col)
        return col

    first = step().clone()
    assert ws.allocations == 2
    assert allocation_events(step) == []  # measured by torch's profiler, not by the workspace itself
    assert ws.allocations == 2 and torch.allclose(step(), first)
    step(rows=20)  # smaller shapes reuse the same buffers
    assert ws.allocations == 2
    # The same loop without the workspace does allocate: the measurement can see allocations.
    assert allocation_events(lambda: torch.matmul(a, b).sum(dim=0))


def test_workspace_buffers_are_per_stream_and_grow():
    ws = Workspace("cpu")
    x = ws.get("x", (4,), torch.float32)
    assert ws.get("x", (2, 2), torch.float32).data_ptr() == x.data_ptr()
    assert ws.get("y", (4,), torch.float32).data_ptr() != x.data_ptr()
    bigger = ws.get("x", (1000,), torch.float64)
    assert bigger.shape == (1000,) and ws.allocations == 3 and ws.nbytes >= 8000
    with pytest.raises(ValueError, match="shape"):
        ws.get("x", (-1,), torch.float32)


def test_workspace_clear_releases_memory_and_keeps_counting_allocations():
    """clear() kept the count without saying so: it is cumulative (as torch.cuda.memory_stats' counters
    stay through empty_cache), documented, and shown next to what is held now."""
    ws = Workspace("cpu")
    ws.get("x", (64,), torch.float32)
    ws.get("y", (64,), torch.float32)
    assert repr(ws) == "Workspace(2 buffers, 512 bytes on cpu; 2 allocations since created)"
    ws.clear()
    assert ws.nbytes == 0 and ws.allocations == 2
    assert repr(ws) == "Workspace(0 buffers, 0 bytes on cpu; 2 allocations since created)"
    ws.get("x", (64,), torch.float32)  # allocates again, and the count shows it
    assert ws.allocations == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_workspace_steady_loop_allocates_nothing():
    ws = Workspace("cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    assert ws.get("x", (64,), torch.float32, stream=s1).data_ptr() != ws.get("x", (64,), torch.float32, stream=s2).data_ptr()
    a = torch.randn(256, 256, device="cuda")

    def step():
        out = ws.get("out", (256, 256), torch.float32)
        torch.matmul(a, a, out=out)

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
