"""Build a `tokenizers.Tokenizer` from the tokenizer a GGUF file describes in its metadata.

GGUF files carry no `tokenizer.json`: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`),
the BPE merges, each token's type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte) and the special token ids. We rebuild the tokenizer transformers builds from the same
file, so both encode a text to the same ids:

- `gpt2` (byte-level BPE: SmolLM2, Llama 3, Qwen 2/3): the GPT-2 byte alphabet, a pre-tokenizer
  split chosen by `tokenizer.ggml.pre`, ByteLevel decoding.
- `llama` (sentencepiece BPE: Llama 2, Mistral): `▁` for spaces and a prefix space before every stretch
  of text between special tokens (as llama.cpp tokenizes these files), byte fallback, merges from the
  file or, when absent, derived from the token scores.

Control tokens become special added tokens (matched whole, skipped when decoding with
`skip_special_tokens`); user-defined tokens become plain added tokens.
"""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ninefold.llm.gguf_reader import GGUFError

CONTROL, USER_DEFINED = 3, 4
# Special token ids that loaders compare and index with: each must be an integer when present.
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id", "eom_token_id")

# Pre-tokenizer splits for byte-level vocabularies, by `tokenizer.ggml.pre`. Names not listed use
# GPT-2's own split (the ByteLevel pre-tokenizer's regex).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
}
SUPPORTED_MODELS = ("gpt2", "llama")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer(metadata: dict, source: str = "GGUF file") -> Tokenizer:
    """The `tokenizers.Tokenizer` described by GGUF `metadata` (keys `tokenizer.ggml.*`).

    Raises `GGUFError` (a ValueError) naming the key at fault when the tokenizer model is not one
    of `SUPPORTED_MODELS`, the vocabulary is missing, or the metadata is malformed: tokens that are
    not strings, token types or scores not one per token, merges not of the form ``"a b"`` or naming
    tokens outside the vocabulary, special token ids that are not integers.
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None or kind is None:
        raise GGUFError(f"{source} has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    if kind not in SUPPORTED_MODELS:
        raise GGUFError(
            f"{source} describes a tokenizer of model {kind!r}; supported: {', '.join(SUPPORTED_MODELS)}"
        )
    _check_strings(tokens, "tokenizer.ggml.tokens", source)
    types = metadata.get("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types is None else _per_token_numbers(types, "tokenizer.ggml.token_type", tokens, source)
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        _check_strings(merges, "tokenizer.ggml.merges", source)
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is not None:
        scores = _per_token_numbers(scores, "tokenizer.ggml.scores", tokens, source)
    for key in _TOKEN_ID_KEYS:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and (isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer))):
            raise GGUFError(f"{source}: tokenizer.ggml.{key} is {token_id!r}; a token id must be an integer")
    if kind == "gpt2":
        tokenizer, spelled = _byte_level(tokens, merges, metadata.get("tokenizer.ggml.pre"), source)
    else:
        tokenizer, spelled = _sentencepiece(tokens, merges, scores, metadata, source)
    try:
        control = [
            AddedToken(tok, normalized=False, special=True)
            for tok, typ in zip(tokens, types)
            if typ == CONTROL and spelled(tok)
        ]
        user = [AddedToken(tok, normalized=False, special=False) for tok, typ in zip(tokens, types) if typ == USER_DEFINED]
        tokenizer.add_special_tokens(control)
        tokenizer.add_tokens(user)
        _set_post_processor(tokenizer, metadata, tokens)
    except Exception as error:  # the tokenizers library raises plain Exception and TypeError
        raise _construction_error(error, source) from error
    return tokenizer


def _check_strings(value, key: str, source: str) -> None:
    """Refuse a metadata value that is not an array of strings."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        found = type(value).__name__ if not isinstance(value, (list, tuple)) else "an array holding non-strings"
        raise GGUFError(f"{source}: {key} is {found}; it must be an array of strings")


