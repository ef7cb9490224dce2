"""GGUF loading on tiny files written here with gguf.GGUFWriter: every supported tensor type
round-trips within its quantization error, q/k rows come back in HF order, the tokenizer and
config come from the metadata, and every kind of bad file raises an error naming what it found."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

from ninefold.llm.gguf import GGUFError, load_gguf
from ninefold.llm.gguf_dequant import dequantize

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 256, 4, 2, 64, 2
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGED = {"Ġ t": "Ġt", "h e": "he", "Ġt he": "Ġthe", "i n": "in"}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _byte_chars() -> list[str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


TOKENS = CONTROL + _byte_chars() + list(MERGED.values())
VOCAB = len(TOKENS)


# ----------------------------------------------------------------------------- quantizers
# gguf's quants module quantizes F16, BF16, Q8_0, Q4_0, Q4_1; the K-quants are packed here.

def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _quant_q4_k(x: np.ndarray, five_bits: bool = False) -> np.ndarray:
    levels = 31 if five_bits else 15
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = np.maximum(scale.max(-1, keepdims=True) / 63, 1e-8)
    dmin = np.maximum(-lo.min(-1, keepdims=True) / 63, 1e-8)
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin), 0, 63).astype(np.uint8)
    q = np.clip(np.round((sub + (dmin * mn)[..., None]) / (d * sc)[..., None]), 0, levels).astype(np.uint8)
    packed = np.zeros((sub.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    low = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), packed]
    if five_bits:
        high = (q >> 4).reshape(-1, 8, 32)
        qh = np.zeros((sub.shape[0], 32), np.uint8)
        for s in range(8):
            qh |= high[:, s] << s
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _quant_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = np.maximum(scale.max(-1, keepdims=True) / 127, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d), 1, 127).astype(np.int8)
    q = (np.clip(np.round(sub / (d * sc)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([q[:, :, 0] & 15 | ((q[:, :, 2] & 15) << 4), q[:, :, 1] & 15 | ((q[:, :, 3] & 15) << 4)], axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


def _two_bit_bytes(q: np.ndarray) -> np.ndarray:
    """2-bit codes [n, 256] (order: half, j, s, l) -> qs [n, 64]: bits 2j of byte 32 half + 16 s + l."""
    q = q.reshape(-1, 2, 4, 2, 16).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _quant_q2_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    low = np.maximum(-sub.min(-1), 0)  # value = d * sc * q - dmin * m, q in 0..3
    scale = (sub.max(-1) + low) / 3
    d = np.maximum(scale.max(-1, keepdims=True) / 15, 1e-8).astype(np.float16).astype(np.float32)
    dmin = np.maximum(low.max(-1, keepdims=True) / 15, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d), 1, 15)
    mn = np.clip(np.round(low / dmin), 0, 15)
    q = np.clip(np.round((sub + (dmin * mn)[..., None]) / (d * sc)[..., None]), 0, 3)
    scales = (sc.astype(np.uint8) | (mn.astype(np.uint8) << 4))
    return np.concatenate([scales, _two_bit_bytes(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _quant_q3_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 4  # value = d * sc * (q - 4), q in 0..7
    d = np.maximum(scale.max(-1, keepdims=True) / 31, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d), 1, 31)
    q = (np.clip(np.round(sub / (d * sc)[..., None]), -4, 3) + 4).astype(np.uint8)  # [n, 16, 16]
    high = (q >> 2).reshape(-1, 2, 4, 2, 16)  # the third bit: set = no -4
    hmask = np.zeros((q.shape[0], 2, 16), np.uint8)
    for h in range(2):
        for j in range(4):
            hmask |= high[:, h, j] << (4 * h + j)
    stored = (sc + 32).astype(np.uint8)  # [n, 16], 6 bits
    packed = np.zeros((q.shape[0], 12), np.uint8)
    packed[:, :8] = (stored[:, :8] & 15) | ((stored[:, 8:] & 15) << 4)
    for i in range(16):
        packed[:, 8 + i % 4] |= (stored[:, i] >> 4) << (2 * (i // 4))
    return np.concatenate([hmask.reshape(-1, 32), _two_bit_bytes(q & 3), packed, _f16_bytes(d)], axis=1)


IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _iq4_nibbles(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The IQ4 levels nearest to ``x / scale`` (``[n, 32]``, one scale per row) packed as 16 bytes per 32 values."""
    safe = np.where(scale == 0, 1, scale)
    q = np.abs(x / safe[:, None] - IQ4_LEVELS[:, None, None]).argmin(0).astype(np.uint8)  # [n, 32]
    return q[:, :16] | (q[:, 16:] << 4)


