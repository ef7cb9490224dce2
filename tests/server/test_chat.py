"""/v1/chat/completions through the official openai client against a live server."""

import pytest

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def chat_prompt_len(tiny_model):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tiny_model.path))
    ids = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_chat_completion_message_and_usage(client, chat_prompt_len):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=6, seed=4,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == chat_prompt_len
    assert out.usage.completion_tokens == 6


def test_max_tokens_alias(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, seed=4,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_chat_stream_role_content_finish_reason_and_usage(client, chat_prompt_len):
    args = dict(model="tiny", messages=MESSAGES, max_completion_tokens=8, seed=9, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    tail = [c for c in chunks if c.choices][-1]
    assert tail.choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (chat_prompt_len, 8)


def test_chat_n_and_seed(client):
    args = dict(model="tiny", messages=MESSAGES, max_completion_tokens=10, n=2, seed=21,
                extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**args)
    b = client.chat.completions.create(**args)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert a.choices[0].message.content != a.choices[1].message.content


def test_chat_logprobs_and_top_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=4, logprobs=True,
                                         top_logprobs=2, seed=1, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0.0 and isinstance(item.bytes, list)
        assert 1 <= len(item.top_logprobs) <= 2
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6
    streamed = [
        lp for chunk in client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_completion_tokens=4, logprobs=True, top_logprobs=2, seed=1,
            stream=True, extra_body={"ignore_eos": True})
        if chunk.choices and chunk.choices[0].logprobs for lp in chunk.choices[0].logprobs.content
    ]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in content]


def test_content_parts_are_joined(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello"}]}]
    out = client.chat.completions.create(model="tiny", messages=parts, max_completion_tokens=2, seed=0,
                                         extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hello"}],
                                           max_completion_tokens=2, seed=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == whole.usage.prompt_tokens
    assert out.choices[0].message.content == whole.choices[0].message.content
