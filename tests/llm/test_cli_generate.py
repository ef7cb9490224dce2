"""``ninefold generate`` in a real subprocess."""

import subprocess
import sys

from ninefold import LLM, SamplingParams


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ninefold", "generate", "--device", "cpu", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_streams_the_greedy_completion_with_and_without_chat_template(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", num_kv_blocks=64)
    tok = llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=12)
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=True)
    want_chat = llm.generate(prompt_token_ids=[chat_ids], sampling_params=params)[0].outputs[0].text
    want_raw = llm.generate(["Hello"], params)[0].outputs[0].text
    chat = run_cli("--model", str(llama_dir), "Hello", "--max-tokens", "12")
    raw = run_cli("--model", str(llama_dir), "Hello", "--max-tokens", "12", "--raw")
    assert chat.returncode == 0 and raw.returncode == 0, chat.stderr + raw.stderr
    assert chat.stdout == want_chat + "\n"
    assert raw.stdout == want_raw + "\n"


def test_generate_reports_a_missing_model(tmp_path):
    result = run_cli("--model", str(tmp_path / "nothing.gguf"), "hi")
    assert result.returncode != 0 and "nothing.gguf" in result.stderr
