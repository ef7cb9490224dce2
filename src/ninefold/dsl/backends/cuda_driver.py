"""Launch a cubin through the CUDA driver API (``ctypes`` on ``libcuda``), without Triton."""

from __future__ import annotations

import ctypes

import torch

_CTYPES = {
    "u64": ctypes.c_uint64,
    "b64": ctypes.c_uint64,
    "s64": ctypes.c_int64,
    "u32": ctypes.c_uint32,
    "b32": ctypes.c_uint32,
    "s32": ctypes.c_int32,
    "u16": ctypes.c_uint16,
    "b16": ctypes.c_uint16,
    "u8": ctypes.c_uint8,
    "b8": ctypes.c_uint8,
    "f32": ctypes.c_float,
    "f64": ctypes.c_double,
}
_DRIVER = {}
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, then a 64-byte value union (72 bytes)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (56 bytes): the grid and block shape, dynamic shared memory, stream and attributes."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


def pdl_config(threads: int, shared: int) -> LaunchConfig:
    """A launch configuration of ``threads`` per block and ``shared`` bytes that lets the kernel start while the one
    before it in the stream finishes (programmatic dependent launch: the kernel waits for it with
    ``griddepcontrol.wait``, Triton's ``gdc_wait``); set its grid and stream per launch."""
    attribute = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = LaunchConfig(block_x=threads, block_y=1, block_z=1, shared=shared, attrs=ctypes.pointer(attribute),
                          num_attrs=1)
    config._attribute = attribute  # kept alive with the configuration
    return config


def driver():
    """The process's driver handle (loads ``libcuda.so.1`` on first use)."""
    if "driver" not in _DRIVER:
        _DRIVER["driver"] = _Driver()
    return _DRIVER["driver"]


class _Driver:
    """Module loading and kernel launch on torch's current context and stream."""

    SHARED_LIMIT = 49152
    MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.functions = {}

    def check(self, result, what):
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"CUDA driver: {what} failed with {name.value.decode() if name.value else result}")

    def function(self, cubin, meta, device):
        key = (str(cubin), device.index)
        if key not in self.functions:
            torch.cuda.init()
            with torch.cuda.device(device):
                torch.empty(1, device=device)  # makes torch's primary context current on this thread
                image = cubin.read_bytes()
                module, function = ctypes.c_void_p(), ctypes.c_void_p()
                self.check(self.lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
                self.check(
                    self.lib.cuModuleGetFunction(ctypes.byref(function), module, meta["function"].encode()),
                    "cuModuleGetFunction",
                )
                shared = meta["shared"]
                if shared > self.SHARED_LIMIT:
                    self.check(
                        self.lib.cuFuncSetAttribute(function, self.MAX_DYNAMIC_SHARED, ctypes.c_int(shared)),
                        "cuFuncSetAttribute",
                    )
            self.functions[key] = (module, function)
        return self.functions[key][1]

    def launch(self, cubin, meta, device, grid, launch):
        """Launch ``grid`` programs; ``launch`` holds ``(type, value)`` per kernel argument, in order."""
        function = self.function(cubin, meta, device)
        ptx = meta["ptx_params"]
        if len(ptx) < len(launch):
            raise RuntimeError(f"{meta['kernel']}: the cubin takes {len(ptx)} parameters, the launch has {len(launch)}")
        holders, scratch = [], []
        for i, kind in enumerate(ptx):
            if i < len(launch):
                _, value = launch[i]
                value = value.data_ptr() if isinstance(value, torch.Tensor) else value
            else:
                value = 0
                extra = i - len(launch)
                size = meta["global_scratch_size"] if extra == 0 else meta["profile_scratch_size"]
                if size:
                    buffer = torch.empty(size * grid, dtype=torch.uint8, device=device)
                    scratch.append(buffer)
                    value = buffer.data_ptr()
            holders.append(_CTYPES[kind](value))
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        stream = torch.cuda.current_stream(device).cuda_stream
        with torch.cuda.device(device):
            self.check(
                self.lib.cuLaunchKernel(
                    function, grid, 1, 1, 32 * meta["num_warps"], 1, 1, meta["shared"], ctypes.c_void_p(stream), params, None
                ),
                "cuLaunchKernel",
            )
        del scratch
