"""GGUF matrices kept quantized, and the linear layers built from them.

With ``keep_quantized`` the GGUF loader returns Q4_0/Q4_1/Q4_K matrices as ``Int4Codes``, Q8_0
matrices as ``Q8Codes`` (codes plus per-32-value scales, no float copy) and the other quantized types
(Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, the IQ and TQ types, MXFP4) as ``GGUFRows`` (their raw blocks). The model
turns them into ``PackedLinear`` layers (``packed_linear``).

Where ninefold's native CPU kernels build with vector code (AVX-512 VNNI or AVX2: ``ninefold.ops.cpu_native``),
every quantized matrix becomes an ``ops.BlockWeight`` (blocks of 32 values repacked in 16-row groups, one float16
scale per block and an offset for 4 bits) and runs on ``ninefold.ops.linear_blocks`` (activations rounded to int8
per 32 values, as llama.cpp does); the CPU decode step (``llm/models/llama_cpu.py``) then runs whole layers
natively. ``native_matrix`` decides the blocks of a (row-stacked) matrix:

* all parts 4-bit: 4-bit blocks. Q4_0 and Q4_1 scales are float16 already; Q4_K's per-32 scale and offset
  are products (``d * sc``, ``dmin * m``) and are rounded to float16 (relative error at most 2^-11, the
  precision Q4_1 stores them with).
* all parts IQ4_NL/IQ4_XS: 4-bit blocks whose codes index the sixteen IQ4 levels (``ops.BlockWeight(levels=)``):
  IQ4_NL exactly, IQ4_XS with its per-32 scale ``d * (ls - 32)`` rounded to float16 (as Q4_K's).
* all parts affine 4- or 5-bit, one of them 5-bit (Q5_0, Q5_1, Q5_K): 5-bit blocks (``ops.BlockWeight(bits=5)``);
  Q5_0 (offset ``-16 d``) and Q5_1 exactly, Q5_K's products rounded to float16; 4-bit parts keep their codes.
* affine parts followed by others (a Q4_K q and k over a Q6_K v): the affine rows keep 4- or 5-bit blocks and
  the rest take 8-bit ones, in one weight (``ops.BlockWeight.stacked``), when they fill whole 16-row groups.
* otherwise 8-bit blocks: Q8_0 and Q5_0 exactly (Q5_0's codes minus 16); Q4_0 exactly (codes minus 8); IQ4_NL
  and IQ4_XS as their levels (int8 values) with the scales above; the rest (other Q4_1/Q4_K parts stacked with
  8-bit parts, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, the lattice IQ1/IQ2/IQ3 types, TQ1_0/TQ2_0, MXFP4) requantized to
  8 bits per 32 values
  (``requantize_q8``: at most half a step of ``max|w| / 127`` per value, a quarter of a Q6_K step or less).
  This is how a Q4_K_M file (Q4_K beside Q6_K and, for rows that are not a multiple of 256, Q5_0 or Q8_0)
  runs natively.

Otherwise (no compiler, ``NINEFOLD_CPU_NATIVE=0``, other devices) ``GGUFRows`` are dequantized exactly and
the rest run on ``ninefold.ops.linear_int4``:

* 4-bit matrices map exactly onto ``ops.Int4Weight`` (``w = code * scale + offset`` per 32 values).
* A Q8_0 matrix (SmolLM2's tied embedding / lm_head) runs as two 4-bit halves of the same code:
  ``code + 128 = 16 h + l``, so ``x @ w.T = [x, x] @ [W_h, W_l].T`` with ``W_h = 16 d h`` and
  ``W_l = d l - 128 d``: one int4 GEMM over ``2K`` that gives Q8_0's values (up to the rounding of
  the block scales to the activations' dtype). Measured on SmolLM2 (docs/perf/cpu.md) it is faster
  than torch's per-channel int8 kernel and than bf16, and far closer to the exact logits than a
  4-bit requantization.

A ``PackedLinear`` may also hold a dense copy for larger batches (``dense``): torch's int4 kernel wins
for decode batches (fewer bytes to stream) but loses to a dense bf16 GEMM on prefill-sized steps
(~2.5x at 64+ rows). A tied lm_head's dense copy is the embedding table itself (no extra memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninefold import ops
from ninefold.llm.gguf_dequant import INT5_TYPES, IQ4_VALUES, T, dequantize, int5_codes, iq4_codes, q5_0_codes
from ninefold.ops import cpu_native

# Steps with more rows than this use the dense copy when there is one. Measured in the engine on
# the 2-core EPYC (SmolLM2, bf16, 2 threads), where weights stream from memory rather than sit in
# cache: 8 sequences decode at 236-276 tok/s on int4 against 180-186 on dense bf16 (4x the bytes);
# 16 sequences at 270-313 either way; a 512-token prefill is ~2.5x faster dense.
DENSE_MIN_ROWS = 16


@dataclass
class Int4Codes:
    """A 4-bit GGUF matrix: ``codes`` uint8 ``[N, K]``, ``scales``/``offsets`` float32 ``[N, K // 32]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    type_name: str = "Q4"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def map_rows(self, fn) -> Int4Codes:
        """Apply a row permutation ``fn`` (tensor -> tensor, rows first) to every field."""
        return Int4Codes(fn(self.codes), fn(self.scales), fn(self.offsets), self.type_name)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = self.codes.float().reshape(n, k // 32, 32)
        return (q * self.scales[..., None] + self.offsets[..., None]).reshape(n, k).to(dtype)

    def int4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scales, self.offsets

    def fp16_scaled(self) -> Int4Codes:
        """This matrix with its scales and offsets rounded to float16 values (unchanged for Q4_0/Q4_1)."""
        return Int4Codes(self.codes, _fp16_values(self.scales, self.type_name),
                         _fp16_values(self.offsets, self.type_name), self.type_name)

    def to_q8(self) -> Q8Codes:
        """8-bit codes of this matrix: exact for Q4_0 (offset -8 * scale), requantized otherwise."""
        if torch.equal(self.offsets, -8 * self.scales):
            return Q8Codes(self.codes.to(torch.int8) - 8, self.scales, self.type_name)
        return requantize_q8(self.dequantize(), self.type_name)


@dataclass
class Q8Codes:
    """A Q8_0 GGUF matrix: ``codes`` int8 ``[N, K]``, ``scales`` float32 ``[N, K // 32]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    type_name: str = "Q8_0"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def map_rows(self, fn) -> Q8Codes:
        return Q8Codes(fn(self.codes), fn(self.scales), self.type_name)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        return (self.codes.float().reshape(n, k // 32, 32) * self.scales[..., None]).reshape(n, k).to(dtype)

    def int4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The two 4-bit halves side by side: codes ``[N, 2K]`` = ``[h, l]``, scales/offsets ``[N, 2K/32]``."""
        u = self.codes.to(torch.int16) + 128
        d = self.scales
        codes = torch.cat((u >> 4, u & 15), dim=1).to(torch.uint8)
        return codes, torch.cat((16 * d, d), dim=1), torch.cat((torch.zeros_like(d), -128 * d), dim=1)


    def to_q8(self) -> Q8Codes:
        return self


@dataclass
class GGUFRows:
    """A GGUF matrix of a type the packed layers do not take as it is (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, IQ and TQ
    types, MXFP4): its raw blocks, one row of ``row_bytes`` per weight row (``raw`` uint8 ``[N, row_bytes]``),
    decoded on demand."""

    raw: torch.Tensor
    ggml_type: int
    k: int
    dense: torch.Tensor | None = None  # its float32 values, when a caller decoded them already (``with_dense``)

    def with_dense(self, dense: torch.Tensor) -> GGUFRows:
        """This matrix holding its float32 values ``dense`` (as ``dequantize()`` gives them), so a second use
        (a tied embedding's output layer) does not decode the blocks again."""
        return GGUFRows(self.raw, self.ggml_type, self.k, dense)

    @property
    def type_name(self) -> str:
        return T(self.ggml_type).name

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.k

    def map_rows(self, fn) -> GGUFRows:
        return GGUFRows(fn(self.raw), self.ggml_type, self.k, None if self.dense is None else fn(self.dense))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.dense is not None:
            return self.dense.to(dtype)
        return dequantize(self.raw.reshape(-1), self.ggml_type, self.shape, dtype)

    def to_q8(self) -> Q8Codes:
        """8-bit codes of this matrix: exact for Q5_0 and IQ4_NL, IQ4_XS's scales rounded to float16, requantized
        (``requantize_q8``) for the others."""
        if self.ggml_type == T.Q5_0:
            return Q8Codes(*q5_0_codes(self.raw.reshape(-1), self.shape), self.type_name)
        if self.ggml_type in (T.IQ4_NL, T.IQ4_XS):
            levels = LevelCodes.of(self)
            return Q8Codes(IQ4_VALUES[levels.codes.long()], levels.scales, self.type_name)
        lib = cpu_native.library() if self.dense is None and self.raw.device.type == "cpu" else None
        if self.ggml_type == T.Q6_K and lib is not None:  # block by block: no float copy of the whole matrix
            n, k = self.shape
            codes, scales = torch.empty((n, k), dtype=torch.int8), torch.empty((n, k // 32))
            lib.nf_requantize_q6_k(self.raw.contiguous().data_ptr(), n * k // 256, scales.data_ptr(), codes.data_ptr())
            _fp16_values(scales, self.type_name)  # only checks the range
            return Q8Codes(codes, scales, self.type_name)
        return requantize_q8(self.dequantize(), self.type_name)


@dataclass
class LevelCodes:
    """IQ4_NL/IQ4_XS rows as ``codes`` uint8 ``[N, K]`` in ``[0, 15]`` indexing ``IQ4_VALUES`` and float16-exact
    ``scales`` float32 ``[N, K // 32]``: value = ``IQ4_VALUES[code] * scale``."""

    codes: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def of(cls, rows: GGUFRows) -> LevelCodes:
        """The levels of IQ4_NL/IQ4_XS ``rows`` (IQ4_XS's scales rounded to float16)."""
        indices, scales = iq4_codes(rows.raw.reshape(-1), rows.ggml_type, rows.shape)
        return cls(indices, _fp16_values(scales, rows.type_name))


@dataclass
class Int5Codes:
    """5-bit affine rows for the native kernels: ``codes`` uint8 ``[N, K]`` in ``[0, 31]``, float16-exact ``scales``
    and ``offsets`` float32 ``[N, K // 32]``: value = ``code * scale + offset``."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def of(cls, part: Int4Codes | GGUFRows) -> Int5Codes:
        """Q5_0/Q5_1/Q5_K rows (Q5_K's per-32 products rounded to float16, as Q4_K's), or 4-bit rows unchanged (a
        4-bit code is a 5-bit code)."""
        if type(part) is Int4Codes:
            four = part.fp16_scaled()
            return cls(four.codes, four.scales, four.offsets)
        codes, scales, offsets = int5_codes(part.raw.reshape(-1), part.ggml_type, part.shape)
        return cls(codes, _fp16_values(scales, part.type_name), _fp16_values(offsets, part.type_name))


def _iq4(part) -> bool:
    return type(part) is GGUFRows and part.ggml_type in (T.IQ4_NL, T.IQ4_XS)


QUANTIZED = (Int4Codes, Q8Codes, GGUFRows)
SMALL_MATRIX = 1 << 22  # weights; smaller matrices are repacked on one thread
STACK_ROWS = 16  # a 4-bit head over an 8-bit tail fills whole row groups of the native layout


class QuantizedEmbedding:
    """An embedding table kept in its GGUF form (``Int4Codes``, ``Q8Codes`` or ``GGUFRows``): calling it with token
    ids decodes just those rows, to exactly the values the dense table would hold (Llama-3.2-1B's Q6_K table takes
    215 MB instead of 1.05 GB as float32). ``shape`` is the table's ``[vocab, hidden]``."""

    def __init__(self, table: Int4Codes | Q8Codes | GGUFRows, dtype: torch.dtype):
        if type(table) is GGUFRows:
            table = GGUFRows(table.raw, table.ggml_type, table.k)  # without a decoded copy
        self.table, self.dtype, self.shape = table, dtype, tuple(table.shape)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (any shape), ``[*ids.shape, hidden]`` in ``dtype``."""
        flat = ids.reshape(-1).long()
        rows = self.table.map_rows(lambda t: t.index_select(0, flat)).dequantize(self.dtype)
        return rows.reshape(*ids.shape, self.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in vars(self.table).values() if isinstance(t, torch.Tensor))


def embed_rows(table: torch.Tensor | QuantizedEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """The embedding rows of ``ids`` from a dense table (``ops.embedding``) or a ``QuantizedEmbedding``."""
    return table(ids) if isinstance(table, QuantizedEmbedding) else ops.embedding(ids, table)


def requantize_q8(weight: torch.Tensor, type_name: str = "Q8") -> Q8Codes:
    """``weight`` ``[N, K]`` (K a multiple of 32) as 8-bit codes with one float16-exact scale per 32 values:
    scale ``max|w| / 127`` rounded to float16, code ``round(w / scale)`` in ``[-127, 127]``."""
    n, k = weight.shape
    blocks = weight.float().contiguous().reshape(n, k // 32, 32)
    lib = cpu_native.library() if weight.device.type == "cpu" else None
    if lib is not None:  # one pass on all threads
        codes, scales = torch.empty((n, k), dtype=torch.int8), torch.empty((n, k // 32), dtype=torch.float32)
        lib.nf_requantize_q8(blocks.data_ptr(), n, k, scales.data_ptr(), codes.data_ptr())
        _fp16_values(scales, type_name)  # only checks the range
        return Q8Codes(codes, scales, type_name)
    scales = _fp16_values(blocks.abs().amax(-1) / 127, type_name)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return Q8Codes(codes.reshape(n, k), scales, type_name)


def native_matrix(parts: list) -> Int4Codes | Int5Codes | LevelCodes | Q8Codes | tuple:
    """``parts`` stacked by rows in a form ``ops.BlockWeight`` holds: 4-bit when every part is 4-bit (affine, or all
    IQ4 levels); 5-bit when every part is affine 4- or 5-bit (Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K) and one is 5-bit;
    affine parts followed by 8-bit ones as a (4- or 5-bit head, 8-bit tail) pair when the head fills whole 16-row
    groups (a Q4_K q and k over a Q6_K v: ``ops.BlockWeight.stacked``); else 8-bit (see the module docstring for
    which conversions are exact)."""
    if all(_iq4(p) for p in parts):
        return cat_rows([LevelCodes.of(p) for p in parts])
    bits = [_affine_bits(p) for p in parts]
    lead = next((i for i, b in enumerate(bits) if b is None), len(parts))
    if lead == len(parts):
        return _affine_rows(parts, max(bits))
    if (lead and all(b is None for b in bits[lead:])
            and sum(p.shape[0] for p in parts[:lead]) % STACK_ROWS == 0):
        return _affine_rows(parts[:lead], max(bits[:lead])), cat_rows([p.to_q8() for p in parts[lead:]])
    return cat_rows([p.to_q8() for p in parts])


def _affine_bits(part) -> int | None:
    """4 or 5 for rows the affine blocks hold (``Int4Codes``; Q5_0/Q5_1/Q5_K ``GGUFRows``), else None."""
    if type(part) is Int4Codes:
        return 4
    return 5 if type(part) is GGUFRows and part.type_name in INT5_TYPES else None


def _affine_rows(parts: list, bits: int) -> Int4Codes | Int5Codes:
    """Affine ``parts`` stacked as ``bits``-bit rows with float16-exact scales and offsets."""
    return cat_rows([p.fp16_scaled() for p in parts] if bits == 4 else [Int5Codes.of(p) for p in parts])


def _fp16_values(values: torch.Tensor, type_name: str) -> torch.Tensor:
    """``values`` rounded to float16 (kept as float32); a value beyond float16's range is an error."""
    rounded = values.to(torch.float16).float()
    if not torch.isfinite(rounded).all():
        raise ValueError(f"a {type_name} matrix has block scales beyond float16's range (max "
                         f"{values.abs().max().item():.3g}); load it with quantization='none'")
    return rounded


def cat_rows(parts: list) -> Int4Codes | Int5Codes | LevelCodes | Q8Codes | None:
    """Stack matrices by rows when they are all of one kind (all 4-bit, all 5-bit, all IQ4 levels or all 8-bit);
    else None. A 4-bit stack keeps the first part's type name; an 8-bit one is named Q8_0."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind not in (Int4Codes, Int5Codes, LevelCodes, Q8Codes):
        return None

    def cat(field: str) -> torch.Tensor:  # (one part: its own tensors, not a copy)
        return torch.cat([getattr(p, field) for p in parts]) if len(parts) > 1 else getattr(parts[0], field)

    if kind is Int4Codes:
        return Int4Codes(cat("codes"), cat("scales"), cat("offsets"), parts[0].type_name)
    if kind is Int5Codes:
        return Int5Codes(cat("codes"), cat("scales"), cat("offsets"))
    return kind(cat("codes"), cat("scales"))


class PackedLinear:
    """``x @ W.T`` for a GGUF-quantized ``W``: ``ops.linear_blocks`` on a ``BlockWeight`` (``blocks``)
    or ``ops.linear_int4`` on an ``Int4Weight`` (``weight``), or a dense copy for steps of more than
    ``DENSE_MIN_ROWS`` rows when one is kept."""

    def __init__(self, weight: ops.Int4Weight | None, n: int, k: int, *, doubled: bool,
                 dense: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None,
                 blocks: ops.BlockWeight | None = None):
        self.weight = weight
        self.blocks = blocks
        self.shape = (n, k)
        self.doubled = doubled  # Q8_0 as two 4-bit halves: the input is [x, x]
        self.dense = dense
        # The activations' dtype for the packed GEMMs (bfloat16 on CPUs, the only fast case of torch's
        # int4 kernel); inputs of another dtype are cast to it and the result back, as llama.cpp
        # quantizes activations to 8 bits for its 4-bit dot products. None: x's own dtype. The dense
        # copy (prefill) runs in the model's dtype.
        self.compute_dtype = compute_dtype
        self.dense_shared = False  # the dense copy belongs to another owner (a tied embedding): not counted
        self._impls: dict = {}

    @property
    def nbytes(self) -> int:
        dense = 0 if self.dense is None or self.dense_shared else self.dense.numel() * self.dense.element_size()
        return (self.blocks or self.weight).nbytes + dense

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > DENSE_MIN_ROWS:
            return ops.linear(x, self.dense, bias)
        if self.blocks is not None:
            return self._native(x, bias)
        cd = self.compute_dtype
        if cd is not None and x.dtype != cd:
            return self._packed(x.to(cd), None if bias is None else bias.to(cd)).to(x.dtype)
        return self._packed(x, bias)

    def _native(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        key = (x.dtype, x.dim(), bias is None)
        fn = self._impls.get(key)
        if fn is None:
            fn = self._impls[key] = ops.implementation("linear_blocks", x, self.blocks, bias)
        return fn(x, self.blocks, bias)

    def _packed(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.doubled:
            x = torch.cat((x, x), dim=-1)
        key = (x.dtype, x.dim(), bias is None)
        fn = self._impls.get(key)
        if fn is None:  # validated and chosen once per dtype and rank; then called directly
            fn = self._impls[key] = ops.implementation("linear_int4", x, self.weight, bias)
        return fn(x, self.weight, bias)


def packed_linear(parts: list, device: torch.device, dtype: torch.dtype, *, keep_dense: bool,
                  compute_dtype: torch.dtype | None = None, blocks_only: bool = False,
                  fine_activations: bool | None = None) -> PackedLinear | None:
    """A ``PackedLinear`` of ``parts`` stacked by rows, or None where it cannot hold them (the caller then
    dequantizes). On CPUs where the native kernels build with vector code every quantized matrix is packed
    as ``ops.BlockWeight`` (``native_matrix``); elsewhere only matrices all of one exact kind (all 4-bit or
    all Q8_0) are, on ``ops.linear_int4``. ``keep_dense`` also keeps a ``dtype`` copy, dequantized exactly
    (the model's dtype: a float32 model prefills with exact float32 weights). ``blocks_only``: None instead of
    the ``linear_int4`` form (CPUs whose torch int4 kernel would run float32 activations on its slow path).
    ``fine_activations``: the native blocks round activations in two terms (``ops.BlockWeight``'s
    ``activation_terms=2``); default: in a float32 model."""
    native = device.type == "cpu" and cpu_native.fast()  # the portable C loops are slower than torch's int4 kernel
    whole = None if native else cat_rows(parts)
    if not native and (whole is None or blocks_only):
        return None
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    dense = None
    if keep_dense:
        dense = torch.cat([p.dequantize(dtype) for p in parts]) if len(parts) > 1 else parts[0].dequantize(dtype)
        dense = dense.to(device)
    if native:
        # In a float32 model the packed calls (prefill steps of up to DENSE_MIN_ROWS rows, the lm_head) round
        # activations twice as finely (ops.BlockWeight's activation_terms=2, ~1e-4 relative): logits pick
        # tokens, and the first token of a chat answer is often a near tie (test_chat's "What is the capital
        # of France?"). The native decode step rounds once per layer matrix, as llama.cpp does.
        fine = dtype == torch.float32 if fine_activations is None else fine_activations
        terms = 2 if fine else 1
        blocks = _blocks_by_part(parts, terms) or _block_weight(native_matrix(parts), terms)
        return PackedLinear(None, n, k, doubled=False, dense=dense, compute_dtype=compute_dtype, blocks=blocks)
    codes, scales, offsets = whole.int4_parts()
    weight = ops.Int4Weight(codes.to(device), scales.to(device), offsets.to(device), 32)
    return PackedLinear(weight, n, k, doubled=isinstance(whole, Q8Codes), dense=dense, compute_dtype=compute_dtype)


def _blocks_by_part(parts: list, terms: int) -> ops.BlockWeight | None:
    """Parts of one GGUF type whose rows fill whole 16-row groups (q/k/v, gate/up), each packed alone and their
    records joined: the bytes ``native_matrix`` would pack from the stacked codes, without copying the unpacked
    codes into one matrix first. None where that does not hold (mixed types decide their blocks together)."""
    kinds = {(type(p), getattr(p, "type_name", None)) for p in parts}
    if len(parts) < 2 or len(kinds) != 1 or any(p.shape[0] % STACK_ROWS for p in parts[:-1]):
        return None
    return ops.BlockWeight.joined([_block_weight(native_matrix([p]), terms) for p in parts])


def _block_weight(whole: Int4Codes | Int5Codes | LevelCodes | Q8Codes | tuple, terms: int) -> ops.BlockWeight:
    """The native kernels' form of ``whole`` (whose scales and offsets are float16 values; a pair is stacked)."""
    if isinstance(whole, tuple):
        return ops.BlockWeight.stacked(*(_block_weight(part, terms) for part in whole))
    # A dozen copies per matrix: for a small one, one thread takes as long as all and a core taken by another
    # process does not stall each of them at an OpenMP barrier; a large one (a 16384 x 2048 gate/up) packs
    # twice as fast on two threads.
    threads = torch.get_num_threads()
    if whole.codes.numel() < SMALL_MATRIX:
        torch.set_num_threads(1)
    try:
        if isinstance(whole, Q8Codes):
            return ops.BlockWeight(whole.codes, whole.scales, None, bits=8, activation_terms=terms)
        if isinstance(whole, LevelCodes):
            return ops.BlockWeight(whole.codes, whole.scales, None, bits=4, activation_terms=terms, levels=IQ4_VALUES)
        if isinstance(whole, Int5Codes):
            return ops.BlockWeight(whole.codes, whole.scales, whole.offsets, bits=5, activation_terms=terms)
        return ops.BlockWeight(whole.codes, whole.scales, whole.offsets, bits=4, activation_terms=terms)
    finally:
        torch.set_num_threads(threads)
