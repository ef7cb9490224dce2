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