def _per_token_numbers(value, key: str, tokens: list[str], source: str) -> list:
    """`value` as a list of numbers, one per token, else GGUFError naming `key`."""
    array = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if array is None or array.ndim != 1 or array.dtype.kind not in "iuf":
        raise GGUFError(f"{source}: {key} is not an array of numbers; it must hold one number per token")
    if len(array) != len(tokens):
        raise GGUFError(
            f"{source}: {key} has {len(array)} entries but tokenizer.ggml.tokens has {len(tokens)}; they must match"
        )
    return array.tolist()


def _merge_pairs(merges: list[str], vocab: dict[str, int], source: str) -> list[tuple[str, str]]:
    """BPE merges ``"a b"`` as pairs, refusing a line without a space or naming a token not in `vocab`."""
    pairs = []
    for i, merge in enumerate(merges):
        left, space, right = merge.partition(" ")
        if not space:
            raise GGUFError(
                f"{source}: tokenizer.ggml.merges[{i}] is {merge!r}; a merge must be two tokens separated by a space ('a b')"
            )
        for part in (left, right, left + right):
            if part not in vocab:
                raise GGUFError(
                    f"{source}: tokenizer.ggml.merges[{i}] is {merge!r}, but {part!r} is not in tokenizer.ggml.tokens"
                )
        pairs.append((left, right))
    return pairs


def _construction_error(error: Exception, source: str) -> GGUFError:
    first_line = (str(error).splitlines() or [""])[0]
    return GGUFError(f"{source}: its tokenizer metadata is malformed ({type(error).__name__}: {first_line})")


def _byte_level(tokens: list[str], merges: list[str] | None, pre: str | None, source: str):
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())

    def spell(tok: str) -> str:
        return tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8", "surrogateescape"))

    vocab = {spell(tok): i for i, tok in enumerate(tokens)}
    pairs = _merge_pairs(merges, vocab, source) if merges is not None else _merges_from_order(vocab)
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as error:
        raise _construction_error(error, source) from error
    split = PRE_TOKENIZER_SPLITS.get(pre if isinstance(pre, str) else "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tokenizer.decoder = decoders.ByteLevel()
    # llama.cpp marks a few tokens control that a byte-level vocabulary cannot spell (mislabels); skip them.
    return tokenizer, lambda tok: set(tok) <= letters


def _sentencepiece(tokens: list[str], merges: list[str] | None, scores: list | None, metadata: dict, source: str):
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if merges is not None:
        pairs = _merge_pairs(merges, vocab, source)
    else:
        rank = {tok: float(s) for tok, s in zip(tokens, scores)} if scores is not None else {t: -i for t, i in vocab.items()}
        pairs = _merges_from_scores(vocab, rank)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    except Exception as error:
        raise _construction_error(error, source) from error
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # Spaces become "▁", and every stretch of text between special tokens gets one "▁" in front, also when it
    # starts with a space: what llama.cpp (and sentencepiece's dummy prefix) do with these files. (transformers
    # 5.17 builds the same; 5.25 adds the "▁" only at the very start and only when no space is there.)
    steps = [normalizers.Replace(" ", "\u2581")]
    tokenizer.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if prefix else []) + steps)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer, lambda tok: True


def _merges_from_scores(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a vocabulary token into two vocabulary tokens, best merged token first."""
    found = []
    for tok in vocab:
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                found.append((-rank[tok], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _merges_from_order(vocab: dict[str, int]) -> list[tuple[str, str]]:
    return _merges_from_scores(vocab, {tok: -i for tok, i in vocab.items()})


def _set_post_processor(tokenizer: Tokenizer, metadata: dict, tokens: list[str]) -> None:
    """Add BOS / EOS around every encoded text when the file asks for it."""
    single = "$A"
    special = []
    for flag, key, where in (("add_bos_token", "bos_token_id", "pre"), ("add_eos_token", "eos_token_id", "post")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        default = flag == "add_bos_token" and metadata.get("tokenizer.ggml.model") == "llama"
        if metadata.get(f"tokenizer.ggml.{flag}", default) and token_id is not None and 0 <= token_id < len(tokens):
            text = tokens[token_id]
            single = f"{text} {single}" if where == "pre" else f"{single} {text}"
            special.append((text, int(token_id)))
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=f"{single} $B:1", special_tokens=special)
