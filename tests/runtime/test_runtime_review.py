"""Review of the runtime layer: argument validation, accounting after errors, profile cache robustness.

Each test pins a defect found in review (it fails on the code before the fix).
"""

import gc
import json
import os
import subprocess
import sys
import warnings
import weakref

import numpy as np
import psutil
import pytest
import torch

from ninefold.runtime import CudaGraphRunner, Device, KVCachePool, TaskFailed, TaskGraph
from ninefold.runtime.memory import WeightStore, Workspace
from ninefold.runtime.profile import HardwareProfile, cache_path, profile_device


def run_python(code: str, env: dict | None = None) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout (the test fails on a non-zero exit)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=os.environ | (env or {}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# -- KVCachePool ------------------------------------------------------------------------------------

# A swap whose copy fails (here: the process may not map the staging buffer, RLIMIT_AS) must leave the
# block accounting as it was: no host block or device block lost.
_SWAP_FAILURE = """
import resource, torch
from ninefold.runtime import KVCachePool

def vm_size():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

pool = KVCachePool(1, 8, 512, 1024, torch.float32, "cpu", 3, policy="swap", num_host_blocks=2)  # 32 MiB blocks
ids = pool.allocate(2)
pool.k_cache(0)[ids[1]] = 5.0
host = pool.swap_out(ids[1:])                      # succeeds: one host block used, ids[1] free again
torch.ones(16).sum()                               # thread pools started before the limit
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + pool.bytes_per_block // 2, resource.RLIM_INFINITY))
for what, call in (("swap_out", lambda: pool.swap_out(ids[:1])), ("swap_in", lambda: pool.swap_in(host))):
    try:
        call()
        print(what, "did not fail")
    except RuntimeError:
        print(what, "failed", pool.num_free, pool.num_free_host, pool.ref_count(ids[0]))
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
back = pool.swap_in(host)                          # the host block still holds its data
print("back", pool.num_free, pool.num_free_host, bool((pool.k_cache(0)[back[0]] == 5.0).all()))
"""


def test_a_swap_whose_copy_fails_loses_no_block():
    lines = run_python(_SWAP_FAILURE).splitlines()
    # 3 blocks: ids[0] held, 2 free; 2 host blocks: 1 used.
    assert lines == ["swap_out failed 2 1 1", "swap_in failed 2 1 1", "back 1 2 True"], lines


# On the CPU the device blocks and the host (swap) blocks come out of the same memory: together they
# must fit. RLIMIT_AS keeps the old code's attempt from touching that much memory.
_CPU_SWAP_TOTAL = """
import resource, torch
from ninefold.runtime import Device, KVCacheExhausted, KVCachePool

def vm_size():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

per_block = 2 * 1 * 2048 * 8 * 512 * 4             # 64 MiB
n = int(0.6 * Device("cpu").available_bytes()) // per_block
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + 2 * 2**30, resource.RLIM_INFINITY))
try:
    KVCachePool(1, 8, 512, 2048, torch.float32, "cpu", n, policy="swap", num_host_blocks=n)
    print("created")
except KVCacheExhausted as e:
    print("exhausted", e.unit, e.needed == n * per_block, "num_host_blocks" in str(e))
except RuntimeError as e:
    print("allocator", str(e)[:80])
"""


def test_cpu_pool_counts_swap_blocks_against_the_same_memory():
    assert run_python(_CPU_SWAP_TOTAL).strip() == "exhausted bytes True True"


def test_from_memory_on_cpu_leaves_room_for_the_swap_space():
    per_block = 2 * 1 * 16 * 8 * 256 * 4  # 256 KiB
    vm = psutil.virtual_memory()
    budget, swap = 1024 * 2**20, 768 * 2**20
    reserve = vm.available - int(vm.total * 0.1) - budget  # leaves about 1 GiB for the KV cache and its swap space
    pool = KVCachePool.from_memory(1, 8, 256, 16, torch.float32, "cpu", memory_fraction=0.9, reserved_bytes=reserve,
                                   policy="swap", swap_bytes=swap)
    assert pool.num_host_blocks == swap // per_block
    device_bytes, host_bytes = pool.num_blocks * per_block, pool.num_host_blocks * per_block
    # Without the swap space counted the pool took the whole budget (about 1 GiB) on top of 768 MiB of host blocks.
    assert 0 < device_bytes and device_bytes + host_bytes < budget + 256 * 2**20, (device_bytes, host_bytes)


@pytest.mark.parametrize("kwargs", [dict(policy="swap", swap_bytes=1), dict(policy="preempt", swap_bytes=1 << 20)])
def test_from_memory_swap_errors_name_swap_bytes(kwargs):
    with pytest.raises(ValueError, match="swap_bytes"):
        KVCachePool.from_memory(1, 1, 4, 4, torch.float32, "cpu", num_blocks=4, **kwargs)


def test_from_memory_checks_profile_fn():
    with pytest.raises(TypeError, match="profile_fn"):
        KVCachePool.from_memory(1, 1, 4, 4, torch.float32, "cpu", num_blocks=4, profile_fn=3)


def test_block_ids_other_than_lists_of_ints():
    pool = KVCachePool(1, 1, 4, 4, torch.float32, "cpu", 4, policy="swap", num_host_blocks=2)
    with pytest.raises(TypeError, match=r"ids: expected a list of block ids \(ints\), got int 3"):
        pool.free(3)  # the common slip: one id, not a list
    with pytest.raises(TypeError, match="ids: .*float 1.0"):
        pool.incref([1.0])
    with pytest.raises(TypeError, match="ids: .*float32 tensor"):
        pool.free(torch.tensor([0.0]))
    with pytest.raises(TypeError, match="host_id"):
        pool.host_block(0.5)
    with pytest.raises(TypeError, match="host_ids"):
        pool.swap_in(1)
    with pytest.raises(ValueError, match=r"host_id: .*\[0, 2\), got 2"):
        pool.host_block(2)
    # Integers of other types (numpy, 0-d tensors, as a tensor's elements give them) are block ids.
    a, b = pool.allocate(2)
    pool.incref([np.int64(a), torch.tensor(b)])
    assert pool.ref_count(np.int32(a)) == 2 and pool.ref_count(torch.tensor(b)) == 2
    pool.free(np.array([a, b]))
    pool.free([torch.tensor(a), b])
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        pool.free([np.int64(a)])


# -- WeightStore / Workspace ------------------------------------------------------------------------

def test_weight_store_of_parameters_records_no_autograd_and_keeps_no_source_alive():
    param = torch.nn.Parameter(torch.randn(6, 4))
    expected = param.detach().clone()
    store = WeightStore({"w": param, "tied": param})
    w = store["w"]
    assert not w.requires_grad and w.grad_fn is None and not store._buffer.requires_grad
    assert torch.equal(w, expected)
    source = weakref.ref(param)
    del param
    gc.collect()
    assert source() is None  # the store does not hold the loaded tensors through a grad_fn


def test_weight_store_rejects_meta_tensors_by_name():
    with pytest.raises(ValueError, match=r"tensors\['m'\]: a meta tensor"):
        WeightStore({"a": torch.ones(2), "m": torch.empty(3, device="meta")})


def test_workspace_shape_arguments():
    ws = Workspace("cpu")
    assert ws.get("x", 5, torch.float32).shape == (5,)  # an int, as torch.empty takes
    assert ws.get("x", (np.int64(2), 2), torch.float32).shape == (2, 2)
    with pytest.raises(TypeError, match=r"shape: expected ints, got \(2.5,\)"):
        ws.get("x", (2.5,), torch.float32)
    with pytest.raises(TypeError, match="shape"):
        ws.get("x", "12", torch.float32)
    with pytest.raises(TypeError, match="shape"):
        ws.get("x", (True, 2), torch.float32)


def test_workspace_request_beyond_memory_is_an_error_and_changes_nothing():
    ws = Workspace("cpu")
    x = ws.get("x", (64,), torch.float32)
    before = (ws.allocations, ws.nbytes)
    for shape in [(2**40,), (2**62,)]:  # more than any host here has; the second overflows a C long
        with pytest.raises(ValueError, match=r"shape: .* needs \d+ bytes but cpu has \d+ available"):
            ws.get("x", shape, torch.float32)
    assert (ws.allocations, ws.nbytes) == before
    assert ws.get("x", (64,), torch.float32).data_ptr() == x.data_ptr()  # the old buffer is still used


# -- TaskGraph --------------------------------------------------------------------------------------

def test_tasks_inside_lists_and_dicts_are_dependencies():
    g = TaskGraph("cpu")
    a = g.add(lambda: torch.ones(2), name="a")
    b = g.add(lambda: torch.full((2,), 2.0), name="b")
    cat = g.add(torch.cat, [a, b], name="cat")
    total = g.add(lambda parts, scale: sum(p.sum() for p in parts["xs"]) * scale, {"xs": (a, b)}, scale=3,
                  name="total")
    assert cat.deps == (a, b) and total.deps == (a, b)
    out = g.run()
    assert torch.equal(out["cat"], torch.tensor([1.0, 1.0, 2.0, 2.0])) and out["total"].item() == 18.0

    def boom():
        raise OSError("disk gone")

    g2 = TaskGraph("cpu")
    bad = g2.add(boom, name="bad")
    g2.add(torch.stack, [bad, bad], name="stack")
    with pytest.raises(TaskFailed) as err:
        g2.run()
    assert err.value.skipped == ["stack"]  # skipped, not called with a Task object


def test_after_takes_a_single_task():
    log = []
    g = TaskGraph("cpu")
    a = g.add(log.append, "a")
    b = g.add(log.append, "b", after=a)
    assert b.deps == (a,)
    g.run()
    assert log == ["a", "b"]
    with pytest.raises(TypeError, match="after"):
        g.add(print, after=3)


def test_default_names_do_not_collide_with_given_ones():
    g = TaskGraph("cpu")
    g.add(print, name="print#1")
    first = g.add(print)  # would be "print#1"
    second = g.add(print)
    assert len({t.name for t in g.tasks}) == 3 and first.name != second.name


def test_stream_argument_is_checked():
    g = TaskGraph("cpu")
    with pytest.raises(TypeError, match="stream: .*got int"):
        g.add(print, stream=5)
    g.add(print, stream=Device("cpu").stream())  # a stream object is accepted


def test_every_failed_task_is_named():
    g = TaskGraph("cpu")

    def first():
        raise KeyError("k")

    def second():
        raise ZeroDivisionError("z")

    g.add(first, name="first")
    g.add(second, name="second")
    with pytest.raises(TaskFailed) as err:
        g.run()
    assert list(err.value.failed) == ["first", "second"]
    assert "'first' raised KeyError" in str(err.value) and "'second' raised ZeroDivisionError" in str(err.value)


# -- CudaGraphRunner --------------------------------------------------------------------------------

def ident(x):
    return x * 2


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(batch_sizes=8), TypeError, "batch_sizes: expected a sequence"),
    (dict(batch_sizes=[1, True, 8]), ValueError, "batch_sizes"),
    (dict(batch_sizes=[1, "a", 8]), ValueError, "batch_sizes"),
    (dict(warmup=-1), ValueError, "warmup"),
    (dict(warmup=1.5), ValueError, "warmup"),
    (dict(pad_values=["x"]), TypeError, "pad_values"),
    (dict(example_inputs=[torch.ones(8), torch.ones(8, device="meta")]), ValueError, "example_inputs: .*meta"),
])
def test_runner_constructor_names_the_bad_argument(kwargs, error, words):
    args = dict(batch_sizes=[1, 8], example_inputs=[torch.ones(8)]) | kwargs
    with pytest.raises(error, match=words):
        CudaGraphRunner(ident, **args)


