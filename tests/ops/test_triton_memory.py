"""Memory-bound Triton kernels (norm, softmax, rope, gated activations): every launch-configuration
candidate of ``ninefold.bench.ops_memory`` compiles for sm_90 with 128-bit accesses, runs correctly
under Triton's interpreter (float32, odd sizes, strided rows, tails), and the benchmark runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from ninefold.bench import ops_memory  # noqa: E402
from ninefold.ops import workloads  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).with_name("test_triton_memory_interp.py")
# Integer arguments that carry row/token counts or head counts (not specialised as divisible by 16).
_UNALIGNED_INTS = {"n_rows", "n_tokens", "hq", "hk"}


def _compile(variant: dict, dtype):
    """Compile like the JIT does for 16-byte-aligned tensors (pointers, widths and strides divisible by 16)."""
    from triton.compiler import ASTSource

    from ninefold.ops.triton import aot

    kernel = variant["kernel"]
    sig = aot.signature(kernel, dtype, variant["constexprs"])
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if sig[name].startswith("*") or (sig[name] == "i32" and name not in _UNALIGNED_INTS)}
    source = ASTSource(kernel, sig, variant["constexprs"], attrs)
    return triton.compile(source, target=aot.parse_target("cuda:90"),
                          options={"num_warps": variant["num_warps"], "num_stages": 2})


def _variants(op: str):
    """The default variants plus one per benchmark candidate, at Llama-3-8B shapes."""
    mod = ops_memory.module(op)
    shapes = workloads.shapes("llama-8b")
    found = []
    for cfg in [None, *ops_memory.CANDIDATES[op]]:
        mod.OVERRIDE.clear()
        mod.OVERRIDE.update(cfg or {})
        found += mod.aot_variants(op, torch.bfloat16, shapes)
    mod.OVERRIDE.clear()
    unique = {(v["kernel"].fn.__name__, tuple(sorted(v["constexprs"].items())), v["num_warps"]): v for v in found}
    return list(unique.values())


@pytest.mark.parametrize("op", ops_memory.OPS)
def test_candidates_compile_for_sm90_with_128_bit_accesses(op):
    for variant in _variants(op):
        ptx = _compile(variant, torch.bfloat16).asm["ptx"]
        assert ".target sm_90" in ptx
        accesses = [line.split()[1] for line in ptx.splitlines() if ("ld.global" in line or "st.global" in line)
                    and len(line.split()) > 1 and "evict_last" not in line]
        wide = [a for a in accesses if ".v4." in a]
        # Streamed rows move in 8- or 16-byte vectors (16 where a thread holds 8 or more elements);
        # rope's 8 k heads of 64-element halves leave some narrower accesses.
        assert wide or op != "rope", f"{op} {variant['constexprs']}: no 128-bit accesses in {sorted(set(accesses))}"
        if op != "rope":
            scalar = [a for a in accesses if ".v2." not in a and ".v4." not in a and not a.endswith(".b64")]
            assert not scalar, f"{op} {variant['constexprs']} {variant['num_warps']} warps: {sorted(set(scalar))}"


def test_kernels_match_float64_references_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", str(CHECKS)],
                         env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout, run.stdout[-2000:]


def test_bench_runs_on_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "ninefold.bench.ops_memory", "--device", "cpu", "--shapes", "tiny",
                          "--dtype", "float32", "--ops", "add_rms_norm", "rope", "--tokens", "3"], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "ops_memory.json").read_text())
    assert set(result["correctness"].values()) == {"ok"}
    assert {r["op"] for r in result["timings"]} == {"add_rms_norm", "rope"}
    assert set(result["winners"]) == {"add_rms_norm", "rope"}
    assert "winner rope" in run.stdout


def test_launcher_key_separates_what_triton_specialises_on():
    from ninefold.ops.triton import launch, norm

    key = launch.Launcher.key
    x = torch.zeros(4, 64)
    base = (x, x, torch.nn.Parameter(x[0]), x, x, 4, 64, 64, 64, 64, 64, 1e-5)
    consts = (False, 64)
    assert key(base, consts, 4, 2) == key(tuple(base), consts, 4, 2)
    changed = {
        "dtype": (base[:2] + (x[0].half(),) + base[3:], consts),
        "alignment": ((torch.zeros(4 * 64 + 1)[1:].view(4, 64),) + base[1:], consts),
        "width one": (base[:6] + (1,) + base[7:], consts),
        "width not divisible by 16": (base[:6] + (40,) + base[7:], consts),
        "64-bit integer": (base[:7] + (1 << 33,) + base[8:], consts),
        "constexpr": (base, (True, 64)),
        "missing pointer": (base[:1] + (None,) + base[2:], consts),
    }
    for what, (args, c) in changed.items():
        assert key(args, c, 4, 2) != key(base, consts, 4, 2), what
    assert key(base, consts, 8, 2) != key(base, consts, 4, 2)
    with pytest.raises(ValueError, match="must be its last parameters"):
        launch.Launcher(norm.rms_norm_kernel, ("HAS_RESIDUAL",))


def test_direct_launch_is_off_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from ninefold.ops.triton import launch; print(launch.AVAILABLE, launch.ENABLED)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.stdout.split() == ["False", "False"], run.stderr[-2000:]
