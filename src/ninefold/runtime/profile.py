"""Measured hardware profiles: compute, memory bandwidth, memory capacity and interconnect.

``profile_device(device)`` measures the four in a few seconds and caches the result under
``$NINEFOLD_CACHE_DIR/profiles`` keyed by the device's name, its type and the torch version (capacity
is re-read on every call: free memory changes). All figures are plain SI numbers: FLOP/s, bytes/s
(bytes read plus bytes written for copies), bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import re
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ninefold.runtime.device import Device

__all__ = ["HardwareProfile", "profile_device", "cache_dir", "cache_path"]

UNITS = {"compute": "FLOP/s (dense matmul)", "bandwidth": "bytes/s (read + written)",
         "capacity": "bytes", "interconnect": "bytes/s (moved one way)"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CPU_MATMUL_N = {torch.bfloat16: 512, torch.float16: 256, torch.float32: 512}


@dataclasses.dataclass
class HardwareProfile:
    """What one device can do, as measured.

    ``compute``: dtype name -> FLOP/s of a large matmul. ``bandwidth``: ``{"copy": bytes/s}`` of a
    large on-device copy. ``capacity``: ``{"total", "free"}`` bytes. ``interconnect``:
    ``"loopback_tcp"`` always; on accelerators ``"host_to_device"`` and ``"device_to_host"`` (pinned
    memory) and ``"device_to_device"`` (peer device string -> bytes/s). ``measured`` says how.
    """

    device: str
    name: str
    compute: dict[str, float]
    bandwidth: dict[str, float]
    capacity: dict[str, int]
    interconnect: dict
    measured: dict

    def to_dict(self) -> dict:
        """A JSON-ready dict, with ``units``."""
        return dataclasses.asdict(self) | {"units": UNITS}

    @classmethod
    def from_dict(cls, data: dict) -> HardwareProfile:
        """The inverse of ``to_dict``; raises ``ValueError`` naming the field when ``data`` is not a profile
        this version writes (a damaged or stale cache file)."""
        if not isinstance(data, dict):
            raise ValueError(f"data: expected a dict, got {type(data).__name__}")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data]
        if missing:
            raise ValueError(f"data: missing fields {missing}")
        for key in ("device", "name"):
            if not isinstance(data[key], str):
                raise ValueError(f"data[{key!r}]: expected a str, got {data[key]!r}")
        for key in ("compute", "bandwidth", "capacity", "interconnect", "measured"):
            if not isinstance(data[key], dict):
                raise ValueError(f"data[{key!r}]: expected a dict, got {type(data[key]).__name__}")
        _check_rates("compute", data["compute"], DTYPES)
        _check_rates("bandwidth", data["bandwidth"], ["copy"])
        _check_rates("interconnect", data["interconnect"], ["loopback_tcp"])
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})

    def roofline_seconds(self, flop: float, nbytes: float, dtype: torch.dtype | str) -> float:
        """The least time ``flop`` operations on ``nbytes`` of memory traffic can take on this device."""
        for arg, value in (("flop", flop), ("nbytes", nbytes)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{arg}: expected a finite number >= 0, got {value!r}")
        key = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        if key not in self.compute:
            raise ValueError(f"dtype: no measured compute rate for {dtype!r}; measured: {sorted(self.compute)}")
        return max(flop / self.compute[key], nbytes / self.bandwidth["copy"])


def cache_dir() -> Path:
    """``$NINEFOLD_CACHE_DIR/profiles`` (default ``~/.cache/ninefold/profiles``)."""
    root = os.environ.get("NINEFOLD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ninefold")
    return Path(root) / "profiles"


def cache_path(device: str | torch.device | Device = "cpu") -> Path:
    """The file ``profile_device`` keeps ``device``'s profile in."""
    dev = Device(device)
    return cache_dir() / f"{_slug(dev.name)}-{_cache_key(dev)}.json"


