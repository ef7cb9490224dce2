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


def _template_pair(template: str):
    from tiny_models import build_tokenizer

    raw = build_tokenizer()
    ours = Tokenizer(raw, {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})
    theirs = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    theirs.chat_template = template
    return ours, theirs


@pytest.mark.parametrize("content", ["```python\n", "im"])
def test_continue_final_message_cuts_where_transformers_does(content):
    """A trailing newline is kept, and a short message that also occurs in the turn's closing text (here "im" in
    <|im_end|>) is cut at its own end."""
    from tiny_models import CHAT_TEMPLATE

    ours, theirs = _template_pair(CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "Say"}, {"role": "assistant", "content": content}]
    expected = theirs.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                          tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == expected


def test_continue_final_message_continues_the_last_text_part():
    ours, theirs = _template_pair("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
                                  "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}<|end|>{% endfor %}")
    parts = [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two"}]
    messages = [{"role": "user", "content": "Say"}, {"role": "assistant", "content": parts}]
    opened = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert opened == "Say<|end|>Part one. Part two" == theirs.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=False)


@pytest.mark.parametrize("template", [
    "{{ messages | tojson(separators=(',', ':'), sort_keys=True) }}|{{ '東' | tojson(ensure_ascii=True) }}"
    "|{{ messages | tojson(indent=2) }}",
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}",
])
def test_template_filters_and_tags_render_as_in_transformers(template):
    ours, theirs = _template_pair(template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == theirs.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=False)
