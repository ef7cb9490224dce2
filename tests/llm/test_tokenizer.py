"""Tokenizer wrapper against transformers' tokenizer built from the same files."""

import pytest
import tokenizers
from transformers import PreTrainedTokenizerFast

from ninefold.llm.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, 東京?"}]


@pytest.fixture(scope="module")
def pair(llama_dir):
    ours = Tokenizer.from_dir(llama_dir)
    theirs = PreTrainedTokenizerFast.from_pretrained(llama_dir)
    return ours, theirs


def test_encode_decode_match_transformers(pair):
    ours, theirs = pair
    for text in ["Hello world", "  spaces  and\nnewlines", "東京 😀 café", ""]:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        ids = ours.encode(text)
        assert ids[0] == ours.bos_token_id  # add_bos_token is set in this tokenizer_config
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode([ours.bos_token_id, *ours.encode("x", False)], skip_special_tokens=False) == "<s>x"


def test_chat_template_matches_transformers(pair):
    ours, theirs = pair
    for add in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add) == theirs.apply_chat_template(
            MESSAGES, add_generation_prompt=add, tokenize=False)
    ids = ours.apply_chat_template(MESSAGES, tokenize=True)
    assert ours.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_built_from_a_tokenizers_object_and_a_config_dict(llama_dir):
    tk = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    tok = Tokenizer(tk, {"eos_token": {"content": "</s>"}, "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}]})
    assert tok.eos_token_id == tk.token_to_id("</s>") and tok.bos_token_id is None
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    assert tok.eos_token_id in tok.all_special_ids


def test_errors_name_the_problem(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    tok = Tokenizer.from_dir(llama_dir)
    with pytest.raises(TypeError, match="messages"):
        tok.apply_chat_template("hello")
    with pytest.raises(TypeError, match="text"):
        tok.encode(123)
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer(tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))).apply_chat_template(MESSAGES)


def test_continue_final_message_leaves_the_last_turn_open(llama_dir):
    from ninefold import LLM, SamplingParams

    llm = LLM(str(llama_dir), device="cpu")
    tok = llm.engine.tokenizer
    begun = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    closed = tok.apply_chat_template(begun, add_generation_prompt=False)
    opened = tok.apply_chat_template(begun, add_generation_prompt=False, continue_final_message=True)
    assert closed.startswith(opened) and opened.endswith("Hello there") and len(closed) > len(opened)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(begun, continue_final_message=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chat = llm.chat(begun, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert chat.prompt_token_ids == tok.encode(opened, add_special_tokens=False)