def _signed_max(x: np.ndarray) -> np.ndarray:
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]


def _quant_iq4_nl(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 32)
    d = (_signed_max(blocks) / -127).astype(np.float16).astype(np.float32)  # the largest value lands on -127
    return np.concatenate([_f16_bytes(d), _iq4_nibbles(blocks, d)], axis=1)


def _quant_iq4_xs(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 8, 32)
    want = _signed_max(sub) / -127  # [n, 8]
    d = np.maximum(np.abs(want).max(-1, keepdims=True) / 32, 1e-8).astype(np.float16).astype(np.float32)
    ls = np.clip(np.round(want / d), -32, 31).astype(np.int32) + 32  # 6 bits
    qs = _iq4_nibbles(sub.reshape(-1, 32), (d * (ls - 32)).reshape(-1)).reshape(-1, 128)
    high = ((ls >> 4) << (2 * np.arange(8))).sum(-1).astype(np.uint16)
    low = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), high.reshape(-1, 1).view(np.uint8), low, qs], axis=1)


# Lattice types whose blocks start with their float16 scale ``d``; the tests write them as random blocks.
LATTICE_TYPES = (T.IQ1_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)


def random_lattice_blocks(x: np.ndarray, qtype: T) -> np.ndarray:
    """Random ``qtype`` blocks (no encoder exists here) for a matrix shaped like ``x``, each block's ``d`` set so the
    decoded values have the standard deviation of ``x``'s block: a weight of the right type, not of ``x``'s values."""
    from gguf import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng([zlib.crc32(np.ascontiguousarray(x).tobytes()), int(qtype)])
    raw = rng.integers(0, 256, size=(x.size // block, nbytes), dtype=np.uint8)
    raw[:, 0:2] = _f16_bytes(np.ones(raw.shape[0], np.float32))
    unit = quants.dequantize(raw, qtype).std(-1)
    d = x.reshape(-1, block).std(-1) / np.maximum(unit, 1e-6)
    raw[:, 0:2] = _f16_bytes(d.astype(np.float32))
    return raw.reshape(x.shape[0], -1)


def quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    """Bytes (or values for F32/F16) of `x` [rows, cols] in `qtype`."""
    if qtype == T.F32:
        return x.astype(np.float32)
    if qtype == T.F16:
        return x.astype(np.float16)
    rows = x.shape[0]
    if qtype == T.Q4_K:
        return _quant_q4_k(x).reshape(rows, -1)
    if qtype == T.Q5_K:
        return _quant_q4_k(x, five_bits=True).reshape(rows, -1)
    if qtype == T.Q6_K:
        return _quant_q6_k(x).reshape(rows, -1)
    if qtype == T.Q3_K:
        return _quant_q3_k(x).reshape(rows, -1)
    if qtype == T.Q2_K:
        return _quant_q2_k(x).reshape(rows, -1)
    if qtype == T.IQ4_NL:
        return _quant_iq4_nl(x).reshape(rows, -1)
    if qtype == T.IQ4_XS:
        return _quant_iq4_xs(x).reshape(rows, -1)
    if qtype in LATTICE_TYPES:
        return random_lattice_blocks(x, qtype)
    if qtype == T.Q8_K:  # no encoder anywhere: zero blocks of the right size, for the error test
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((rows, x.shape[1] // block * nbytes), np.uint8)
    return quants.quantize(x, qtype)


# Relative RMS error each type must stay within (4-bit: 1/15 of a block's range per step).
REL_ERROR = {T.F32: 0.0, T.F16: 1e-3, T.BF16: 5e-3, T.Q8_0: 0.01, T.Q6_K: 0.03, T.Q5_K: 0.05,
             T.Q5_0: 0.06, T.Q5_1: 0.05, T.Q4_0: 0.12, T.Q4_1: 0.1, T.Q4_K: 0.1, T.IQ4_NL: 0.12, T.IQ4_XS: 0.12, T.Q3_K: 0.22, T.Q2_K: 0.4}
ALL_TYPES = list(REL_ERROR)


# ----------------------------------------------------------------------------- writing files

def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (HF halves -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(arch: str = "llama", seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)), "model.norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN)}
    if not tied:
        w["lm_head.weight"] = rng.standard_normal((VOCAB, HIDDEN))
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN))
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN))
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN))
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((HIDDEN, HEADS * HEAD_DIM))
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((FFN, HIDDEN))
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((FFN, HIDDEN))
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((HIDDEN, FFN))
        if arch == "qwen2":
            for proj, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w[p + f"self_attn.{proj}_proj.bias"] = rng.standard_normal(n * HEAD_DIM)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = 1 + 0.1 * rng.standard_normal(HEAD_DIM)
            w[p + "self_attn.k_norm.weight"] = 1 + 0.1 * rng.standard_normal(HEAD_DIM)
    return {k: v.astype(np.float32) for k, v in w.items()}


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's stacked projections
}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def write_gguf(path: Path, weights: dict[str, np.ndarray], qtype: T | Callable[[str], T] = T.F32, arch: str = "llama",
               metadata_overrides: dict | None = None, skip: tuple[str, ...] = (), extra: dict | None = None,
               extra_kv: dict | None = None, eot_id: int | None = None) -> Path:
    """A GGUF file of `weights`: matrices in `qtype` (or `qtype(hf_name)`, one type per matrix), vectors in
    F32, llama.cpp's naming and q/k order."""
    type_of = qtype if callable(qtype) else (lambda name: qtype)
    writer = GGUFWriter(str(path), arch)
    meta = {
        "block_count": LAYERS, "context_length": 512, "embedding_length": HIDDEN, "feed_forward_length": FFN,
        "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
        "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0, "vocab_size": VOCAB,
    }
    meta.update(metadata_overrides or {})
    for key, value in meta.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(CONTROL) + [1] * (VOCAB - len(CONTROL)))
    writer.add_token_merges(list(MERGED))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    writer.add_name("tiny-test")
    if eot_id is not None:
        writer.add_eot_token_id(eot_id)
    for key, value in (extra_kv or {}).items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)
    for name, value in weights.items():
        if gguf_name(name) in skip:
            continue
        if arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = llama_permute(value, HEADS)
        elif arch in ("llama", "mistral") and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = llama_permute(value, KV_HEADS)
        if value.ndim == 2 and type_of(name) != T.F32:
            data = quantize(value, type_of(name))
            writer.add_tensor(gguf_name(name), data, raw_dtype=None if data.dtype != np.uint8 else type_of(name))
        else:
            writer.add_tensor(gguf_name(name), value)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_dequant(value: np.ndarray, qtype: T) -> np.ndarray:
    """What the gguf package's numpy dequantizer reads back from our bytes."""
    if qtype in (T.F32, T.F16):
        return value.astype(np.float32)
    return quants.dequantize(value, qtype)


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_round_trip_within_quantization_error(tmp_path, qtype):
    weights = hf_weights(tied=False)
    ckpt = load_gguf(write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", weights, qtype))
    assert set(ckpt.tensors) == set(weights)
    for name, original in weights.items():
        got = ckpt.tensors[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == original.shape, name
        expected = torch.from_numpy(original).double()
        if original.ndim == 1 or qtype == T.F32:
            torch.testing.assert_close(got.double(), expected, rtol=0, atol=0)
            continue
        rel = ((got.double() - expected).norm() / expected.norm()).item()
        assert rel <= REL_ERROR[qtype], (name, rel)
        # bit-for-bit what the gguf package's own numpy dequantizer reads from the same bytes
        heads = HEADS if "q_proj" in name else KV_HEADS if "k_proj" in name else None
        stored = llama_permute(original, heads) if heads else original
        ref = reference_dequant(quantize(stored, qtype), qtype)
        ref = llama_unpermute(ref, heads) if heads else ref
        torch.testing.assert_close(got, torch.from_numpy(ref), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
                                   T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ3_S, T.TQ2_0, T.MXFP4, T.BF16],
                         ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference_on_random_blocks(qtype):
    """Random bytes are valid blocks for every type (with finite float16 scales): decode like gguf-py."""
    from gguf import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(5 * 3, nbytes), dtype=np.uint8)
    scale_at = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q2_K: [80, 82], T.Q3_K: [108],
                T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0], T.IQ2_XXS: [0],
                T.IQ3_S: [0], T.TQ2_0: [64], T.MXFP4: [], T.BF16: []}[qtype]
    for at in scale_at:
        raw[:, at : at + 2] = _f16_bytes(rng.standard_normal(raw.shape[0]).astype(np.float32))
    if qtype == T.BF16:
        raw = rng.standard_normal((5, 3 * block)).astype(np.float32)
        raw = quants.quantize(raw, T.BF16)
    raw = raw.reshape(5, -1)
    cols = raw.shape[1] // nbytes * block
    got = dequantize(raw, int(qtype), (5, cols))
    ref = quants.dequantize(raw, qtype)
    np.testing.assert_array_equal(got.numpy(), ref)
    if qtype in (T.Q6_K, T.Q4_K):  # decoded by the native library where it is built: the torch decoders too
        from ninefold.llm.gguf_dequant import int4_codes
        from ninefold.ops import cpu_native

        with cpu_native.enabled(False):
            np.testing.assert_array_equal(dequantize(raw, int(qtype), (5, cols)).numpy(), ref)
            plain = int4_codes(raw, int(qtype), (5, cols)) if qtype == T.Q4_K else None
        if plain is not None:
            native = int4_codes(raw, int(qtype), (5, cols))
            assert all(torch.equal(a, b) for a, b in zip(native, plain, strict=True))


def test_qk_rows_back_in_hf_order(tmp_path):
    weights = hf_weights()
    ckpt = load_gguf(write_gguf(tmp_path / "f32.gguf", weights, T.F32))
    for i in range(LAYERS):
        for proj in ("q", "k"):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            assert torch.equal(ckpt.tensors[name], torch.from_numpy(weights[name]))
    # and the rows really were stored permuted: loading without the fix would differ
    stored = llama_permute(weights["model.layers.0.self_attn.q_proj.weight"], HEADS)
    assert not np.array_equal(stored, weights["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("arch,hf_arch", [("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
                                          ("mistral", "MistralForCausalLM")])
def test_other_architectures(tmp_path, arch, hf_arch):
    weights = hf_weights(arch)
    ckpt = load_gguf(write_gguf(tmp_path / f"{arch}.gguf", weights, T.F16, arch=arch))
    assert ckpt.config["architectures"] == [hf_arch]
    assert set(ckpt.tensors) == set(weights)
    q = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(ckpt.tensors[q], torch.from_numpy(weights[q].astype(np.float16).astype(np.float32)), rtol=0, atol=0)
    if arch == "qwen2":
        b = "model.layers.0.self_attn.k_proj.bias"
        torch.testing.assert_close(ckpt.tensors[b], torch.from_numpy(weights[b]), rtol=0, atol=0)


def test_config_tokenizer_and_generation_config(tmp_path):
    ckpt = load_gguf(write_gguf(tmp_path / "t.gguf", hf_weights(), T.Q8_0))
    c = ckpt.config
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (HIDDEN, FFN, HEADS, KV_HEADS)
    assert (c["num_hidden_layers"], c["head_dim"], c["vocab_size"], c["max_position_embeddings"]) == (LAYERS, HEAD_DIM, VOCAB, 512)
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in ckpt.tensors
    assert c["rms_norm_eps"] == pytest.approx(1e-6) and c["rope_theta"] == 10000.0 and c["rope_scaling"] is None
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert ckpt.generation_config["eos_token_id"] == 2
    assert ckpt.tokenizer_config["chat_template"] == TEMPLATE
    assert (ckpt.tokenizer_config["bos_token"], ckpt.tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert ckpt.name == "tiny-test"
    tok = ckpt.tokenizer
    assert tok.encode(" the").ids == [TOKENS.index("Ġthe")]
    assert tok.encode("<|im_end|>in").ids == [2, TOKENS.index("in")]
    text = "héllo\n  wörld 中 🎉"
    assert tok.decode(tok.encode(text).ids) == text


def test_sampling_defaults_and_stop_ids_from_metadata(tmp_path):
    path = tmp_path / "s.gguf"
    writer_meta = {"general.sampling.temp": 0.6, "general.sampling.top_p": 0.9, "general.sampling.top_k": 40}
    write_gguf(path, hf_weights(), T.F16, extra_kv=writer_meta, eot_id=0)
    gen = load_gguf(path).generation_config
    assert gen["temperature"] == pytest.approx(0.6) and gen["top_p"] == pytest.approx(0.9) and gen["top_k"] == 40
    assert gen["do_sample"] is True and gen["eos_token_id"] == [2, 0]


def test_bfloat16_output_dtype(tmp_path):
    weights = hf_weights()
    ckpt = load_gguf(write_gguf(tmp_path / "t.gguf", weights, T.Q4_1), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.tensors.values())
    with pytest.raises(ValueError, match="dtype"):
        load_gguf(tmp_path / "t.gguf", dtype=torch.int8)


# ----------------------------------------------------------------------------- errors

def test_unsupported_tensor_type_is_named(tmp_path):
    # Q8_K is ggml's activation type: no file format, no decoder here or in gguf-py
    path = write_gguf(tmp_path / "q8_k.gguf", hf_weights(), T.Q8_K)
    with pytest.raises(GGUFError, match="has type Q8_K; supported: .*IQ4_XS"):
        load_gguf(path)


def test_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "gemma.gguf", hf_weights(), T.F32, arch="gemma2")
    with pytest.raises(GGUFError, match="'gemma2'"):
        load_gguf(path)


def phi3_weights(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``weights`` as Phi-3 stores them: q/k/v stacked into qkv_proj, gate/up into gate_up_proj."""
    out = {}
    for name, value in weights.items():
        if ".self_attn.q_proj." in name:
            parts = [weights[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = np.concatenate(parts)
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = np.concatenate([value, weights[name.replace("gate", "up")]])
        elif not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
            out[name] = value
    return out


@pytest.mark.parametrize("qtype", [T.F32, T.Q4_0])
def test_a_phi3_gguf_generates_what_the_same_weights_do_as_llama(tmp_path, qtype):
    """llama.cpp's phi3 files: attn_qkv and a stacked ffn_up (gate first), no q/k row permutation; the same weights
    written as a llama file (split, permuted) must give the same tokens."""
    from ninefold import LLM, SamplingParams

    weights = hf_weights()
    phi3 = write_gguf(tmp_path / "phi3.gguf", phi3_weights(weights), qtype, arch="phi3")
    llama = write_gguf(tmp_path / "llama.gguf", weights, qtype, arch="llama")
    assert load_gguf(phi3).config["architectures"] == ["Phi3ForCausalLM"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [LLM(str(p), device="cpu", dtype="float32", num_kv_blocks=32).generate(
        prompt_token_ids=[[5, 9, 33, 40], [7, 8]], sampling_params=params) for p in (phi3, llama)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0])
def test_a_phi3_gguf_with_a_partial_rotary_embedding_generates_what_transformers_does(tmp_path, qtype):
    """Phi-4-mini's files rotate rope.dimension_count (here 48) of each head's 64 dimensions; quantized q/k/v rows
    are reordered for it as they are (kept packed)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from ninefold import LLM, SamplingParams

    weights = phi3_weights(hf_weights())
    path = write_gguf(tmp_path / "phi4.gguf", weights, qtype, arch="phi3", metadata_overrides={"rope.dimension_count": 48})
    ckpt = load_gguf(path)
    assert ckpt.config["partial_rotary_factor"] == 0.75 and ckpt.config["ninefold_rotary_dim"] == 48
    hf = Phi3ForCausalLM(Phi3Config(
        hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        num_hidden_layers=LAYERS, vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.75,
        max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0)).eval()
    decoded = {name: t.float() for name, t in load_gguf(path, keep_quantized=False).tensors.items()}
    hf.load_state_dict(decoded, strict=False)  # (the tied output layer is the embedding)
    prompt = [5, 9, 33, 40, 7, 8, 11]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    exact = LLM(str(path), device="cpu", dtype="float32", quantization="none", num_kv_blocks=32)
    got = exact.generate(prompt_token_ids=[prompt],
                         sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert got[0].outputs[0].token_ids == want
    if qtype != T.F32:  # kept packed, the codes' rows in the model's order: the same matrix as the exact engine's
        from ninefold.llm.gguf_packed import PackedLinear

        packed = LLM(str(path), device="cpu", dtype="float32", quantization="int4", num_kv_blocks=32)
        qkv = packed.engine.model.layers[0].qkv
        assert isinstance(qkv, PackedLinear)
        torch.testing.assert_close(qkv(torch.eye(HIDDEN)).T, exact.engine.model.layers[0].qkv, rtol=0, atol=1e-5)
    llama = write_gguf(tmp_path / "llama.gguf", hf_weights(), qtype, metadata_overrides={"rope.dimension_count": 48})
    with pytest.raises(GGUFError, match="rotary dimension 48 != head size 64 .partial rotary. is supported for phi3 "
                                        "files only, not llama"):
        load_gguf(llama)


def test_a_phi3_gguf_carries_its_longrope_factors_into_the_config(tmp_path):
    long, short = np.linspace(1, 8, HEAD_DIM // 2, dtype=np.float32), np.linspace(1, 2, HEAD_DIM // 2, dtype=np.float32)
    path = write_gguf(tmp_path / "phi35.gguf", phi3_weights(hf_weights()), T.F32, arch="phi3",
                      metadata_overrides={"context_length": 4096},
                      extra={"rope_factors_long.weight": long, "rope_factors_short.weight": short},
                      extra_kv={"phi3.rope.scaling.original_context_length": 512,
                                "phi3.rope.scaling.attn_factor": 1.25})
    from ninefold.llm.config import ModelConfig

    scaling = ModelConfig.from_dict(load_gguf(path).config).rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 512
    assert scaling["long_factor"] == pytest.approx(long.tolist()) and scaling["short_factor"] == pytest.approx(short.tolist())
    assert scaling["attention_factor"] == 1.25
    bad = write_gguf(tmp_path / "half.gguf", phi3_weights(hf_weights()), T.F32, arch="phi3",
                     extra={"rope_factors_long.weight": long})
    with pytest.raises(GGUFError, match=r"rope_factors_short.weight is missing; longrope needs both factor tensors"):
        load_gguf(bad)


def test_truncated_file(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", hf_weights(), T.Q4_0)
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 2000, 30, 10):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated"):
            load_gguf(short)


def test_not_gguf_and_corrupt_header(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf(bad)
    good = write_gguf(tmp_path / "t.gguf", hf_weights(), T.F16).read_bytes()
    wrong_version = bytearray(good)
    wrong_version[4:8] = (7).to_bytes(4, "little")
    bad.write_bytes(bytes(wrong_version))
    with pytest.raises(GGUFError, match="version 7"):
        load_gguf(bad)
    huge_count = bytearray(good)
    huge_count[8:16] = (1 << 60).to_bytes(8, "little")
    bad.write_bytes(bytes(huge_count))
    with pytest.raises(GGUFError, match="corrupt"):
        load_gguf(bad)
    with pytest.raises(GGUFError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")


def test_missing_unexpected_and_misshapen_tensors(tmp_path):
    weights = hf_weights()
    path = write_gguf(tmp_path / "m.gguf", weights, T.F32, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(GGUFError, match=r"lacks tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        load_gguf(path)
    path = write_gguf(tmp_path / "u.gguf", weights, T.F32, extra={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(GGUFError, match="blk.0.mystery.weight"):
        load_gguf(path)
    path = write_gguf(tmp_path / "s.gguf", weights, T.F32, metadata_overrides={"feed_forward_length": 512})
    with pytest.raises(GGUFError, match="shape"):
        load_gguf(path)
    path = write_gguf(tmp_path / "r.gguf", weights, T.F32, extra={"rope_freqs.weight": np.ones(16, np.float32)})
    with pytest.raises(GGUFError, match=r"rope_freqs.weight is F32 of shape \(16,\); expected .* shape \(32,\)"):
        load_gguf(path)
    path = write_gguf(tmp_path / "z.gguf", weights, T.F32, extra={"rope_freqs.weight": np.zeros(32, np.float32)})
    with pytest.raises(GGUFError, match="not positive and finite"):
        load_gguf(path)


def llama_cpp_rope_factors(base: float, dim: int, factor: float, low: float, high: float, old_len: int) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter writes for a llama3 ``rope_scaling`` (its published formula,
    written out here independently of ninefold's)."""
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * np.pi * base ** (i / dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def test_rope_freqs_give_transformers_llama3_frequencies(tmp_path):
    """A Llama 3.1-style GGUF (rope_freqs.weight) loads, and its frequencies are transformers' llama3 ones."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ninefold.llm.config import ModelConfig, rope_inv_freq

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    factors = llama_cpp_rope_factors(10000.0, HEAD_DIM, 8.0, 1.0, 4.0, 64)
    assert len(set(factors.tolist())) > 3  # all three regimes: kept, divided by 8, interpolated
    ckpt = load_gguf(write_gguf(tmp_path / "l31.gguf", hf_weights(), T.F32, extra={"rope_freqs.weight": factors}))
    assert "rope_freqs.weight" not in ckpt.tensors
    assert ckpt.config["rope_scaling"] == {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                                                        rope_theta=10000.0, rope_scaling=scaling), "cpu")
    torch.testing.assert_close(rope_inv_freq(ModelConfig.from_dict(ckpt.config)), want.float(), rtol=1e-6, atol=0)


def test_rope_freqs_reach_the_model(tmp_path):
    """Factors of 1 change nothing; llama3 factors change the logits of a long prompt."""
    from ninefold import LLM, SamplingParams

    weights = hf_weights()
    prompt = [{"prompt_token_ids": [(7 * i) % 90 + 5 for i in range(120)]}]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

    def top5(extra):
        llm = LLM(str(write_gguf(tmp_path / f"m{len(extra)}{sum(extra.get('rope_freqs.weight', [0]))}.gguf",
                                 weights, T.F32, extra=extra)), device="cpu")
        return llm.generate(prompt, params)[0].outputs[0].logprobs[0]

    plain = top5({})
    assert top5({"rope_freqs.weight": np.ones(HEAD_DIM // 2, np.float32)}) == plain
    scaled = top5({"rope_freqs.weight": llama_cpp_rope_factors(10000.0, HEAD_DIM, 8.0, 1.0, 4.0, 16)})
    assert scaled != plain


def test_dequantize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="Q8_K is not supported"):
        dequantize(np.zeros(292, np.uint8), int(T.Q8_K), (256,))
    with pytest.raises(ValueError, match="needs"):
        dequantize(np.zeros(33, np.uint8), int(T.Q8_0), (32,))
    with pytest.raises(ValueError, match="not a ggml type"):
        dequantize(np.zeros(4, np.uint8), 999, (1,))


# ----------------------------------------------------------------------------- sentencepiece vocabularies

def _write_spm_tokenizer(path: Path) -> Path:
    """A Llama-2-style (sentencepiece BPE) vocabulary with byte fallback and scores but no merges."""
    import string

    pieces = list(dict.fromkeys(list(string.ascii_letters + string.digits + ".,!?") + [
        "▁", "▁t", "he", "▁the", "▁a", "in", "▁in", "er", "▁w", "or", "▁wor", "ld", "▁world", "▁h", "ll",
        "▁hello", "el", "lo", "ello"]))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# llama.cpp's ids for the file of _write_spm_tokenizer (llama-cpp-python 0.3.36, vocab_only, add_bos=True,
# special=True): a "▁" in front of every stretch of text between special tokens, also one that starts with a space.
LLAMA_CPP_SPM_IDS = {
    "hello world": [1, 325, 327, 339, 273, 337],
    "  the  world\n": [1, 325, 325, 328, 325, 337, 13],
    " x": [1, 325, 325, 282],
    "Héllo wörld 中 🎉": [1, 325, 292, 198, 172, 339, 273, 333, 198, 185, 276, 336, 325, 231, 187, 176, 325, 243, 162,
                          145, 140],
    "in the": [1, 331, 328],
    "": [1],
    "</s> the<s>": [1, 2, 325, 328, 1],
    "a</s>b": [1, 329, 2, 325, 260],
}


def test_sentencepiece_tokenizer_matches_llama_cpp(tmp_path):
    from ninefold.llm.gguf import load_gguf_tokenizer
    from ninefold.llm.tokenizer import Tokenizer

    path = _write_spm_tokenizer(tmp_path / "spm.gguf")
    ours = Tokenizer(*load_gguf_tokenizer(path))
    for text, ids in LLAMA_CPP_SPM_IDS.items():
        assert ours.encode(text) == ids, text
        if "</s>" not in text:
            assert ours.decode(ids) == text, text
    try:
        from llama_cpp import Llama
    except ImportError:
        return
    reference = Llama(str(path), vocab_only=True, verbose=False)  # the table above, measured again where it is installed
    for text in LLAMA_CPP_SPM_IDS:
        assert ours.encode(text) == reference.tokenize(text.encode(), add_bos=True, special=True), text


def test_sentencepiece_tokenizer_matches_transformers_within_text(tmp_path):
    """Where transformers' versions agree (no leading space, no special tokens: on both, 5.17 tokenizes as
    llama.cpp and 5.25 does not), ninefold gives transformers' pieces."""
    from transformers import AutoTokenizer

    from ninefold.llm.gguf import load_gguf_tokenizer
    from ninefold.llm.tokenizer import Tokenizer

    path = _write_spm_tokenizer(tmp_path / "spm.gguf")
    ours = Tokenizer(*load_gguf_tokenizer(path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello world", "the  world\n", "Héllo wörld 中 🎉", "in the", "a b  c d"]:
        ids = theirs(text, add_special_tokens=False).input_ids
        assert ours.encode(text) == [1] + ids, text  # the BOS as the file's add_bos_token says
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
