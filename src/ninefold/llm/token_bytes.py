"""The raw bytes each vocabulary entry stands for (byte-level BPE; SentencePiece byte fallback and metaspace)."""

from __future__ import annotations

import re


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_DECODER = _byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def piece_bytes(piece: str, byte_level: bool) -> bytes:
    """The bytes of one vocabulary string: with a byte-level vocabulary, GPT-2's byte alphabet decoded;
    otherwise a SentencePiece byte-fallback token ``<0xNN>`` is that byte, and any other piece is its
    text with the metaspace ``▁`` as a space."""
    if byte_level:
        if all(ch in BYTE_DECODER for ch in piece):
            return bytes(BYTE_DECODER[ch] for ch in piece)
        return piece.encode("utf-8")
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def vocabulary_bytes(tokenizer, size: int, exclude: tuple[int, ...] = ()) -> list[bytes | None]:
    """Per token id below ``size``: its bytes, or None for special tokens, ``exclude`` (end-of-sequence ids)
    and ids the tokenizer lacks."""
    skip = set(getattr(tokenizer, "all_special_ids", ())) | set(exclude)
    byte_level = bool(getattr(tokenizer, "byte_level", False))
    out: list[bytes | None] = []
    for token_id in range(size):
        piece = tokenizer.id_to_token(token_id) if token_id not in skip else None
        out.append(piece_bytes(piece, byte_level) if piece else None)
    return out