@pytest.mark.parametrize("bad, words", [
    ([1.0, 2.0], "got list"),
    (torch.tensor(1.0), r"got torch.float32 \(\)"),
    (torch.ones(2, device="meta"), "on cpu, got one on meta"),
])
def test_runner_call_names_the_bad_input(bad, words):
    runner = CudaGraphRunner(ident, [1, 8], [torch.ones(8)])
    with pytest.raises(ValueError, match=r"inputs\[0\]: .*" + words):
        runner(bad)
    assert torch.equal(runner(torch.ones(3)), torch.full((3,), 2.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runner_capture_that_raised_is_retried():
    calls = {"n": 0}

    def flaky(x):
        calls["n"] += 1
        if x.shape[0] == 1 and calls["n"] < 5:  # the capture of the smallest size fails once
            raise RuntimeError("transient")
        return x * 2

    runner = CudaGraphRunner(flaky, [1, 2], [torch.ones(2, device="cuda")], warmup=1)
    with pytest.raises(RuntimeError, match="transient"):
        runner(torch.ones(1, device="cuda"))
    torch.testing.assert_close(runner(torch.full((1,), 3.0, device="cuda")), torch.full((1,), 6.0, device="cuda"))


# -- Device -----------------------------------------------------------------------------------------

def test_device_arguments_are_checked():
    with pytest.raises(TypeError, match="device_type: .*got int 5"):
        Device.count(5)
    with pytest.raises(TypeError, match="fn: expected a callable"):
        Device("cpu").peak_bytes(3)


# -- Hardware profiles ------------------------------------------------------------------------------

def good_profile() -> dict:
    return {"device": "cpu", "name": "test cpu", "compute": {"bfloat16": 3e11, "float16": 1e10, "float32": 1e11},
            "bandwidth": {"copy": 4e10}, "capacity": {"total": 2**30, "free": 2**29},
            "interconnect": {"loopback_tcp": 5e9}, "measured": {"date": "2026-01-01"}}


@pytest.mark.parametrize("damage", [
    lambda d: d["compute"].pop("float16"),            # an older format: fewer dtypes
    lambda d: d["bandwidth"].update(copy="fast"),
    lambda d: d["compute"].update(float32=float("nan")),
    lambda d: d["compute"].update(float32=-1.0),
    lambda d: d.update(compute=[1, 2, 3]),
    lambda d: d["interconnect"].pop("loopback_tcp"),
    lambda d: d.update(name=None),
    lambda d: d.pop("measured"),
])
def test_from_dict_rejects_what_is_not_a_profile(damage):
    data = good_profile()
    assert HardwareProfile.from_dict(data).compute == data["compute"]
    damage(data)
    with pytest.raises(ValueError, match="data"):
        HardwareProfile.from_dict(data)
    with pytest.raises(ValueError, match="data"):
        HardwareProfile.from_dict([data])


def test_stale_cache_file_is_measured_again_by_the_command(tmp_path):
    env = {"NINEFOLD_CACHE_DIR": str(tmp_path)}
    path = run_python("from ninefold.runtime.profile import cache_path; print(cache_path('cpu'))", env).strip()
    stale = good_profile()
    del stale["compute"]["float16"]                    # as a version that measured two dtypes wrote it
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump(stale, f)
    cmd = [sys.executable, "-m", "ninefold", "profile", "device", "--device", "cpu"]
    result = subprocess.run(cmd, env=os.environ | env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[1].split()[0] == "cpu"
    with open(path) as f:
        rewritten = json.load(f)
    assert set(rewritten["compute"]) == {"bfloat16", "float16", "float32"} and rewritten["name"] != "test cpu"


def test_unwritable_cache_dir_still_returns_the_profile(tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("NINEFOLD_CACHE_DIR points at a file")
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(not_a_dir))
    with pytest.warns(RuntimeWarning, match="not cached"):
        profile = profile_device("cpu", progress=False, min_time=0.01)
    assert set(profile.compute) == {"bfloat16", "float16", "float32"} and profile.bandwidth["copy"] > 0


def test_cache_path_taken_by_a_directory_warns_and_leaves_no_temporary(tmp_path, monkeypatch):
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))
    path = cache_path("cpu")
    path.mkdir(parents=True)
    with pytest.warns(RuntimeWarning, match="not cached"):
        profile = profile_device("cpu", progress=False, min_time=0.01)
    assert profile.compute["float32"] > 0
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no *.tmp left behind


def test_profile_numbers_are_checked():
    profile = HardwareProfile.from_dict(good_profile())
    with pytest.raises(ValueError, match="flop"):
        profile.roofline_seconds("many", 1, "float32")
    with pytest.raises(ValueError, match="nbytes"):
        profile.roofline_seconds(1, -5, "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="min_time"):
            profile_device("cpu", min_time=-1)
