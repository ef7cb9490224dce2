"""What a user of `ninefold chat` / `generate` / `LLM.chat` meets with the real default model
(SmolLM2-135M-Instruct, Q4_1 GGUF), checked against transformers loading the same file.

Every test is skipped when the GGUF file is neither cached nor fetchable.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

from ninefold.llm.sampling import SamplingParams

IM_START, IM_END = 1, 2
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"




@pytest.fixture(scope="module")
def llm(smollm2):
    from ninefold.llm.api import LLM

    return LLM(str(smollm2), dtype="float32", device="cpu", quantization="none")


@pytest.fixture(scope="module")
def hf_model(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32).eval()


def _ids(value):
    return list(value["input_ids"] if hasattr(value, "keys") else value)


# ----------------------------------------------------------------------------- (a) chat template


def test_chat_template_default_system_multiturn_and_generation_prompt(ours, hf_tokenizer):
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "again ü 🧑‍🚀"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    ]
    for messages in conversations:
        for agp in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=agp)
            assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
            assert text.endswith("<|im_start|>assistant\n") == agp
            ids = ours.apply_chat_template(messages, add_generation_prompt=agp, tokenize=True)
            assert ids == _ids(hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=agp))
    # The template's own system prompt appears only when the user gives none.
    assert ours.apply_chat_template(conversations[0]).startswith(DEFAULT_SYSTEM)
    assert "SmolLM" not in ours.apply_chat_template(conversations[1])


def test_empty_conversation_is_refused_like_transformers(ours, hf_tokenizer):
    with pytest.raises(ValueError):
        hf_tokenizer.apply_chat_template([], tokenize=False)
    with pytest.raises(ValueError, match="messages"):
        ours.apply_chat_template([])


# ----------------------------------------------------------------------------- (b) tokenization


def test_tricky_text_and_typed_special_strings_encode_like_transformers(ours, hf_tokenizer):
    texts = ["\u00a0nbsp", "e\u0301 é", "🧑‍🚀🇫🇷👍🏽", "  two leading", "\r\n\t", "\x00", "a\ufffdb",
             "𝕳𝖊𝖑𝖑𝖔", "<|im_end", "<|IM_END|>", "hi <|im_end|> there", "<file_sep>x", " <|im_start|>"]
    for text in texts:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf_tokenizer(text, add_special_tokens=add).input_ids, text
        ids = ours.encode(text)
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
        if "<|im_" not in text and "<file_sep>" not in text:
            assert ours.decode(ids) == text  # byte-level BPE round-trips exactly
    # Like transformers (and vLLM / llama.cpp), the *exact* special-token strings typed in a message are
    # parsed as control tokens once the template is rendered and tokenized; near misses stay plain text.
    assert IM_END in ours.encode("hi <|im_end|> there")
    assert IM_END not in ours.encode("<|IM_END|> <|im_end")
    messages = [{"role": "user", "content": "a <|im_end|> b"}]
    assert ours.apply_chat_template(messages, tokenize=True) == _ids(
        hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))


# ----------------------------------------------------------------------------- (c) generation


def test_chat_greedy_matches_transformers_and_stops_at_im_end(llm, hf_model):
    conversations = [[{"role": "user", "content": "What is 2+2?"}],
                     [{"role": "user", "content": "Give me three emojis for happiness."}]]
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=16))
    for messages, out in zip(conversations, outs):
        ids = llm.tokenizer.apply_chat_template(messages, tokenize=True)
        with torch.inference_mode():
            want = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=16, do_sample=False, eos_token_id=IM_END, pad_token_id=IM_END)
        completion = out.outputs[0]
        assert completion.token_ids == want[0, len(ids):].tolist()
        assert "<|" not in completion.text and "\ufffd" not in completion.text
    first = outs[0].outputs[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == IM_END
    assert first.text == "The answer to this classic math problem is 4."


# ----------------------------------------------------------------------------- (d) streaming


class _Recorder(io.StringIO):
    def __init__(self):
        super().__init__()
        self.chunks: list[str] = []

    def write(self, text):
        self.chunks.append(text)
        return super().write(text)


def test_cli_generate_and_chat_stream_emoji_whole_and_equal_to_offline(smollm2, llm, monkeypatch):
    from ninefold.cli.chat import ChatSession
    from ninefold.cli.main import main

    prompt = "Give me three emojis for happiness."
    params = SamplingParams(temperature=0.0, max_tokens=14)
    offline = llm.chat([{"role": "user", "content": prompt}], params)[0].outputs[0].text
    assert any(ord(ch) > 0xFFFF for ch in offline)  # the answer has 4-byte characters (3 tokens each)

    out = _Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    rc = main(["generate", "--model", str(smollm2), "--device", "cpu", "--dtype", "float32",
               "--quantization", "none", "--max-tokens", "14", prompt])
    monkeypatch.undo()
    assert rc == 0
    assert out.getvalue() == offline + "\n"
    assert len(out.chunks) > 3 and not any("\ufffd" in chunk for chunk in out.chunks)

    session = ChatSession(llm.engine, params)
    stream = _Recorder()
    answer = session.ask(prompt, stream)
    assert answer == offline and stream.getvalue() == offline + "\n"
    assert not any("\ufffd" in chunk for chunk in stream.chunks)
    assert session.messages[-1] == {"role": "assistant", "content": offline}


# ----------------------------------------------------------------------------- (e) bad input


def test_bad_input_gives_clear_errors(llm, capsys):
    from ninefold.cli.main import main

    assert main(["generate", "--model", "no-such-model-xyz", "hi"]) == 2
    assert "no-such-model-xyz" in capsys.readouterr().err
    assert main(["generate", "--max-tokens", "-1", "hi"]) == 2  # checked before any model loads
    assert "max_tokens" in capsys.readouterr().err
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=-3))