def profile_device(device: str | torch.device | Device = "cpu", *, refresh: bool = False,
                   progress: bool = True, min_time: float | None = None) -> HardwareProfile:
    """The device's profile: from the cache when there is one (unless ``refresh``), else measured.

    ``min_time`` is the seconds spent timing each figure (default 0.15 on the CPU, 0.5 on
    accelerators); ``progress`` shows a progress bar on stderr. A cache file that cannot be read or
    holds no valid profile is measured again; one that cannot be written is reported with a warning
    (the measured profile is still returned).
    """
    dev = Device(device)
    _check_min_time(min_time)
    path = cache_path(dev)
    if not refresh and path.is_file():
        try:
            profile = HardwareProfile.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            profile = None  # a damaged, unreadable or stale cache file is measured again
        if profile is not None:
            profile.device = str(dev.torch)
            profile.capacity = _capacity(dev)
            return profile
    profile = measure(dev, progress=progress, min_time=min_time)
    _write(path, json.dumps(profile.to_dict(), indent=1))
    return profile


def _write(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically; on failure warn and leave no temporary file behind."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        warnings.warn(f"hardware profile not cached: cannot write {path}: {exc}", RuntimeWarning, stacklevel=3)


def _check_min_time(min_time) -> None:
    if min_time is not None and (isinstance(min_time, bool) or not isinstance(min_time, (int, float))
                                 or not 0 <= min_time < math.inf):
        raise ValueError(f"min_time: expected None or seconds >= 0, got {min_time!r}")


def _check_rates(field: str, rates: dict, required) -> None:
    missing = [k for k in required if k not in rates]
    if missing:
        raise ValueError(f"data[{field!r}]: missing {missing}")
    for key, rate in rates.items():
        if isinstance(rate, dict):  # interconnect["device_to_device"]: peer -> rate
            _check_rates(f"{field}.{key}", rate, [])
        elif isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
            raise ValueError(f"data[{field!r}][{key!r}]: expected a positive finite rate, got {rate!r}")


def measure(device: Device, *, progress: bool = True, min_time: float | None = None) -> HardwareProfile:
    """Measure ``device``'s profile now (no cache)."""
    from tqdm import tqdm

    dev = Device(device)
    _check_min_time(min_time)
    if min_time is None:
        min_time = 0.5 if dev.is_accelerator else 0.15
    peers = [d for d in Device.all() if d.type == dev.type and d != dev] if dev.is_accelerator else []
    copy_bytes = _copy_bytes(dev)
    jobs: list[tuple[str, Callable[[], object]]] = [
        (f"matmul {name}", functools.partial(_matmul_rate, dev, dtype, min_time)) for name, dtype in DTYPES.items()]
    jobs.append(("device copy", functools.partial(_copy_rate, dev, copy_bytes, min_time)))
    if dev.is_accelerator:
        jobs.append(("host to device", functools.partial(_transfer_rate, dev, "h2d", copy_bytes // 2, min_time)))
        jobs.append(("device to host", functools.partial(_transfer_rate, dev, "d2h", copy_bytes // 2, min_time)))
        jobs += [(f"to {p.torch}", functools.partial(_peer_rate, dev, p, copy_bytes // 2, min_time)) for p in peers]
    jobs.append(("loopback tcp", functools.partial(_tcp_rate, min_time)))

    start = time.perf_counter()
    got: dict[str, object] = {}
    with tqdm(jobs, desc=f"profile {dev.torch}", unit="step", disable=not progress, leave=False) as bar:
        for label, job in bar:
            bar.set_postfix_str(label)
            got[label] = job()
    compute = {name: got[f"matmul {name}"][0] for name in DTYPES}
    sizes = {name: got[f"matmul {name}"][1] for name in DTYPES}
    interconnect: dict = {"loopback_tcp": got["loopback tcp"]}
    if dev.is_accelerator:
        interconnect["host_to_device"] = got["host to device"]
        interconnect["device_to_host"] = got["device to host"]
        interconnect["device_to_device"] = {str(p.torch): got[f"to {p.torch}"] for p in peers}
    measured = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - start, 2),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "matmul_n": sizes,
        "copy_bytes": copy_bytes,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    return HardwareProfile(str(dev.torch), dev.name, compute, {"copy": got["device copy"]}, _capacity(dev),
                           interconnect, measured)


# -- measurements ---------------------------------------------------------------------------------

def _time_per_call(fn: Callable[[], object], dev: Device, min_time: float) -> float:
    """The best seconds per call of ``fn``, over short groups of calls (a few ms each) for ``min_time``.

    Short groups let the best one fall where nothing else competed for the machine: the figure is a
    peak, not an average.
    """
    fn()
    dev.synchronize()
    t0 = time.perf_counter()
    fn()
    dev.synchronize()
    once = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, int((0.01 if dev.is_accelerator else 0.002) / once))
    best, spent, groups = math.inf, 0.0, 0
    while (spent < min_time or groups < 3) and groups < 100:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dev.synchronize()
        elapsed = time.perf_counter() - t0
        best, spent, groups = min(best, elapsed / reps), spent + elapsed, groups + 1
    return best


def _matmul_rate(dev: Device, dtype: torch.dtype, min_time: float) -> tuple[float, int]:
    """FLOP/s of an n x n x n matmul: on accelerators the best of n = 4096 and 8192, on the CPU
    ``CPU_MATMUL_N`` (float16 smaller: CPUs without native float16 matmul are slow at it)."""
    if dev.is_accelerator:
        best = (0.0, 0)
        for n in (4096, 8192):
            a = torch.randn(n, n, device=dev.torch).to(dtype)
            b = torch.randn(n, n, device=dev.torch).to(dtype)
            seconds = _time_per_call(lambda a=a, b=b: torch.mm(a, b), dev, min_time / 2)
            best = max(best, (2 * n**3 / seconds, n))
        return best
    n = CPU_MATMUL_N[dtype]
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    seconds = _time_per_call(lambda: torch.mm(a, b), dev, min_time)
    return 2 * n**3 / seconds, n


def _copy_bytes(dev: Device) -> int:
    if dev.is_accelerator:
        free, _ = dev.memory_info()
        return min(2 * 2**30, free // 8)
    return 256 * 2**20


def _copy_rate(dev: Device, nbytes: int, min_time: float) -> float:
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev.torch)
    dst = torch.empty_like(src)
    seconds = _time_per_call(lambda: dst.copy_(src), dev, min_time)
    return 2 * nbytes / seconds


def _transfer_rate(dev: Device, direction: str, nbytes: int, min_time: float) -> float:
    host = dev.pin(torch.ones(nbytes, dtype=torch.uint8))
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=dev.torch)
    src, dst = (host, on_device) if direction == "h2d" else (on_device, host)
    return nbytes / _time_per_call(lambda: dst.copy_(src, non_blocking=True), dev, min_time)


def _peer_rate(dev: Device, peer: Device, nbytes: int, min_time: float) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev.torch)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=peer.torch)

    def copy():
        dst.copy_(src, non_blocking=True)
        peer.synchronize()

    return nbytes / _time_per_call(copy, dev, min_time)


def _tcp_rate(min_time: float, chunk: int = 2**20) -> float:
    """Bytes/s sent through a TCP connection on 127.0.0.1 (sender and receiver in this process)."""
    total = 64 * chunk
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def receive():
            conn, _ = server.accept()
            with conn:
                buffer = bytearray(chunk)
                while True:
                    got = 0
                    while got < total:
                        n = conn.recv_into(buffer, chunk)
                        if n == 0:
                            return
                        got += n
                    conn.sendall(b"k")

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as client:
            payload = memoryview(bytes(chunk))

            def send():
                for _ in range(total // chunk):
                    client.sendall(payload)
                if client.recv(1) != b"k":
                    raise ConnectionError("loopback receiver closed early")

            seconds = _time_per_call(send, Device("cpu"), min_time)
        thread.join(timeout=10)
    return total / seconds


def _capacity(dev: Device) -> dict[str, int]:
    free, total = dev.memory_info()
    return {"total": total, "free": free}


def _cache_key(dev: Device) -> str:
    parts = [dev.type, dev.name, torch.__version__, str(Device.count(dev.type))]
    if not dev.is_accelerator:
        parts.append(str(torch.get_num_threads()))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()[:60] or "device"
