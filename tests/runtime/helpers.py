"""Shared helpers for the runtime tests."""

import subprocess
import sys

_PEAK_PROBE = """
import sys
import torch
from ninefold.runtime import Device
n = int(sys.argv[1])
print(Device("cpu").peak_bytes(lambda: torch.ones(n, dtype=torch.float32).sum()))
"""


def cpu_peak_of_temporary(num_floats: int) -> int:
    """``Device("cpu").peak_bytes`` of a temporary float32 tensor of ``num_floats`` values, measured
    in a fresh process: a test worker may hold freed memory resident, which the tensor then reuses
    without raising the peak."""
    probe = subprocess.run([sys.executable, "-c", _PEAK_PROBE, str(num_floats)], capture_output=True, text=True,
                           timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    return int(probe.stdout.split()[-1])
