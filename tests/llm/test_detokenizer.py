"""Incremental detokenization: same text as a full decode, no broken UTF-8, linear work."""

import random

import pytest
from tiny_models import build_tokenizer

from ninefold.llm.detokenizer import IncrementalDetokenizer
from ninefold.llm.tokenizer import Tokenizer

TEXTS = [
    "Hello world! 東京 and 北京 are cities; 😀😀 emoji, café naïve.",
    "plain ascii text with numbers 12345 and symbols {}[]()",
    "多字节字符串测试，中文句子。😀 mixed with English words.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(build_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>"})


class CountingTokenizer:
    """Wraps a Tokenizer and counts how many token ids all decode calls handled."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_full_decode_without_broken_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Prompt: ", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    seen = []
    for token in ids:
        before = detok.visible_text(False)
        detok.add([token])
        now = detok.visible_text(False)
        assert now.startswith(before)  # prefix-stable
        seen.append(now[len(before):])
    assert "".join(seen) == detok.text == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in seen)


def test_byte_tokens_of_a_multibyte_character_are_held_until_it_completes(tokenizer):
    # byte-level fallback: split one 4-byte emoji into its single-byte tokens
    byte_ids = [tokenizer._tk.token_to_id(ch) for ch in "ðŁĺĢ"]  # GPT-2 byte alphabet of U+1F600
    assert None not in byte_ids and tokenizer.decode(byte_ids) == "😀"
    detok = IncrementalDetokenizer(tokenizer, [])
    for token in byte_ids[:-1]:
        detok.add([token])
        assert detok.text == ""
    detok.add(byte_ids[-1:])
    assert detok.text == "😀"


def test_work_per_token_is_bounded(tokenizer):
    rng = random.Random(0)
    ids = tokenizer.encode(" ".join(rng.choice(TEXTS) for _ in range(60)), add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [1, 2, 3])
    for token in ids:
        detok.add([token])
    assert detok.text == tokenizer.decode(ids)
    assert counting.decoded <= 30 * len(ids)  # a quadratic scheme would decode ~len(ids)^2 / 2 ids


def test_invalid_bytes_are_released_after_a_bounded_wait(tokenizer):
    lone = tokenizer._tk.token_to_id("Ģ")  # a lone continuation byte: never a complete character
    detok = IncrementalDetokenizer(tokenizer, [])
    for _ in range(20):
        detok.add([lone])
    assert len(detok.text) >= 8 and set(detok.text) == {"\ufffd"}


def test_stop_string_is_held_back_while_streaming(tokenizer):
    ids = tokenizer.encode("Hello world, hello again", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["hello"])
    visible = []
    for token in ids:
        found = detok.add([token])
        visible.append(detok.visible_text(found is not None))
        if found:
            break
    assert found == "hello" and detok.text == "Hello world, "
    assert all("hel" not in v for v in visible)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_read_late_decode_to_the_same_text_as_ids_read_one_by_one(tokenizer, text):
    ids = tokenizer.encode(text * 3, add_special_tokens=False)
    prompt = tokenizer.encode("Prompt: ", add_special_tokens=False)
    rng = random.Random(len(text))
    one_by_one, late = IncrementalDetokenizer(tokenizer, prompt), IncrementalDetokenizer(tokenizer, prompt)
    start = 0
    while start < len(ids):
        chunk = ids[start : start + rng.randint(1, 9)]
        start += len(chunk)
        for token in chunk:
            one_by_one.add([token])
            assert one_by_one.text is not None  # read after every id
        late.add(chunk)
        assert one_by_one.text.startswith(late.text)  # read after a burst of ids
    assert late.text == one_by_one.text == text * 3


def test_a_burst_ending_inside_a_character_holds_its_bytes(tokenizer):
    byte_ids = [tokenizer._tk.token_to_id(ch) for ch in "ðŁĺĢ"]
    words = tokenizer.encode("hi there", add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [])
    detok.add(words + byte_ids[:-1])
    assert detok.text == "hi there"
    detok.add(byte_ids[-1:])
    assert detok.text == "hi there😀"


def test_without_stop_strings_nothing_is_decoded_until_the_text_is_read(tokenizer):
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [])
    ids = tokenizer.encode(TEXTS[0] * 4, add_special_tokens=False)
    for token in ids:
        detok.add([token])
    assert counting.decoded == 0
    assert detok.text == TEXTS[0] * 4
    assert counting.decoded <= 3 * len(ids)


@pytest.mark.parametrize("stop", [None, ["STOP"]])
def test_skipped_special_tokens_are_not_held_against_a_character_that_follows(tokenizer, stop):
    special = tokenizer._tk.token_to_id("<|im_start|>")  # no text with skip_special_tokens
    ids = [special] * 7 + [tokenizer._tk.token_to_id(c) for c in "Ã©"] + tokenizer.encode("a", add_special_tokens=False)
    assert tokenizer.decode(ids) == "éa"  # (the two byte-level tokens of "é")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi", add_special_tokens=False), stop=stop)
    streamed = []
    for token_id in ids:
        detok.add([token_id])
        streamed.append(detok.visible_text(False))
    assert all("\ufffd" not in text for text in streamed), streamed
    assert detok.visible_text(True) == "éa"


def test_released_invalid_bytes_leave_a_character_that_follows_whole(tokenizer):
    ids = [tokenizer._tk.token_to_id("Ģ")] * 7 + [tokenizer._tk.token_to_id(c) for c in "Ã©"]  # lone continuations
    detok = IncrementalDetokenizer(tokenizer, [])
    for token_id in ids:
        detok.add([token_id])
        _ = detok.text  # read after every token, as a stream does
    assert detok.text == tokenizer.decode(ids) == "\ufffd" * 7 + "é"
