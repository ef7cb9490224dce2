"""One interface over torch devices: the CPU, ``cuda:N`` and any other torch accelerator.

Everything goes through ``torch.get_device_module(type)`` (``torch.cuda``, ``torch.xpu``,
``torch.cpu`` ...), so the device name decides and no vendor-specific call leaks to callers.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

__all__ = ["Device"]


class Device:
    """A torch device with its streams, events, memory figures and pinned host memory.

    ``spec`` is ``"cpu"``, ``"cuda"``, ``"cuda:1"``, any other torch device string, a
    ``torch.device`` or a ``Device``. An accelerator without an index means its current index;
    an index out of range is a ``ValueError``. The host is one device: ``"cpu"`` and ``"cpu:0"``
    are the same, any other CPU index is refused (torch places such tensors on ``cpu`` anyway).
    """

    def __init__(self, spec: str | torch.device | Device = "cpu"):
        if isinstance(spec, Device):
            spec = spec.torch
        if not isinstance(spec, (str, torch.device)):
            raise TypeError(f"device: expected a str, torch.device or Device, got {type(spec).__name__}")
        try:
            dev = torch.device(spec)
        except RuntimeError as exc:
            raise ValueError(f"device: {spec!r} is not a torch device name (e.g. 'cpu', 'cuda:0')") from exc
        if dev.type == "cpu":
            if dev.index not in (None, 0):
                raise ValueError(f"device: index {dev.index} of 'cpu' is out of range (got {str(spec)!r}); the host "
                                 "is one device: 'cpu' or 'cpu:0'")
            dev = torch.device("cpu")
        else:
            module = getattr(torch, dev.type, None)
            if module is None or not hasattr(module, "is_available") or not module.is_available():
                raise ValueError(f"device: {spec!r} is not available here; available: {', '.join(available_types())}")
            count = module.device_count()
            index = module.current_device() if dev.index is None else dev.index
            if not 0 <= index < count:
                raise ValueError(f"device: index {index} of {dev.type!r} is out of range; this machine has {count}")
            dev = torch.device(dev.type, index)
        self.torch: torch.device = dev

    # -- identity -------------------------------------------------------------------------------

    @property
    def type(self) -> str:
        """The device type: ``"cpu"``, ``"cuda"``, ``"xpu"`` ..."""
        return self.torch.type

    @property
    def index(self) -> int | None:
        """The accelerator index, or None for the CPU."""
        return self.torch.index

    @property
    def is_accelerator(self) -> bool:
        """True for anything that is not the host CPU."""
        return self.type != "cpu"

    @property
    def module(self):
        """The torch module of this device type (``torch.cuda`` for ``cuda``, ``torch.cpu`` ...)."""
        return torch.get_device_module(self.type)

    @property
    def name(self) -> str:
        """The hardware's name (the CPU model, or the accelerator's product name)."""
        if self.type == "cpu":
            return _cpu_model_name()
        get_name = getattr(self.module, "get_device_name", None)
        return get_name(self.index) if get_name is not None else str(self.torch)

    def __repr__(self) -> str:
        return f"Device({str(self.torch)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and other.torch == self.torch

    def __hash__(self) -> int:
        return hash(self.torch)

    # -- enumeration ----------------------------------------------------------------------------

    @staticmethod
    def current() -> Device:
        """The current accelerator (at its current index) if one is present, else the CPU."""
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            return Device(accelerator.current_accelerator().type)  # no index: that type's current one
        return Device("cpu")

    @staticmethod
    def count(device_type: str | None = None) -> int:
        """How many devices of ``device_type`` (default: the current accelerator type) exist; the CPU is 1."""
        if device_type is not None and not isinstance(device_type, str):
            raise TypeError(f"device_type: expected None or a str such as 'cuda', got {type(device_type).__name__} "
                            f"{device_type!r}")
        device_type = device_type or Device.current().type
        if device_type == "cpu":
            return 1
        module = getattr(torch, device_type, None)
        if module is None or not hasattr(module, "device_count"):
            raise ValueError(f"device_type: {device_type!r} is not a torch device type; available: {', '.join(available_types())}")
        return module.device_count() if module.is_available() else 0

    @staticmethod
    def all() -> list[Device]:
        """The CPU followed by every accelerator of every available type."""
        devices = [Device("cpu")]
        for device_type in available_types():
            if device_type != "cpu":
                devices += [Device(f"{device_type}:{i}") for i in range(Device.count(device_type))]
        return devices

    # -- execution ------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait until all work queued on this device has finished."""
        if self.is_accelerator:
            self.module.synchronize(self.index)

    def stream(self, priority: int = 0):
        """A new stream on this device (on the CPU, torch's no-op stream: work runs in order)."""
        if self.is_accelerator:
            return self.module.Stream(self.torch, priority=priority)
        return torch.cpu.Stream()

    def current_stream(self):
        """The stream work is queued on now."""
        if self.is_accelerator:
            return self.module.current_stream(self.index)
        return torch.cpu.current_stream()

    def use_stream(self, stream):
        """Context manager making ``stream`` current (a no-op on the CPU)."""
        if self.is_accelerator:
            return self.module.stream(stream)
        return contextlib.nullcontext()

    def event(self, enable_timing: bool = False):
        """A new event; on the CPU events complete at once (work there runs in order)."""
        if self.is_accelerator:
            return self.module.Event(enable_timing=enable_timing)
        return torch.cpu.Event()

    # -- memory ---------------------------------------------------------------------------------

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes: the accelerator's memory, or on the CPU what the OS reports."""
        if not self.is_accelerator:
            return host_memory_info()
        mem_get_info = getattr(self.module, "mem_get_info", None)
        if mem_get_info is None:
            raise NotImplementedError(f"memory_info: torch.{self.type} has no mem_get_info")
        free, total = mem_get_info(self.index)
        return int(free), int(total)

    def available_bytes(self) -> int:
        """Bytes a new allocation can still get: free memory plus what torch's allocator holds unused."""
        free, _ = self.memory_info()
        if not self.is_accelerator:
            return free
        reserved = getattr(self.module, "memory_reserved", None)
        return free + (int(reserved(self.index)) - self.allocated_bytes() if reserved is not None else 0)

    def allocated_bytes(self) -> int:
        """Bytes held by live tensors on this device (torch's allocator); 0 where torch cannot tell."""
        fn = getattr(self.module, "memory_allocated", None) if self.is_accelerator else None
        return int(fn(self.index)) if fn is not None else 0

    def peak_bytes(self, fn) -> int:
        """Run ``fn()`` and return how far memory use rose above where it started (its peak).

        On accelerators this reads torch's allocator peak; on Linux CPUs the process's peak resident
        set (reset through ``/proc/self/clear_refs``). Used to size the activation reserve.
        """
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        if self.is_accelerator:
            self.synchronize()
            self.module.reset_peak_memory_stats(self.index)
            base = self.module.memory_allocated(self.index)
            fn()
            self.synchronize()
            return max(0, int(self.module.max_memory_allocated(self.index)) - int(base))
        if not _reset_peak_rss():
            fn()
            return 0
        base = _proc_status_kib("VmRSS")
        fn()
        return max(0, _proc_status_kib("VmHWM") - base) * 1024

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in page-locked host memory, so copies to this device can run asynchronously.

        On the CPU (nothing to copy to) the tensor is returned as it is.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor: pinning needs a host tensor, got one on {tensor.device}")
        if not self.is_accelerator or tensor.is_pinned():
            return tensor
        return tensor.pin_memory()

    def empty_host(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor, pinned when this device is an accelerator."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_accelerator)


def available_types() -> list[str]:
    """Device types torch can use on this machine, ``"cpu"`` first."""
    types = ["cpu"]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        types.append(accelerator.current_accelerator().type)
    return types


def host_memory_info() -> tuple[int, int]:
    """``(available, total)`` bytes of host memory as the OS reports them (``/proc/meminfo`` on Linux)."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {key}")


@functools.cache
def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or f"cpu ({os.cpu_count()} cores)"
