"""Running a benchmark module in a fresh process, as its users do."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, *args: str, out=None, interpret: bool = True, timeout: int = 600):
    """``python -m ninefold.bench.<module> *args`` from the repository root; ``out``: its ``$OUT``;
    ``interpret``: Triton kernels under the interpreter (``TRITON_INTERPRET=1``), else unset."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run([sys.executable, "-m", f"ninefold.bench.{module}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
