"""Malformed GGUF files crafted here byte by byte (or with gguf.GGUFWriter): each must raise GGUFError
naming what is wrong, never RecursionError, TypeError, KeyError or an exception of the tokenizers library."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from gguf import GGUFWriter

from ninefold.llm.gguf import GGUFError, load_gguf_tokenizer
from ninefold.llm.gguf_reader import read_gguf

F32, U32, I32, F32_VALUE, BOOL, STRING, ARRAY = 0, 4, 5, 6, 7, 8, 9  # ggml F32; GGUF value types


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, value_type: int, payload: bytes) -> bytes:
    return _string(key) + struct.pack("<I", value_type) + payload


def _craft(path: Path, kvs: list[bytes] = (), tensors: list[tuple[str, tuple[int, ...], int]] = (),
           data: bytes = b"\0" * 64, alignment: int = 32) -> Path:
    """Write a GGUF v3 file: metadata entries `kvs`, F32 `tensors` as (name, dims innermost first, offset)."""
    blob = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs)
    for name, dims, offset in tensors:
        blob += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        blob += struct.pack("<IQ", F32, offset)
    blob += b"\0" * (-len(blob) % alignment) + data
    path.write_bytes(blob)
    return path


def test_crafted_file_reads(tmp_path):
    nested = struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", U32, 2) + struct.pack("<II", 7, 8)
    file = read_gguf(_craft(tmp_path / "ok.gguf", [_kv("k", ARRAY, nested)], [("w", (4, 2), 0), ("v", (8,), 32)]))
    assert [list(a) for a in file.metadata["k"]] == [[7, 8]]
    assert file.tensors["w"].shape == (2, 4) and file.tensors["v"].offset == 32


def test_deeply_nested_arrays_are_refused(tmp_path):
    depth = 5000  # 12 bytes a level: deep enough for a RecursionError without a limit
    payload = struct.pack("<IQ", ARRAY, 1) * depth + struct.pack("<IQ", U32, 0)
    with pytest.raises(GGUFError, match=r"'k' nests arrays more than \d+ deep"):
        read_gguf(_craft(tmp_path / "nested.gguf", [_kv("k", ARRAY, payload)]))


def test_element_count_past_int64_is_refused(tmp_path):
    # 8 x (2**61 + 1) F32 elements: 2**64 + 8, which wraps to 8 in int64 and would fit the 64 data bytes.
    path = _craft(tmp_path / "huge.gguf", tensors=[("w", (8, 2**61 + 1), 0)])
    with pytest.raises(GGUFError, match=r"tensor 'w' of shape \(2305843009213693953, 8\) ends at byte"):
        read_gguf(path)


@pytest.mark.parametrize("value_type, payload, found", [
    (STRING, _string("32"), "'32'"),
    (ARRAY, struct.pack("<IQI", U32, 1, 32), "array"),
    (F32_VALUE, struct.pack("<f", 32.0), "32.0"),
    (BOOL, struct.pack("<?", True), "True"),
    (I32, struct.pack("<i", -32), "-32"),
    (U32, struct.pack("<I", 0), "0"),
    (U32, struct.pack("<I", 24), "24"),
])
def test_bad_alignment_is_refused(tmp_path, value_type, payload, found):
    path = _craft(tmp_path / "a.gguf", [_kv("general.alignment", value_type, payload)])
    with pytest.raises(GGUFError, match=rf"general.alignment is {found}.*integer power of two"):
        read_gguf(path)


def test_custom_alignment_is_honoured(tmp_path):
    path = _craft(tmp_path / "a.gguf", [_kv("general.alignment", U32, struct.pack("<I", 64))], [("w", (4,), 0)],
                  alignment=64)
    file = read_gguf(path)
    assert file.tensors["w"].nbytes == 16 and file.data.shape[0] == 64


def test_duplicate_tensor_names_are_refused(tmp_path):
    path = _craft(tmp_path / "dup.gguf", tensors=[("w", (4,), 0), ("w", (4,), 32)])
    with pytest.raises(GGUFError, match="two tensors named 'w'"):
        read_gguf(path)


def test_misaligned_tensor_offset_is_refused(tmp_path):
    path = _craft(tmp_path / "mis.gguf", tensors=[("w", (4,), 3)])
    with pytest.raises(GGUFError, match="tensor 'w' starts at data offset 3, not a multiple of the alignment 32"):
        read_gguf(path)


def _tokenizer_file(path: Path, tokens, model: str = "gpt2", **arrays) -> Path:
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    for key, value in arrays.items():
        if isinstance(value, int):
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_array(f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_well_formed_tokenizer_loads(tmp_path):
    tokenizer, _ = load_gguf_tokenizer(_tokenizer_file(tmp_path / "t.gguf", ["a", "b", "ab"], merges=["a b"]))
    assert tokenizer.encode("ab").ids == [2]


@pytest.mark.parametrize("tokens, model, arrays, message", [
    (["a", "b", "ab"], "gpt2", {"merges": ["a b", "ab"]}, r"merges\[1\] is 'ab'; a merge must be two tokens"),
    (["a", "b", "ab"], "gpt2", {"merges": ["a c"]}, r"merges\[0\] is 'a c', but 'c' is not in tokenizer.ggml.tokens"),
    (["a", "b", "ab"], "gpt2", {"merges": ["b a"]}, r"merges\[0\] is 'b a', but 'ba' is not in"),
    (["<unk>", "a", "b", "ab"], "llama", {"scores": [0.0, 0.0]},
     "tokenizer.ggml.scores has 2 entries but tokenizer.ggml.tokens has 4"),
    (["<unk>", "a", "b", "ab"], "llama", {"scores": ["x", "y", "z", "w"]}, "scores is not an array of numbers"),
    (["a", "b", "ab"], "gpt2", {"token_type": [1]}, "tokenizer.ggml.token_type has 1 entries"),
    ([1, 2, 3], "gpt2", {}, "tokenizer.ggml.tokens is ndarray; it must be an array of strings"),
    (["a", "b", "ab"], "gpt2", {"merges": [1, 2]}, "tokenizer.ggml.merges is ndarray; it must be an array of strings"),
    (["a", "b", "ab"], "gpt2", {"bos_token_id": "a"}, "bos_token_id is 'a'; a token id must be"),
])
def test_malformed_tokenizer_metadata_is_refused(tmp_path, tokens, model, arrays, message):
    path = _tokenizer_file(tmp_path / "t.gguf", tokens, model, **arrays)
    with pytest.raises(GGUFError, match=message):
        load_gguf_tokenizer(path)


def test_tokenizer_library_errors_become_gguf_errors(tmp_path):
    # A sentencepiece token that is not UTF-8: the tokenizers library refuses it with a TypeError.
    path = tmp_path / "t.gguf"
    _tokenizer_file(path, ["<unk>", "a", "b"], "llama")
    blob = path.read_bytes().replace(b"\x01\x00\x00\x00\x00\x00\x00\x00b", b"\x01\x00\x00\x00\x00\x00\x00\x00\xff")
    path.write_bytes(blob)
    with pytest.raises(GGUFError, match="tokenizer metadata is malformed"):
        load_gguf_tokenizer(path)
    # The file itself stays readable: only its tokenizer is refused.
    assert read_gguf(path).metadata["tokenizer.ggml.tokens"][2] == b"\xff".decode("utf-8", "surrogateescape")
