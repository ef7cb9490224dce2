"""Device: parsing, identity, memory figures against /proc/meminfo, streams and events on the CPU."""

import pytest
import torch

from ninefold.runtime import Device

from .helpers import cpu_peak_of_temporary


def meminfo_bytes(key):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_cpu_device_identity():
    dev = Device("cpu")
    assert (dev.type, dev.index, dev.torch, dev.is_accelerator) == ("cpu", None, torch.device("cpu"), False)
    assert Device(torch.device("cpu")) == dev == Device(dev) == Device("cpu:0") and hash(dev) == hash(Device("cpu"))
    assert isinstance(dev.name, str) and dev.name
    assert Device.count("cpu") == 1 and Device.all()[0] == dev


def test_current_is_cpu_without_accelerator():
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    assert Device.current() == Device("cpu")


def test_cpu_memory_info_matches_the_os():
    free, total = Device("cpu").memory_info()
    assert total == meminfo_bytes("MemTotal")
    assert 0 < free <= total
    assert abs(free - meminfo_bytes("MemAvailable")) < total // 20  # read at slightly different times


def test_cpu_available_bytes_is_what_the_os_has_available():
    assert abs(Device("cpu").available_bytes() - meminfo_bytes("MemAvailable")) < meminfo_bytes("MemTotal") // 20


def test_cpu_streams_and_events_run_in_order():
    dev = Device("cpu")
    stream = dev.stream()
    with dev.use_stream(stream):
        x = torch.arange(4.0) * 2
    event = dev.event()
    event.record(dev.current_stream())
    event.synchronize()
    dev.synchronize()
    assert event.query() and torch.equal(x, torch.tensor([0.0, 2, 4, 6]))


def test_pin_on_cpu_returns_the_tensor_and_checks_input():
    dev = Device("cpu")
    t = torch.ones(3)
    assert dev.pin(t) is t
    with pytest.raises(TypeError, match="tensor"):
        dev.pin([1, 2])
    assert dev.empty_host((2, 3), torch.float16).shape == (2, 3)


def test_peak_bytes_sees_a_temporary():
    peak = cpu_peak_of_temporary(32 * 2**20)
    assert 100 * 2**20 < peak < 1024 * 2**20  # the 128 MiB tensor, plus a little


@pytest.mark.parametrize("spec, error, words", [
    ("gpu:0", ValueError, "not a torch device"),
    (3.5, TypeError, "expected a str"),
    ("meta", ValueError, "not available"),
    # The index was dropped: Device("cpu:3") became Device("cpu"). The host is one device, as Device.count says.
    ("cpu:3", ValueError, r"device: index 3 of 'cpu' is out of range \(got 'cpu:3'\); the host is one device"),
    (torch.device("cpu", 1), ValueError, r"index 1 of 'cpu' is out of range \(got 'cpu:1'\)"),
])
def test_bad_specs_say_what_is_accepted(spec, error, words):
    with pytest.raises(error, match=words):
        Device(spec)


def test_count_rejects_unknown_types():
    with pytest.raises(ValueError, match="device_type"):
        Device.count("nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device():
    dev = Device("cuda")
    assert dev.index == torch.cuda.current_device() and dev.is_accelerator
    free, total = dev.memory_info()
    assert 0 < free <= total
    assert dev.pin(torch.ones(4)).is_pinned()
    s = dev.stream()
    with dev.use_stream(s):
        y = torch.ones(1024, device=dev.torch) * 3
    e = dev.event(enable_timing=True)
    e.record(s)
    e.synchronize()
    assert y.sum().item() == 3 * 1024
    with pytest.raises(ValueError, match="out of range"):
        Device(f"cuda:{torch.cuda.device_count()}")
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev.torch)
    del block  # back to torch's cache: not free for the driver, but available to torch
    free_now, _ = dev.memory_info()
    assert dev.available_bytes() >= free_now + 256 * 2**20
