"""The ``ninefold`` command line as a user meets it: real ``python -m ninefold`` processes on tiny
checkpoints on disk (tests/server/tiny_model.py: one-layer Llama, 8192-token context, CPU).

Bad option values give one ``ninefold CMD: error: ...`` line naming the option, the value and what is
accepted, before any model loads (exit 2); Ctrl-C and a closed stdout end a command without a
traceback; ``ninefold chat`` reads piped input line by line; every option is described in --help.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ninefold.cli.main import build_parser
from server.tiny_model import CHAIN_TEXT, TRIGGER_CHAR, build_tiny_model

TIMEOUT = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny chat model directory (ChatML template, no generation_config.json)."""
    return build_tiny_model(tmp_path_factory.mktemp("cli") / "tiny").path


@pytest.fixture(scope="module")
def missing(tmp_path_factory):
    """A model path that does not exist: whatever loads it fails, so an error about anything else
    shows that the option was checked before the model."""
    return str(tmp_path_factory.mktemp("none") / "no-such-model")


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # so Python installs KeyboardInterrupt whatever started us


def ninefold(*args, input=None, env=None, **kwargs):
    """Run ``python -m ninefold ARGS`` to completion; text in and out."""
    full_env = None if env is None else {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "ninefold", *args], input=input, capture_output=True, text=True,
                          timeout=TIMEOUT, env=full_env, **kwargs)


