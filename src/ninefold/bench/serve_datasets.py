"""Prompts for the serving benchmark: random prompts of chosen token lengths, or a JSONL file."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: the prompt, its length in tokens, and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    output_len: int


class TokenCounter(Protocol):
    """Counts the tokens of a text; ``name`` says whose tokenizer it is."""

    name: str

    def count(self, text: str) -> int: ...


class WordCounter:
    """Fallback when no tokenizer is reachable: one token per whitespace-separated word."""

    name = "words"

    def count(self, text: str) -> int:
        return len(text.split())


# Short, common words: most BPE vocabularies hold each (with its leading space) as one token.
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was for on are with as his they be at one have this from or had by hot
    but some what there we can out other were all your when up use word how said an each she which
    do their time if will way about many then them would write like so these her long make thing see
    him two has look more day could go come did my sound no most number who over know water than call
    first people may down side been now find any new work part take get place made live where after
    back little only round man year came show every good me give our under name very through just form
    much great think say help low line before turn cause same mean differ move right boy old too does
    tell sentence set three want air well also play small end put home read hand port large spell add
    even land here must big high such follow act why ask men change went light kind off need house
    picture try us again animal point mother world near build self earth father head stand own page
    """.split()
)


def parse_length_range(text: str, name: str) -> tuple[int, int]:
    """Parse ``"A:B"`` (inclusive) or ``"A"`` into ``(A, B)`` with ``1 <= A <= B``."""
    parts = str(text).split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(f"{name} must be 'A:B' or 'A' with positive integers, got {text!r}") from None
    if low < 1 or high < low:
        raise ValueError(f"{name} must satisfy 1 <= A <= B, got {text!r}")
    return low, high


def random_requests(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    counter: TokenCounter,
    seed: int = 0,
    progress: bool = False,
) -> list[BenchRequest]:
    """Random-word prompts whose token counts (by ``counter``) are drawn uniformly from ``input_len``.

    Each prompt is sized by a few rounds of counting and correcting, so its length is exact when
    the tokenizer allows it and the closest reached otherwise; ``prompt_len`` is the counted length.
    Output lengths are drawn uniformly from ``output_len``. The same seed gives the same requests.
    """
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_len[0], input_len[1] + 1, size=num_requests)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    sizer = _PromptSizer(counter)
    requests = []
    for target, out_len in tqdm(
        list(zip(in_lens, out_lens)), desc="building prompts", unit="prompt", disable=not progress
    ):
        words = [str(w) for w in rng.choice(WORDS, size=2 * int(target) + 8)]
        prompt, length = sizer.fit(words, int(target))
        requests.append(BenchRequest(prompt, length, int(out_len)))
    return requests


class _PromptSizer:
    """Sizes a prompt to a target token count: a prefix of a word list, then a change at its end."""

    rounds = 6
    swaps = 16

    def __init__(self, counter: TokenCounter):
        self.counter = counter
        self.tokens_per_word = 1.0  # refined from every count, so later prompts start closer

    def fit(self, words: list[str], target: int) -> tuple[str, int]:
        num_words = max(1, min(len(words), round(target / self.tokens_per_word)))
        best: tuple[int, int, int] | None = None  # (distance, length, number of words)
        tried: set[int] = set()
        for _ in range(self.rounds):
            length = self.counter.count(" ".join(words[:num_words]))
            tried.add(num_words)
            self.tokens_per_word = max(length / num_words, 1e-3)
            if best is None or abs(length - target) < best[0]:
                best = (abs(length - target), length, num_words)
            if length == target:
                break
            step = round((target - length) / self.tokens_per_word) or (1 if target > length else -1)
            num_words = max(1, min(len(words), num_words + step))
            while num_words in tried and 1 < num_words < len(words):
                num_words += 1 if target > length else -1
            if num_words in tried:
                break
        _, length, num_words = best
        prompt = " ".join(words[:num_words])
        # Words of several tokens can make the target unreachable by prefixes alone: try replacing the
        # last word by another, or appending another.
        keep = num_words - 1 if length > target else num_words
        for other in words[num_words : num_words + self.swaps] if length != target else ():
            candidate = " ".join([*words[:keep], other])
            candidate_length = self.counter.count(candidate)
            if abs(candidate_length - target) < abs(length - target):
                prompt, length = candidate, candidate_length
            if length == target:
                break
        return prompt, length


def jsonl_requests(
    path: str | Path,
    num_requests: int,
    output_len: tuple[int, int],
    counter: TokenCounter,
    seed: int = 0,
) -> list[BenchRequest]:
    """The first ``num_requests`` prompts of a JSONL file.

    Each line is an object with ``"prompt"`` (a string) and optionally ``"output_len"`` (or
    ``"max_tokens"``), a positive int; lines without one draw it uniformly from ``output_len``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset file {str(path)!r} does not exist or is not a file")
    rng = np.random.default_rng(seed)
    requests = []
    for line_no, record in _records(path):
        if len(requests) == num_requests:
            break
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{line_no}: each line needs a non-empty string 'prompt', got {record!r:.200}")
        out_len = record.get("output_len", record.get("max_tokens"))
        if out_len is None:
            out_len = int(rng.integers(output_len[0], output_len[1] + 1))
        elif isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 1:
            raise ValueError(f"{path}:{line_no}: 'output_len' must be a positive int, got {out_len!r}")
        requests.append(BenchRequest(prompt, counter.count(prompt), out_len))
    if len(requests) < num_requests:
        raise ValueError(
            f"--num-prompts is {num_requests} but {str(path)!r} holds only {len(requests)} prompts"
        )
    return requests


def _records(path: Path) -> Iterable[tuple[int, object]]:
    with path.open(encoding="utf-8") as file:
        for line_no, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({error.msg})") from None

