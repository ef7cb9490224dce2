"""The ``interpret`` backend: the generated Triton code under ``TRITON_INTERPRET=1``, on cpu tensors.

For debugging the code generator. The interpreter runs in a child process (see
``interpret_worker``). float32 and float16 only: the interpreter computes bfloat16 wrongly, so it
is refused.
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading

import torch

from ninefold.dsl.backends import cpu
from ninefold.dsl.backends.launch import argument_values, grid_size, prepare
from ninefold.dsl.cache import cache_dir
from ninefold.dsl.tuning import written_params as _written

DTYPES = (torch.float32, torch.float16, torch.int32, torch.int64, torch.int8, torch.int16, torch.uint8, torch.bool)
_lock = threading.Lock()
_worker: dict = {}


def run(kernel, bound):
    """Run ``kernel`` through Triton's interpreter on cpu tensors."""
    for p in bound.tensor_params():
        value = bound.values[p.name]
        if value.dtype == torch.bfloat16:
            raise TypeError(
                f"kernel {kernel.name}: argument {p.name} is bfloat16, which the interpret backend refuses "
                "(Triton's interpreter computes it wrongly); use float32/float16 or the cpu backend"
            )
        if value.dtype not in DTYPES:
            raise TypeError(
                f"kernel {kernel.name}: argument {p.name} has dtype {value.dtype}; the interpret backend runs float32 and float16"
            )
        if value.device.type != "cpu":
            raise ValueError(f"kernel {kernel.name}: backend 'interpret' needs cpu tensors; {p.name} is on {value.device}")
    bound = kernel.finish(bound, cpu.choose_meta(kernel, bound))
    if grid_size(bound) == 0:
        return
    generated, _ = prepare(kernel, bound, interpret=True)
    path = str(cache_dir("generated") / f"{generated.key}.py")
    args = argument_values(generated, bound)
    request = (path, f"ninefold_dsl_interpreted_{generated.key}", generated.function_name, (grid_size(bound),), args)
    with _lock:
        process = _start()
        try:
            pickle.dump(request, process.stdin)
            process.stdin.flush()
            status, kind, payload = pickle.load(process.stdout)
        except (EOFError, BrokenPipeError, OSError):
            _worker.clear()
            raise RuntimeError(f"kernel {kernel.name}: the interpreter process died (exit code {process.poll()})") from None
    if status != "ok":
        error = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
        raise error(f"kernel {kernel.name} under the Triton interpreter: {kind}: {payload}")
    written = _written(kernel)
    for (_, kind, name, _), original, returned in zip(generated.arguments, args, payload):
        if kind == "pointer" and name in written:
            original.copy_(returned)


def _start():
    process = _worker.get("process")
    if process is not None and process.poll() is None:
        return process
    env = dict(os.environ, TRITON_INTERPRET="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "ninefold.dsl.backends.interpret_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    _worker["process"] = process
    return process


@atexit.register
def _stop():
    process = _worker.get("process")
    if process is not None and process.poll() is None:
        process.stdin.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
