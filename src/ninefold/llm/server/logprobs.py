"""Per-token log-probabilities in the completions and chat formats.

The engine reports, for every generated token, a dict ``token id -> logprob`` holding the sampled
token and the top-N alternatives; prompt logprobs come the same way, one dict per prompt token
after the first (which has ``None``).
"""

from __future__ import annotations

import math
from functools import lru_cache

from ninefold.llm.token_bytes import piece_bytes


class TokenTexts:
    """Token id -> (display text, UTF-8 bytes), cached per tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._lookup = lru_cache(maxsize=65536)(self._compute)

    def _compute(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        piece = self.tokenizer.id_to_token(token_id) if hasattr(self.tokenizer, "id_to_token") else None
        special = token_id in getattr(self.tokenizer, "all_special_ids", ())
        if piece is not None and not special:
            # the piece's own bytes: a SentencePiece byte-fallback token is its byte, not "<0x0A>" nor U+FFFD,
            # and a metaspace keeps the leading space that decoding a lone token strips
            raw = piece_bytes(piece, bool(getattr(self.tokenizer, "byte_level", True)))
        else:
            raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return raw.decode("utf-8", errors="replace"), tuple(raw)

    def text(self, token_id: int) -> str:
        """What the token shows as text (U+FFFD for a partial UTF-8 sequence)."""
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        """The token's raw UTF-8 bytes."""
        return list(self._lookup(token_id)[1])


class TokenIdTexts:
    """vLLM's ``return_tokens_as_token_ids``: every token shows as ``"token_id:<id>"`` (bytes unchanged), so a
    client can tell apart tokens whose texts are the same or not valid UTF-8 alone."""

    def __init__(self, texts: TokenTexts | None) -> None:
        self.texts = texts  # None: no tokenizer, so no bytes either

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def bytes(self, token_id: int) -> list[int] | None:
        return self.texts.bytes(token_id) if self.texts is not None else None


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


def _ranked(step: dict[int, float], top: int) -> list[tuple[int, float]]:
    return sorted(step.items(), key=lambda kv: -kv[1])[:top]


def _ranked_with(step: dict[int, float], top: int, token_id: int) -> list[tuple[int, float]]:
    """The ``top`` best of ``step``, and ``token_id`` after them when it is not among them."""
    ranked = _ranked(step, top)
    if token_id in step and all(t != token_id for t, _ in ranked):
        ranked.append((token_id, step[token_id]))
    return ranked


def completion_logprobs(
    token_ids: list[int], steps: list[dict[int, float]], top: int, texts: TokenTexts, offset: int
) -> dict:
    """The ``logprobs`` object of a completions choice for ``token_ids`` (text offsets from ``offset``)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, step in zip(token_ids, steps):
        text = texts.text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(step.get(token_id, -math.inf)))
        # OpenAI's legacy format: the top ``logprobs`` tokens and always the sampled one (up to logprobs + 1), keyed
        # by text; tokens of the same text (byte pieces show as U+FFFD) keep the likeliest one's logprob
        entry: dict[str, float] = {}
        for t, lp in _ranked_with(step, top, token_id):  # (likeliest first)
            entry.setdefault(texts.text(t), _finite(lp))
        out["top_logprobs"].append(entry)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], steps: list[dict[int, float]], top: int, texts: TokenTexts) -> dict:
    """The ``logprobs`` object of a chat choice for ``token_ids``."""
    content = []
    for token_id, step in zip(token_ids, steps):
        content.append(
            {
                "token": texts.text(token_id),
                "logprob": _finite(step.get(token_id, -math.inf)),
                "bytes": texts.bytes(token_id),
                "top_logprobs": [
                    {"token": texts.text(t), "logprob": _finite(lp), "bytes": texts.bytes(t)}
                    for t, lp in _ranked(step, top)
                ],
            }
        )
    return {"content": content}


def echoed_prompt_logprobs(
    token_ids: list[int], entries: list[dict[int, float] | None], top: int, texts: TokenTexts
) -> dict:
    """The completions ``logprobs`` object of an echoed prompt: the first token has no logprob (None)."""
    first = {"tokens": [texts.text(token_ids[0])], "token_logprobs": [None], "top_logprobs": [None],
             "text_offset": [0]}
    return joined(first, completion_logprobs(token_ids[1:], entries[1:], top, texts, len(first["tokens"][0])))


def joined(first: dict, second: dict | None) -> dict:
    """Two completions ``logprobs`` objects one after the other (``second``'s offsets already follow ``first``)."""
    if second is None:
        return first
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs(entries: list[dict[int, float] | None], prompt_ids: list[int], top: int,
                    texts: TokenTexts) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {logprob, decoded_token}}``
    for the ``top`` most likely tokens and the prompt's own."""
    out: list[dict | None] = []
    for token_id, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": _finite(lp), "decoded_token": texts.text(t)}
                    for t, lp in _ranked_with(entry, top, token_id)})
    return out
