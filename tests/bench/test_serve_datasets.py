"""Benchmark prompts: random prompts sized in tokens, JSONL files, length ranges."""

import json

import pytest

from ninefold.bench.serve_client import ServerTokenizer
from ninefold.bench.serve_datasets import WordCounter, jsonl_requests, parse_length_range, random_requests

from .openai_standin import MODEL, count_tokens


@pytest.mark.parametrize("text, expected", [("5:9", (5, 9)), ("7", (7, 7)), ("1:1", (1, 1))])
def test_length_range(text, expected):
    assert parse_length_range(text, "--input-len") == expected


@pytest.mark.parametrize("text", ["9:5", "0:4", "a:b", "1:2:3", "", "-3", "2.5"])
def test_length_range_rejects(text):
    with pytest.raises(ValueError, match="--input-len"):
        parse_length_range(text, "--input-len")


def test_random_prompts_in_words_have_exact_lengths_and_follow_the_seed():
    requests = random_requests(40, (5, 60), (3, 9), WordCounter(), seed=11)
    assert all(len(r.prompt.split()) == r.prompt_len for r in requests)
    assert all(5 <= r.prompt_len <= 60 and 3 <= r.output_len <= 9 for r in requests)
    assert len({r.prompt_len for r in requests}) > 10 and len({r.prompt for r in requests}) == 40
    assert requests == random_requests(40, (5, 60), (3, 9), WordCounter(), seed=11)
    assert requests != random_requests(40, (5, 60), (3, 9), WordCounter(), seed=12)


@pytest.mark.parametrize("length", [1, 2, 37, 150])
def test_random_prompts_sized_by_the_servers_tokenizer(standin, length):
    server = standin()
    tokenizer = ServerTokenizer.probe(server.url, MODEL, None)
    assert tokenizer is not None
    requests = random_requests(20, (length, length), (4, 4), tokenizer, seed=0)
    # The stand-in counts ceil(len/4) tokens per word, so words and tokens differ; lengths still hit.
    assert [count_tokens(r.prompt) for r in requests] == [length] * 20
    assert [r.prompt_len for r in requests] == [length] * 20
    if length > 2:
        assert any(len(r.prompt.split()) != length for r in requests)


def test_server_without_tokenize_is_detected(standin):
    server = standin(serve_tokenize=False)
    assert ServerTokenizer.probe(server.url, MODEL, None) is None


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "one two three", "output_len": 5}, {"prompt": "four five"}, {"prompt": "six", "max_tokens": 2}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    requests = jsonl_requests(path, 3, (7, 7), WordCounter())
    assert [(r.prompt, r.prompt_len, r.output_len) for r in requests] == [
        ("one two three", 3, 5), ("four five", 2, 7), ("six", 1, 2)]
    assert len(jsonl_requests(path, 2, (7, 7), WordCounter())) == 2


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a"}\n{"prompt": "b"\n', r"prompts.jsonl:2: not valid JSON"),
        ('{"text": "a"}\n', r"prompts.jsonl:1: each line needs a non-empty string 'prompt'"),
        ('{"prompt": "a", "output_len": 0}\n', r"prompts.jsonl:1: 'output_len' must be a positive int"),
        ('{"prompt": "a"}\n', r"--num-prompts is 2 but .* holds only 1 prompts"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        jsonl_requests(path, 2, (1, 1), WordCounter())


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        jsonl_requests(tmp_path / "nope.jsonl", 1, (1, 1), WordCounter())
