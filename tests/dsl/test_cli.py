"""``ninefold dsl show MODULE:KERNEL`` in a real subprocess."""

import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "ninefold", "dsl", *args], capture_output=True, text=True, timeout=300)


def test_show_prints_the_generated_triton_source():
    result = run("show", "tests.dsl.test_backends:mm")
    assert result.returncode == 0, result.stderr
    assert "@triton.jit" in result.stdout and "tl.dot(" in result.stdout
    compile(result.stdout, "generated", "exec")


def test_show_rejects_what_is_not_a_kernel():
    result = run("show", "tests.dsl.test_backends:random")
    assert result.returncode == 2 and "not a ninefold.dsl kernel" in result.stderr
    result = run("show", "no_colon_here")
    assert result.returncode == 2 and "MODULE:KERNEL" in result.stderr
