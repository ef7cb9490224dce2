"""The bytes of vocabulary entries: byte-level BPE and SentencePiece (metaspace, ``<0xNN>`` byte fallback)."""

from tiny_models import build_tokenizer
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ninefold.llm.token_bytes import vocabulary_bytes
from ninefold.llm.tokenizer import Tokenizer


def _sentencepiece() -> Tokenizer:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "{", '"', "a", "é", "Ċ", "▁the", "<0x0A>x"]
    tk = HFTokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=0, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.add_special_tokens([AddedToken(p, special=True) for p in pieces[:3]])
    return Tokenizer(tk, {"bos_token": "<s>", "eos_token": "</s>"})


def test_sentencepiece_byte_fallback_metaspace_and_latin1_pieces():
    tok = _sentencepiece()
    assert not tok.byte_level
    vocab = vocabulary_bytes(tok, tok.vocab_size + 2)
    ids = {p: tok._tk.token_to_id(p) for p in ("<0x22>", "<0x0A>", "▁the", "é", "Ċ", '"', "<s>")}
    assert vocab[ids["<0x22>"]] == b'"' and vocab[ids["<0x0A>"]] == b"\n"
    assert vocab[ids["▁the"]] == b" the" and vocab[ids["é"]] == "é".encode() and vocab[ids["Ċ"]] == "Ċ".encode()
    assert vocab[ids["<s>"]] is None and vocab[-1] is None  # special tokens and ids past the vocabulary


def test_byte_level_pieces_decode_through_the_byte_alphabet_and_end_ids_are_left_out():
    tok = Tokenizer(build_tokenizer())
    assert tok.byte_level
    newline, space_a = tok.encode("\n", add_special_tokens=False), tok.encode(" a", add_special_tokens=False)
    vocab = vocabulary_bytes(tok, tok.vocab_size, exclude=(space_a[0],))
    assert vocab[newline[0]] == b"\n" and vocab[space_a[0]] is None
    for token_id, data in enumerate(vocab):
        if data is not None and token_id not in tok.all_special_ids:
            assert tok.decode([token_id], skip_special_tokens=False).encode() == data or b"\xef\xbf\xbd" in \
                tok.decode([token_id], skip_special_tokens=False).encode()  # partial UTF-8 shows as U+FFFD


def test_logprob_token_texts_show_the_bytes_a_piece_stands_for():
    """The server's logprob texts and bytes: a SentencePiece byte-fallback token is its byte (not "<0x0A>",
    not U+FFFD's bytes), a metaspace piece keeps its leading space, special tokens show their text."""
    from ninefold.llm.server.logprobs import TokenTexts

    tok = _sentencepiece()
    texts = TokenTexts(tok)
    ids = {p: tok._tk.token_to_id(p) for p in ("<0x0A>", "<0xE2>", "▁the", "é", "</s>")}
    assert texts.text(ids["<0x0A>"]) == "\n" and texts.bytes(ids["<0x0A>"]) == [10]
    assert texts.bytes(ids["<0xE2>"]) == [0xE2] and texts.text(ids["<0xE2>"]) == "\ufffd"  # a lone lead byte
    assert texts.text(ids["▁the"]) == " the" and texts.bytes(ids["▁the"]) == list(b" the")
    assert texts.text(ids["é"]) == "é" and texts.text(ids["</s>"]) == "</s>"
    level = Tokenizer(build_tokenizer())
    newline = level.encode("\n", add_special_tokens=False)[0]
    assert TokenTexts(level).text(newline) == "\n" and TokenTexts(level).bytes(newline) == [10]


def test_completion_top_logprobs_keep_the_likeliest_of_tokens_with_the_same_text():
    """Two lone lead bytes both show as U+FFFD: the legacy top_logprobs dict (keyed by text) keeps the likelier
    one's logprob, so the sampled token's own logprob never exceeds the dict's best."""
    from ninefold.llm.server.logprobs import TokenTexts, completion_logprobs

    tok = _sentencepiece()
    texts = TokenTexts(tok)
    e2, e3, a = (tok._tk.token_to_id(p) for p in ("<0xE2>", "<0xE3>", "a"))
    step = {e2: -0.5, a: -1.0, e3: -2.0}
    out = completion_logprobs([e2], [step], 3, texts, 0)
    assert out["top_logprobs"] == [{"\ufffd": -0.5, "a": -1.0}] and out["token_logprobs"] == [-0.5]
    sampled_last = completion_logprobs([e3], [step], 2, texts, 0)  # the sampled token ranks below the top 2
    assert sampled_last["top_logprobs"] == [{"\ufffd": -0.5, "a": -1.0}] and sampled_last["token_logprobs"] == [-2.0]