def start(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ninefold", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_default_sigint, **kwargs)


def assert_usage_error(result, *needles):
    """Exit 2 and one error line on stderr naming each of ``needles``; no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------- numbers and devices


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(
    "flag, value, accepted",
    [
        ("--max-tokens", "-5", ">= 1"),
        ("--max-tokens", "0", ">= 1"),
        ("--temperature", "-1", ">= 0"),
        ("--temperature", "nan", "finite"),
        ("--top-p", "0", "(0, 1]"),
        ("--top-p", "1.5", "(0, 1]"),
        ("--top-k", "-3", ">= -1"),
        ("--seed", str(2**70), "64 bits"),
    ],
)
def test_sampling_numbers_are_refused_before_the_model_loads(command, flag, value, accepted, missing):
    result = ninefold(command, "--model", missing, flag, value, *(["hi"] if command == "generate" else []),
                      input="" if command == "chat" else None)
    assert_usage_error(result, f"argument {flag}", value if value != "nan" else "nan", accepted)
    assert "no-such-model" not in result.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_bad_device_is_refused_before_the_model_loads(command, missing):
    extra = ["hi"] if command == "generate" else []
    result = ninefold(command, "--model", missing, "--device", "gpu0", *extra, input="")
    assert_usage_error(result, "argument --device", "'gpu0'", "not a torch device name")


def test_ops_tune_refuses_a_bad_device():
    assert_usage_error(ninefold("ops", "tune", "--device", "gpu0", "--ops", "add", "--shapes", "tiny"),
                       "--device", "'gpu0'")


@pytest.mark.parametrize(
    "flag, value, accepted",
    [("--port", "70000", "[1, 65535]"), ("--port", "-1", "[1, 65535]"), ("--port", "0", "[1, 65535]"),
     ("--drain-timeout", "-5", ">= 0"), ("--drain-timeout", "nan", ">= 0"),
     ("--max-model-len", "abc", "an integer >= 1"), ("--max-queue", "-1", "an integer >= 0")],
)
def test_serve_refuses_bad_ports_and_timeouts_before_loading(flag, value, accepted, missing):
    result = ninefold("serve", "--model", missing, flag, value)
    assert_usage_error(result, f"argument {flag}", repr(value), accepted)


def test_serve_reports_a_port_in_use_before_loading(missing):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = ninefold("serve", "--model", missing, "--port", str(port))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"127.0.0.1:{port}" in result.stderr and "in use" in result.stderr
    assert "no-such-model" not in result.stderr


def test_generate_refuses_system_with_raw(missing):
    assert_usage_error(ninefold("generate", "--model", missing, "--raw", "--system", "be brief", "hi"),
                       "argument --system", "--raw")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_directory_that_is_not_a_model_says_so(command, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    extra = {"generate": ["hi"], "chat": [], "serve": ["--port", str(_free_port())]}[command]
    result = ninefold(command, "--model", str(tmp_path), "--device", "cpu", *extra, input="")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(tmp_path) in result.stderr and "config.json" in result.stderr


# ----------------------------------------------------------------------------- help


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_subcommand_has_help_describing_every_option():
    undescribed = []
    for path, parser in _parsers(build_parser()):
        if path and not parser.description:
            undescribed.append(" ".join(path))
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help:
                undescribed.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    assert not undescribed, undescribed


@pytest.mark.parametrize("path", ["", "generate", "chat", "serve", "models", "ops", "ops tune", "profile device",
                                  "dsl show", "bench serve"])
def test_help_runs_and_lists_every_option(path):
    parser = dict(_parsers(build_parser()))[tuple(path.split())]
    result = ninefold(*path.split(), "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: ninefold"), result.stderr
    for action in parser._actions:
        for option in action.option_strings:
            assert option in result.stdout, option


def test_options_in_the_readme_exist():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    serve = ninefold("serve", "--help").stdout
    for option in ("--model", "--served-model-name", "--port", "--api-key", "--max-model-len", "--max-num-seqs",
                   "--max-queue", "--dtype", "--device", "--host", "--drain-timeout", "--quantization"):
        assert option in readme and option in serve, option
    for command in ("generate", "chat"):
        text = ninefold(command, "--help").stdout
        for option in ("--model", "--quantization", "--dtype"):
            assert option in text, (command, option)


# ----------------------------------------------------------------------------- pipes and Ctrl-C


def test_generate_into_a_closed_pipe_ends_quietly(tiny):
    proc = start("generate", "-m", str(tiny), "--device", "cpu", "--max-tokens", "8000", "hi")
    head = proc.stdout.read(10)
    proc.stdout.close()  # as `| head -c 10` does
    _, err = proc.communicate(timeout=TIMEOUT)
    err = err.decode(errors="replace")
    assert len(head) == 10
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert proc.returncode == 128 + signal.SIGPIPE


@pytest.mark.parametrize("command, closed, code", [("generate", "stdout", 141), ("chat", "stdout", 141),
                                                    ("chat", "stdin", 0)])
def test_a_closed_stdin_or_stdout_ends_quietly(tiny, command, closed, code):
    """Started with fd 0 or 1 closed (a daemon, `<&-`, `>&-`): a closed stdin reads as empty, a closed stdout
    ends the command at its first answer as a closed pipe does."""
    fd = 0 if closed == "stdin" else 1
    args = ["--model", str(tiny), "--device", "cpu", "--max-tokens", "3"] + (["hi"] if command == "generate" else [])
    streams = {"input": b"hello\n"} if fd else {"stdout": subprocess.PIPE}
    proc = subprocess.run([sys.executable, "-m", "ninefold", command, *args], stderr=subprocess.PIPE,
                          timeout=TIMEOUT, preexec_fn=lambda: os.close(fd), **streams)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == code and "Traceback" not in err, err


def test_ctrl_c_stops_generate_without_a_traceback(tiny):
    proc = start("generate", "--model", str(tiny), "--device", "cpu", "--max-tokens", "8000", "hi")
    first = proc.stdout.read(4)  # generation has started
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=TIMEOUT)
    err = err.decode(errors="replace")
    assert first and proc.returncode == 128 + signal.SIGINT
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.rstrip().endswith("ninefold generate: interrupted")
    assert len(first + rest) < 8000  # it stopped early


def _greedy_chat_answer(model_dir, text: str, max_tokens: int) -> str:
    from ninefold import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].outputs[0].text


def test_chat_from_a_pipe_answers_each_line_and_ends_at_eof(tiny):
    want_hello = _greedy_chat_answer(tiny, "Hello", 6)
    want_other = _greedy_chat_answer(tiny, "How are you?", 6)
    result = ninefold("chat", "--model", str(tiny), "--device", "cpu", "--max-tokens", "6",
                      input="Hello\n/reset\n\nHow are you?")  # the last line without its newline
    assert result.returncode == 0, result.stderr
    # stdout holds the answers only: no ">>> " prompts, status lines on stderr
    assert result.stdout == f"{want_hello}\n{want_other}\n"
    assert "(conversation cleared)" in result.stderr and "Traceback" not in result.stderr


def test_chat_and_generate_take_bytes_that_are_not_utf8(tiny):
    chat = subprocess.run([sys.executable, "-m", "ninefold", "chat", "--model", str(tiny), "--device", "cpu",
                           "--max-tokens", "3"], input=b"caf\xe9 \xff\n", capture_output=True, timeout=TIMEOUT)
    assert chat.returncode == 0 and b"Traceback" not in chat.stderr, chat.stderr.decode(errors="replace")
    assert chat.stdout.strip()
    generate = subprocess.run([sys.executable, "-m", "ninefold", "generate", "--model", str(tiny), "--device", "cpu",
                               "--max-tokens", "3", b"caf\xe9 \xff"], capture_output=True, timeout=TIMEOUT)
    assert generate.returncode == 0 and b"Traceback" not in generate.stderr, generate.stderr
    assert generate.stdout.strip()


def test_generate_to_a_terminal_that_cannot_show_the_text(tiny):
    result = ninefold("generate", "--model", str(tiny), "--device", "cpu", "--raw", TRIGGER_CHAR,
                      env={"PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout == "?" * len(CHAIN_TEXT) + "\n"


def test_chat_skips_null_sampling_values_in_generation_config(tiny, tmp_path):
    model = shutil.copytree(tiny, tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": None, "top_k": None, "top_p": 7}))
    result = ninefold("chat", "--model", str(model), "--device", "cpu", "--max-tokens", "6",
                      input=f"{TRIGGER_CHAR}\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == _greedy_chat_answer(tiny, TRIGGER_CHAR, 6) + "\n"  # greedy: no temperature given
    assert "top_p=7 ignored" in result.stderr


# ----------------------------------------------------------------------------- serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_takes_the_model_as_vllm_does_and_stops_on_ctrl_c(tiny):
    port = _free_port()
    proc = start("serve", str(tiny), "--device", "cpu", "--port", str(port), "--served-model-name", "tiny-pos")
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, proc.communicate()[1].decode(errors="replace")
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert [m["id"] for m in models["data"]] == ["tiny-pos"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and b"Traceback" not in err, err.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_serve_refuses_two_different_models(tiny, missing):
    assert_usage_error(ninefold("serve", str(tiny), "--model", missing), "--model", "MODEL", "no-such-model")
