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


def test_generate_with_a_lora_adapter(llama_dir, tmp_path):
    """--lora DIR: the adapter's own greedy text (rank 32, above the default max_lora_rank: the CLI makes room)."""
    from tiny_models import write_lora_adapter

    from ninefold import LoRARequest

    adapter = write_lora_adapter(llama_dir, tmp_path / "adapter", r=32, seed=3)
    llm = LLM(str(llama_dir), device="cpu", num_kv_blocks=64, enable_lora=True, max_lora_rank=32)
    params = SamplingParams(temperature=0, max_tokens=12)
    want = llm.generate(["Hello"], params, lora_request=LoRARequest("adapter", 1, str(adapter)))[0].outputs[0].text
    plain = llm.generate(["Hello"], params)[0].outputs[0].text
    result = run_cli("--model", str(llama_dir), "Hello", "--max-tokens", "12", "--raw", "--lora", str(adapter))
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n" and want != plain
    missing = run_cli("--model", str(llama_dir), "Hello", "--lora", str(tmp_path / "nowhere"))
    assert missing.returncode != 0 and "lora_path" in missing.stderr and "nowhere" in missing.stderr


def test_chat_session_with_a_lora_adapter(llama_dir, tmp_path):
    """`ninefold chat --lora DIR`'s session: each answer is what LLM.chat gives under the adapter."""
    import io

    from tiny_models import write_lora_adapter

    from ninefold import LoRARequest
    from ninefold.cli.chat import ChatSession
    from ninefold.cli.lora_options import adapter_engine_args, adapter_request

    adapter = write_lora_adapter(llama_dir, tmp_path / "adapter", r=8, seed=4)
    llm = LLM(str(llama_dir), device="cpu", num_kv_blocks=64, **adapter_engine_args(str(adapter)))
    params = SamplingParams(temperature=0, max_tokens=10)
    messages = [{"role": "user", "content": "Hello"}]
    want = llm.chat(messages, params, lora_request=LoRARequest("adapter", 1, str(adapter)))[0].outputs[0].text
    session = ChatSession(llm.engine, params, lora=adapter_request(str(adapter)))
    out = io.StringIO()
    assert session.ask("Hello", out) == want and out.getvalue() == want + "\n"
    assert want != llm.chat(messages, params)[0].outputs[0].text


def test_chat_refuses_a_message_too_long_for_the_context_and_keeps_the_conversation(llama_dir, capsys):
    """The refusal goes to stderr (stdout holds answers), and the turns before it stay for the next message."""
    import io

    from ninefold.cli.chat import ChatSession

    llm = LLM(str(llama_dir), device="cpu", num_kv_blocks=64)
    session = ChatSession(llm.engine, SamplingParams(temperature=0, max_tokens=4), system="be brief")
    out = io.StringIO()
    session.ask("first question", out)
    before = list(session.messages)
    assert [m["role"] for m in before] == ["system", "user", "assistant"]
    assert session.ask("hello world " * 600, out) == ""
    assert session.messages == before and "at most" in capsys.readouterr().err
    assert out.getvalue().count("\n") == 1  # the first answer only


def test_generate_takes_fp8_and_the_cache_flags(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", quantization="fp8", block_size=8, enable_prefix_caching=False,
              num_kv_blocks=64)
    want = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    out = run_cli("--model", str(llama_dir), "Hello", "--max-tokens", "12", "--raw", "--quantization", "fp8",
                  "--block-size", "8", "--no-enable-prefix-caching", "--enforce-eager", "--gpu-memory-utilization", "0.5",
                  "--num-kv-blocks", "64")
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    short = run_cli("--model", str(llama_dir), "Hello " * 40, "--raw", "--max-model-len", "16")
    assert short.returncode != 0 and "max_model_len" in short.stderr and "Traceback" not in short.stderr
    bad = run_cli("--model", str(llama_dir), "Hello", "--gpu-memory-utilization", "2")
    assert bad.returncode == 2 and "argument --gpu-memory-utilization: expected a fraction in (0, 1], got '2'" in bad.stderr
