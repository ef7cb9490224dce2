import subprocess
import sys

from ninefold.cli.main import main


def test_version_flag_prints_package_version(capsys):
    import ninefold

    try:
        main(["--version"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert ninefold.__version__ in capsys.readouterr().out


def test_console_entry_point_runs_as_module():
    result = subprocess.run([sys.executable, "-m", "ninefold", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "usage: ninefold" in result.stdout


def test_command_line_and_engine_import_only_what_generation_needs():
    """Starting ``ninefold generate`` on a CPU imports neither the HTTP stack of the benchmarks and
    server nor torch's compiler stack (2-3 s of a command's start before these were deferred)."""
    probe = ("import sys; import ninefold.cli.main as m; m.build_parser(); import ninefold.llm.engine, ninefold.ops; "
             "print(' '.join(x for x in ('httpx', 'fastapi', 'torch.nn.attention.varlen', 'torch._dynamo') "
             "if x in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == []
