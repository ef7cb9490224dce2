"""Dequantize GGUF tensor bytes into float tensors with vectorised torch code.

Each ggml block format is decoded for all blocks of a tensor at once: the raw bytes are viewed as
`[n_blocks, block_bytes]`, the fields are sliced out as columns, and the values come from a few
shifts, masks and multiplies. Layouts follow ggml's `block_*` structs (little-endian).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from ninefold.ops import cpu_native

T = GGMLQuantizationType


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at byte `start` of every block, as float32 `[n, 1]`."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., m]` -> `[..., 2, m]`: low nibbles first, then high nibbles."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-2)


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in the 12 bytes of a Q4_K/Q5_K block -> float32 `[n, 8]` each."""
    s = scales.to(torch.int32)
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)), dim=1)
    mn = torch.cat((lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)), dim=1)
    return sc.float(), mn.float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:18]).reshape(-1, 32).float()
    return _f16(b, 0) * (q - 8.0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:20]).reshape(-1, 32).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _five_bit_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 codes in ``[0, 31]`` ``[n, 32]``: value ``j``'s low bits are nibble ``j // 16`` of ``qs[j % 16]``
    (low nibbles first), its fifth bit is bit ``j`` of the little-endian word ``qh``."""
    high = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [n, 4 bytes, 8 bits]
    return _nibbles(qs).reshape(-1, 32) | (high.reshape(-1, 32) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_five_bit_codes(b[:, 2:6], b[:, 6:22]).float() - 16.0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _five_bit_codes(b[:, 4:8], b[:, 8:24]).float() + _f16(b, 2)


def _two_bit_planes(qs: torch.Tensor) -> torch.Tensor:
    """K-quant 2-bit codes ``[n, 256]`` from ``qs`` ``[n, 64]``: per half of 128 values, 32 bytes; value ``l`` of
    sixteen-value group ``(j, s)`` is bits ``2j, 2j+1`` of byte ``16 s + l`` (order: half, j, s, l)."""
    q = qs.reshape(-1, 2, 1, 2, 16)  # [n, half, -, s, l]
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1, 1)
    return ((q >> shift) & 3).reshape(-1, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # scales[16] (low nibble: scale, high nibble: min, one per 16 values), qs[64], d, dmin
    scale, low = (b[:, 0:16] & 15).float(), (b[:, 0:16] >> 4).float()
    d, dmin = _f16(b, 80), _f16(b, 82)
    q = _two_bit_planes(b[:, 16:80]).float().reshape(-1, 16, 16)
    return ((d * scale).unsqueeze(-1) * q - (dmin * low).unsqueeze(-1)).reshape(-1, 256)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """The sixteen 6-bit scales of a Q3_K block (12 bytes) -> float32 ``[n, 16]``, minus 32: low nibbles of
    bytes 0-7 (scales 0-7) and their high nibbles (8-15), the top two bits from bytes 8-11 in pairs."""
    p = packed.to(torch.int32)
    low = torch.cat((p[:, 0:8] & 15, p[:, 0:8] >> 4), dim=1)  # [n, 16]
    top = p[:, 8:12]  # byte 8 + i holds the top bits of scales i, i + 4, i + 8, i + 12 at bits 0, 2, 4, 6
    high = torch.stack([(top >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).reshape(-1, 16)
    return (low | (high << 4)).float() - 32


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # hmask[32] (the third bit, inverted: set = 0, clear = -4), qs[64], scales[12], d
    hmask, d = b[:, 0:32], _f16(b, 108)
    scales = _q3_k_scales(b[:, 96:108])
    low = _two_bit_planes(b[:, 32:96]).reshape(-1, 2, 4, 2, 16)  # [n, half, j, s, l]
    bit = (4 * torch.arange(2).view(2, 1) + torch.arange(4).view(1, 4)).to(torch.uint8).view(1, 2, 4, 1, 1)
    high = (hmask.reshape(-1, 1, 1, 2, 16) >> bit) & 1  # bit (4 half + j) of hmask[16 s + l]
    q = low.to(torch.int16) - 4 * (1 - high.to(torch.int16))
    return (d.unsqueeze(-1) * scales.unsqueeze(-1) * q.float().reshape(-1, 16, 16)).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    # 4 chunks of 32 bytes; each chunk's low nibbles are sub-block 2i, its high nibbles sub-block 2i+1.
    q = _nibbles(b[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    return (d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    codes, scales, offsets = _q5_k_affine(b)
    return (codes.float() * scales + offsets).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # [n, half, ql offset 0/32, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)  # [n, half, -, l]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # one per 16 values
    d = _f16(b, 208)
    # Within a half of 128 values, quarter j (32 values) takes nibble j // 2 of ql[l + 32 * (j % 2)]
    # and bits 2j, 2j+1 of qh[l].
    low = torch.stack((ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4), dim=2)
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (qh >> shift) & 3
    q = ((low | (high << 4)).to(torch.int16) - 32).float().reshape(-1, 16, 16)
    return (d.unsqueeze(-1) * scales.unsqueeze(-1) * q).reshape(-1, 256)


# The sixteen values a 4-bit IQ4_NL/IQ4_XS code stands for (ggml's kvalues_iq4nl), before the block's scale.
IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8)


def _iq4_indices(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 16 * m]`` of IQ4 nibbles -> their indices into ``IQ4_VALUES``, uint8 ``[n * m, 32]``: per 16 bytes,
    the low nibbles are values 0-15 and the high nibbles 16-31 (Q4_0's order)."""
    return _nibbles(packed.reshape(-1, 16)).reshape(-1, 32)


def _iq4_values(packed: torch.Tensor) -> torch.Tensor:
    """The int8 levels of IQ4 nibbles (``_iq4_indices`` mapped through ``IQ4_VALUES``)."""
    return IQ4_VALUES[_iq4_indices(packed).long()]


def _iq4_xs_scales(b: torch.Tensor) -> torch.Tensor:
    """The eight 6-bit sub-block scales of IQ4_XS blocks, minus 32, times ``d``: float32 ``[n, 8]``. Sub-block
    ``i`` takes nibble ``i % 2`` of ``scales_l[i // 2]`` and bits ``2i, 2i+1`` of the 16-bit ``scales_h``."""
    high = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # [n, 1]
    low = b[:, 4:8].to(torch.int32)
    nib = torch.stack((low & 15, low >> 4), dim=-1).reshape(-1, 8)
    top = (high >> (2 * torch.arange(8, dtype=torch.int32))) & 3
    return _f16(b, 0) * ((nib | (top << 4)) - 32).float()


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _iq4_values(b[:, 2:18]).float()


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    values = _iq4_values(b[:, 8:136]).reshape(-1, 8, 32).float()
    return (_iq4_xs_scales(b).unsqueeze(-1) * values).reshape(-1, 256)


def iq4_codes(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """An IQ4_NL or IQ4_XS matrix as ``(indices uint8 [N, K] in [0, 15], scales float32 [N, K // 32])``: value =
    ``IQ4_VALUES[index] * scale`` exactly (IQ4_XS's scale of 32 values is ``d * (ls - 32)``)."""
    qtype = T(ggml_type)
    if qtype not in (T.IQ4_NL, T.IQ4_XS):
        raise ValueError(f"ggml_type {qtype.name} has no IQ4 codes; supported: IQ4_NL, IQ4_XS")
    b = _matrix_blocks(raw, qtype, shape)
    n, k = shape
    if qtype == T.IQ4_NL:
        return _iq4_indices(b[:, 2:18]).reshape(n, k), _f16(b, 0).reshape(n, k // 32)
    return _iq4_indices(b[:, 8:136]).reshape(n, k), _iq4_xs_scales(b).reshape(n, k // 32)


def _gguf_py_decoder(qtype: T):
    """A decoder for ``qtype`` by gguf-py's own numpy code (the lattice-based IQ1/IQ2/IQ3 types, the ternary
    TQ types, MXFP4...), or None where the installed gguf-py cannot dequantize it."""
    if not hasattr(gguf_quants, qtype.name):
        return None

    def decode(b: torch.Tensor) -> torch.Tensor:
        with np.errstate(all="ignore"):  # inf/nan scales in a block pass through as they are
            values = gguf_quants.dequantize(b.contiguous().numpy(), qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    return decode


_DECODERS = {
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
_DECODERS.update({t: d for t in T if t not in _DECODERS and t.name not in ("F32", "F16", "BF16", "F64")
                  and t in GGML_QUANT_SIZES and (d := _gguf_py_decoder(t)) is not None})
_PLAIN = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}

SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in (*_PLAIN, *_DECODERS))

# Blocks decoded per step, so the float32 temporaries of a large tensor stay small.
_CHUNK_BLOCKS = 1 << 16


def dequantize(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode the bytes of one GGUF tensor into a `dtype` tensor of `shape` (PyTorch order).

    `raw` is the tensor's uint8 bytes; supported types (`SUPPORTED_TYPES`) are F32, F16, BF16, Q8_0, Q4_0, Q4_1,
    Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL and IQ4_XS (decoded here) and every other block type the installed gguf-py
    dequantizes (IQ1_S..IQ3_S, TQ1_0, TQ2_0, MXFP4, ...). Anything else raises ValueError naming the type.
    """
    try:
        qtype = T(ggml_type)
    except ValueError:
        raise ValueError(f"ggml_type {ggml_type!r} is not a ggml type; supported: {', '.join(SUPPORTED_TYPES)}") from None
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
    raw = raw.reshape(-1)
    n = int(np.prod(shape)) if shape else 1
    if qtype in _PLAIN:
        values = raw.view(_PLAIN[qtype])
        if values.numel() != n:
            raise ValueError(f"raw holds {values.numel()} {qtype.name} values, shape {tuple(shape)} needs {n}")
        return values.reshape(shape).to(dtype)
    if qtype not in _DECODERS:
        raise ValueError(f"ggml_type {qtype.name} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if n % block or raw.numel() != n // block * block_bytes:
        raise ValueError(
            f"raw has {raw.numel()} bytes; shape {tuple(shape)} in {qtype.name} needs "
            f"{n // block * block_bytes} bytes and a multiple of {block} elements"
        )
    blocks = raw.view(-1, block_bytes)
    if qtype == T.Q6_K and (lib := cpu_native.library()) is not None:  # one pass on all threads, the same values
        values = torch.empty(n, dtype=torch.float32)
        lib.nf_dequantize_q6_k(blocks.contiguous().data_ptr(), blocks.shape[0], values.data_ptr())
        return values.reshape(shape).to(dtype)
    out = torch.empty(n, dtype=dtype)
    decode = _DECODERS[qtype]
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        part = blocks[start : start + _CHUNK_BLOCKS]
        out[start * block : (start + part.shape[0]) * block] = decode(part).reshape(-1)
    return out.reshape(shape)


# -- 4-bit blocks kept as codes: w = code * scale + offset per group of 32 ------------------------

INT4_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q4_K")


def _q4_0_affine(b: torch.Tensor):
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]).reshape(-1, 32), d, -8.0 * d


def _q4_1_affine(b: torch.Tensor):
    return _nibbles(b[:, 4:20]).reshape(-1, 32), _f16(b, 0), _f16(b, 2)


def _q4_k_affine(b: torch.Tensor):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    codes = _nibbles(b[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return codes.reshape(-1, 32), (d * sc).reshape(-1, 1), (-dmin * mn).reshape(-1, 1)


def _q5_0_affine(b: torch.Tensor):
    d = _f16(b, 0)
    return _five_bit_codes(b[:, 2:6], b[:, 6:22]), d, -16.0 * d


def _q5_1_affine(b: torch.Tensor):
    return _five_bit_codes(b[:, 4:8], b[:, 8:24]), _f16(b, 0), _f16(b, 2)


def _q5_k_affine(b: torch.Tensor):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    low = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    return (low | (high << 4)).reshape(-1, 32), (d * sc).reshape(-1, 1), (-dmin * mn).reshape(-1, 1)


# Per group of 32 values: (codes, scales, offsets) with value = code * scale + offset, as dequantize computes it.
_AFFINE = {T.Q4_0: _q4_0_affine, T.Q4_1: _q4_1_affine, T.Q4_K: _q4_k_affine}
_AFFINE5 = {T.Q5_0: _q5_0_affine, T.Q5_1: _q5_1_affine, T.Q5_K: _q5_k_affine}


def int4_codes(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes of a Q4_0/Q4_1/Q4_K matrix without dequantizing: ``(codes, scales, offsets)``.

    ``codes`` uint8 ``[N, K]`` in ``[0, 15]``; ``scales`` and ``offsets`` float32 ``[N, K // 32]``;
    the value is ``codes * scales + offsets`` per group of 32 (exactly what ``dequantize`` gives,
    which computes the same products in float32).
    """
    qtype = T(ggml_type)
    if qtype not in _AFFINE:
        raise ValueError(f"ggml_type {qtype.name} has no 4-bit codes; supported: {', '.join(INT4_TYPES)}")
    if len(shape) != 2:
        raise ValueError(f"shape: a matrix [N, K] is needed, got {tuple(shape)}")
    n, k = shape
    blocks = _matrix_blocks(raw, qtype, shape)
    if qtype == T.Q4_K and (lib := cpu_native.library()) is not None:  # one pass on all threads, the same values
        codes = torch.empty((n, k), dtype=torch.uint8)
        scales, offsets = torch.empty((n, k // 32)), torch.empty((n, k // 32))
        lib.nf_q4_k_codes(blocks.contiguous().data_ptr(), blocks.shape[0], codes.data_ptr(), scales.data_ptr(),
                          offsets.data_ptr())
        return codes, scales, offsets
    codes, scales, offsets = _AFFINE[qtype](blocks)
    return codes.reshape(n, k), scales.reshape(n, k // 32), offsets.reshape(n, k // 32)


def _matrix_blocks(raw: np.ndarray | torch.Tensor, qtype: T, shape: tuple[int, int]) -> torch.Tensor:
    """The bytes of an ``[N, K]`` ``qtype`` matrix as ``[blocks, block_bytes]`` uint8 (size checked)."""
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
    n, k = shape
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if k % block or raw.numel() != n * k // block * block_bytes:
        raise ValueError(f"raw has {raw.numel()} bytes; shape {tuple(shape)} in {qtype.name} needs "
                         f"{n * k // block * block_bytes} bytes and rows of a multiple of {block}")
    return raw.reshape(-1).view(-1, block_bytes)


INT5_TYPES: tuple[str, ...] = ("Q5_0", "Q5_1", "Q5_K")


def int5_codes(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes of a Q5_0/Q5_1/Q5_K matrix without dequantizing: ``(codes uint8 [N, K] in [0, 31], scales, offsets
    float32 [N, K // 32])`` with value = ``codes * scales + offsets`` per group of 32 (Q5_0's offset is ``-16 d``;
    Q5_K's scale and offset the products ``d * sc`` and ``-dmin * m``, as ``dequantize`` computes them)."""
    qtype = T(ggml_type)
    if qtype not in _AFFINE5:
        raise ValueError(f"ggml_type {qtype.name} has no 5-bit codes; supported: {', '.join(INT5_TYPES)}")
    n, k = shape
    codes, scales, offsets = _AFFINE5[qtype](_matrix_blocks(raw, qtype, shape))
    return codes.reshape(n, k), scales.reshape(n, k // 32), offsets.reshape(n, k // 32)


def q8_0_codes(raw: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 matrix as ``(codes int8 [N, K], scales float32 [N, K // 32])``: value = code * scale."""
    b = _matrix_blocks(raw, T.Q8_0, shape)
    n, k = shape
    return b[:, 2:34].contiguous().view(torch.int8).reshape(n, k), _f16(b, 0).reshape(n, k // 32)


def q5_0_codes(raw: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q5_0 matrix as 8-bit codes: ``(codes int8 [N, K] in [-16, 15], scales float32 [N, K // 32])``, value =
    code * scale exactly (the native CPU kernels' 8-bit blocks hold it without loss)."""
    b = _matrix_blocks(raw, T.Q5_0, shape)
    n, k = shape
    codes = _five_bit_codes(b[:, 2:6], b[:, 6:22]).to(torch.int8) - 16
    return codes.reshape(n, k), _f16(b, 0).reshape(n, k // 32)
