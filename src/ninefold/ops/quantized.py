"""4-bit weights: ``Int4Weight`` and ``linear_int4(x, weight, bias=None)``.

An ``Int4Weight`` is an ``[N, K]`` matrix stored as 4-bit codes ``q`` in ``[0, 15]`` with one scale
and one offset per group of ``group_size`` consecutive values of a row:
``w[n, k] = q[n, k] * scales[n, g] + offsets[n, g]`` with ``g = k // group_size``. GGUF's
Q4_0 (offset ``-8 d``), Q4_1 (offset ``m``) and Q4_K (per 32-value sub-block) are all of this form.

On CPUs the codes are kept in the layout of torch's int4 GEMM kernel
(``torch._weight_int4pack_mm_for_cpu``, which computes ``(q - 8) * s + z`` per group, so
``s = scale`` and ``z = offset + 8 scale``), rows padded to a multiple of 16 as it requires.
Elsewhere they stay as plain nibbles and the generic implementation dequantizes per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninefold.ops import spec
from ninefold.ops.dispatch import Operator
from ninefold.ops.registry import register

GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU kernel accepts
_ROW_MULTIPLE = 16  # the CPU kernel packs rows in tiles of 16


def _cpu_kernel_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


class Int4Weight:
    """A ``[N, K]`` weight as 4-bit codes with a scale and an offset per ``group_size`` values.

    Build it with ``Int4Weight(codes, scales, offsets, group_size)``: ``codes`` integer
    ``[N, K]`` with values in ``[0, 15]``, ``scales`` and ``offsets`` floating ``[N, K // group_size]``
    (``w = codes * scales + offsets`` per group). ``group_size`` is one of 32, 64, 128, 256 and
    divides ``K``. The tensors' device is the weight's device.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int):
        spec.tensor("Int4Weight", "codes", codes, ndim=2)
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise TypeError(f"Int4Weight: codes must be an integer tensor, got {spec.dtype_name(codes.dtype)}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
            raise ValueError(f"Int4Weight: group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        n, k = codes.shape
        if k % group_size or k == 0:
            raise ValueError(f"Int4Weight: codes has K = {k} columns, which must be a positive multiple of "
                             f"group_size {group_size}")
        for name, t in (("scales", scales), ("offsets", offsets)):
            spec.tensor("Int4Weight", name, t, ndim=2)
            spec.floating("Int4Weight", name, t)
            spec.shape("Int4Weight", name, t, (n, k // group_size), " (one per group of each row)")
            spec.same_device("Int4Weight", "codes", codes, **{name: t})
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
            raise ValueError(f"Int4Weight: codes must lie in [0, 15], got values from {int(codes.min())} "
                             f"to {int(codes.max())}")
        self.shape = (n, k)
        self.group_size = group_size
        self.device = codes.device
        scales, offsets = scales.float(), offsets.float()
        self.cpu_kernel = self.device.type == "cpu" and _cpu_kernel_available()
        if self.cpu_kernel:
            rows = -(-n // _ROW_MULTIPLE) * _ROW_MULTIPLE
            padded = torch.zeros((rows, k), dtype=torch.int32)
            padded[:n] = codes
            self.packed = torch._convert_weight_to_int4pack_for_cpu(padded, 1)
            sz = torch.zeros((k // group_size, rows, 2), dtype=torch.float32)
            sz[:, :n, 0] = scales.T
            sz[:, :n, 1] = (offsets + 8 * scales).T
        else:
            c = codes.to(torch.uint8)
            self.packed = c[:, 0::2] | (c[:, 1::2] << 4)  # low nibble: even column
            sz = torch.stack((scales, offsets + 8 * scales), dim=-1).transpose(0, 1)
        # torch's layout [K/G, N(padded), 2]: (scale, zero) with w = (q - 8) * scale + zero
        self.scales_and_zeros = sz.contiguous()
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {torch.float32: self.scales_and_zeros}

    def scales_and_zeros_as(self, dtype: torch.dtype) -> torch.Tensor:
        """``scales_and_zeros`` in ``dtype`` (the CPU kernel wants the activations' dtype); cached."""
        sz = self._by_dtype.get(dtype)
        if sz is None:
            sz = self._by_dtype[dtype] = self.scales_and_zeros.to(dtype)
        return sz

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes plus float32 scales and zeros (other dtypes' copies excluded)."""
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 4

    def codes(self) -> torch.Tensor:
        """The codes ``[N, K]`` as uint8 in ``[0, 15]``."""
        n, k = self.shape
        if not self.cpu_kernel:
            p = self.packed
            return torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(n, k)
        # The CPU layout is the kernel's own: read it back through the kernel with an identity input
        # (scale 1, zero 8 makes each output the code itself, exactly).
        rows = self.packed.shape[0]
        ones = torch.zeros((k // self.group_size, rows, 2), dtype=torch.float32)
        ones[..., 0] = 1
        ones[..., 1] = 8
        eye = torch.eye(k, dtype=torch.float32)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, ones)[:, :n].T.round().to(torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` matrix in ``dtype`` (computed in float32 from the float32 scales and zeros)."""
        n, k = self.shape
        g = self.group_size
        sz = self.scales_and_zeros[:, :n].transpose(0, 1)  # [N, K/G, 2]
        q = self.codes().to(device=sz.device, dtype=torch.float32).reshape(n, k // g, g)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k).to(dtype)

    def __repr__(self) -> str:
        return f"Int4Weight(shape={self.shape}, group_size={self.group_size}, device={self.device})"


def _check_quantized_linear(op: str, cls: type, x, weight, bias) -> tuple[int, int]:
    """Validate ``op(x, weight, bias)`` for a quantized weight class ``cls``; returns ``(N, K)``."""
    spec.tensor(op, "x", x, min_ndim=1)
    spec.floating(op, "x", x)
    if not isinstance(weight, cls):
        raise TypeError(f"{op}: weight must be an ninefold.ops.{cls.__name__}, got {type(weight).__name__}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise spec.OpError(f"{op}: x's last dimension must be weight's K = {k}, got shape {tuple(x.shape)}")
    if x.device != weight.device:
        raise spec.OpError(f"{op}: weight is on {weight.device} but x is on {x.device}; move them to one device")
    if bias is not None:
        spec.tensor(op, "bias", bias)
        spec.shape(op, "bias", bias, (n,), " (weight's N)")
        spec.same_device(op, "x", x, bias=bias)
        spec.same_dtype(op, "x", x, bias=bias)
    return n, k


def _linear_int4_key(x, weight, bias=None):
    n, k = _check_quantized_linear("linear_int4", Int4Weight, x, weight, bias)
    m = x.numel() // max(k, 1)
    return x.device, x.dtype, (spec.pow2(m), n, k), bias is not None


def linear_int4(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a 4-bit ``Int4Weight`` ``[N, K]``: x ``[..., K]`` -> ``[..., N]``.

    x is float16, bfloat16 or float32 (any layout); the result has x's dtype. bias ``[N]`` has
    x's dtype. Group scales and zeros are applied in x's dtype on CPUs (as torch's kernel does).
    """
    return _LINEAR_INT4.call(x, weight, bias)


_LINEAR_INT4 = Operator("linear_int4", linear_int4, _linear_int4_key)


def _cpu_packed(x, weight, bias):
    return None if weight.cpu_kernel else "the weight was not packed for torch's CPU int4 kernel"


@register("linear_int4", "vendor", devices=("cpu",), supports=_cpu_packed, priority={"cpu": 10})
def _linear_int4_cpu(x, weight, bias):
    k = weight.shape[1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch._weight_int4pack_mm_for_cpu(x2, weight.packed, weight.group_size, weight.scales_and_zeros_as(x.dtype))
    n = weight.shape[0]
    if out.shape[1] != n:
        out = out[:, :n]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


@register("linear_int4", "dequantize", devices=("cpu", "cuda", "mps", "xpu"))
def _linear_int4_dequantize(x, weight, bias):
    """Any device: dequantize to x's dtype, then a dense matmul (slow, for devices without a kernel)."""
    return F.linear(x, weight.dequantize(x.dtype), bias)


# -- GGUF-style blocks with int8 activations (ninefold's native CPU kernels) ----------------------

BLOCK = 32
_GROUP = 16  # rows per group in the native layout


def _fp16_exact(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.float().half().float(), t.float()))


class BlockWeight:
    """A ``[N, K]`` weight in blocks of 32 columns with an fp16 scale and offset per block, in the
    layout of the native CPU kernels (``ninefold/ops/cpu_native/nf_cpu.h``: 16-row groups, codes
    interleaved so one vector instruction covers 16 (AVX-512 VNNI) or 8 (AVX2) rows, ~0.625 bytes per value at 4 bits, 1.06 at 8). GGUF's Q4_0, Q4_1
    and Q8_0 map onto it exactly.

    ``BlockWeight(codes, scales, offsets, bits=4)``: ``codes`` integer ``[N, K]`` in ``[0, 15]``,
    ``w = codes * scales + offsets`` per block (``scales``/``offsets`` ``[N, K // 32]``); ``bits=5``: the same
    with codes in ``[0, 31]`` (GGUF's Q5_0/Q5_1/Q5_K; 0.75 bytes per value).
    ``BlockWeight(codes, scales, None, bits=8)``: ``codes`` in ``[-128, 127]``, ``w = codes * scales``.
    ``BlockWeight(codes, scales, None, bits=4, levels=table)``: 4-bit ``codes`` index ``table`` (16 int8 values,
    GGUF's IQ4_NL/IQ4_XS levels), ``w = table[codes] * scales``: 4-bit storage, 8-bit arithmetic.
    ``K`` is a positive multiple of 32; the scales and offsets must be exact in fp16 (as GGUF stores
    them; ``BlockWeight.fits`` says whether they are). CPU only.

    ``activation_terms`` (1 or 2) is how finely ``linear_blocks`` rounds the activations it multiplies
    with this weight: 1, int8 per 32 values (relative error ~1/254 of each block's largest value);
    2, that plus the int8 rounding of the remainder (~1/64000), for a layer whose outputs decide
    tokens directly (an lm_head in a float32 model) at twice the arithmetic.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None, bits: int = 4,
                 activation_terms: int = 1, levels: torch.Tensor | None = None):
        spec.tensor("BlockWeight", "codes", codes, ndim=2)
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise TypeError(f"BlockWeight: codes must be an integer tensor, got {spec.dtype_name(codes.dtype)}")
        if bits not in (4, 5, 8) or isinstance(bits, bool):
            raise ValueError(f"BlockWeight: bits must be 4, 5 or 8, got {bits!r}")
        if activation_terms not in (1, 2) or isinstance(activation_terms, bool):
            raise ValueError(f"BlockWeight: activation_terms must be 1 or 2, got {activation_terms!r}")
        if levels is not None:
            spec.tensor("BlockWeight", "levels", levels, ndim=1)
            if levels.dtype != torch.int8 or levels.numel() != 16 or bits != 4:
                raise ValueError(f"BlockWeight: levels must be 16 int8 values with bits=4, got {levels.numel()} "
                                 f"{spec.dtype_name(levels.dtype)} values with bits={bits!r}")
            if offsets is not None:
                raise ValueError("BlockWeight: offsets are not accepted with levels (w = levels[code] * scale)")
        elif (offsets is None) != (bits == 8):
            raise ValueError(f"BlockWeight: offsets are required with bits=4 or 5 and not accepted with bits=8, got "
                             f"bits={bits} and {'no ' if offsets is None else ''}offsets")
        if codes.device.type != "cpu":
            raise ValueError(f"BlockWeight: the weight must be on the CPU, got {codes.device}")
        n, k = codes.shape
        if k % BLOCK or k == 0 or n == 0:
            raise ValueError(f"BlockWeight: codes has shape {(n, k)}; K must be a positive multiple of {BLOCK}, N > 0")
        lo, hi = {4: (0, 15), 5: (0, 31), 8: (-128, 127)}[bits]
        if int(codes.min()) < lo or int(codes.max()) > hi:
            raise ValueError(f"BlockWeight: {bits}-bit codes must lie in [{lo}, {hi}], got values from "
                             f"{int(codes.min())} to {int(codes.max())}")
        parts = (("scales", scales),) + ((("offsets", offsets),) if offsets is not None else ())
        for name, t in parts:
            spec.tensor("BlockWeight", name, t, ndim=2)
            spec.floating("BlockWeight", name, t)
            spec.shape("BlockWeight", name, t, (n, k // BLOCK), " (one per block of 32 values of each row)")
            if not _fp16_exact(t):
                raise ValueError(f"BlockWeight: {name} must be exactly representable in float16 (GGUF's Q4_0/Q4_1/"
                                 "Q8_0 scales are); requantize, or use Int4Weight")
        self.shape = (n, k)
        self.bits = bits
        self.lead = 0  # leading rows held in 4- or 5-bit records ahead of the rest (``stacked``)
        self.lead_bits = 4
        self.levels = None if levels is None else levels.contiguous().clone()
        self.device = codes.device
        self.data = _pack_blocks(codes, scales, offsets, bits, levels)
        self.activation_terms = activation_terms
        self._mat = None

    @classmethod
    def stacked(cls, head: BlockWeight, tail: BlockWeight) -> BlockWeight:
        """``head`` (affine 4- or 5-bit, rows a multiple of 16) over ``tail`` (8-bit) as one ``[N_head + N_tail, K]``
        weight: each keeps its own records (a Q4_K q/k beside a Q6_K v stays 4-bit), the kernels pick per 16-row
        group."""
        if head.bits not in (4, 5) or tail.bits != 8 or head.lead or tail.lead or head.levels is not None:
            raise ValueError(f"BlockWeight.stacked: head must be a plain 4- or 5-bit weight and tail a plain 8-bit "
                             f"one, got {head!r} and {tail!r}")
        if head.shape[0] % _GROUP or head.shape[1] != tail.shape[1] or head.activation_terms != tail.activation_terms:
            raise ValueError(f"BlockWeight.stacked: head rows must be a multiple of {_GROUP} and both must share K and "
                             f"activation_terms, got {head!r} (terms {head.activation_terms}) and {tail!r} "
                             f"(terms {tail.activation_terms})")
        return cls._of_records(torch.cat((head.data, tail.data)), (head.shape[0] + tail.shape[0], head.shape[1]), 8,
                               head.shape[0], head.activation_terms, head.bits)

    @classmethod
    def joined(cls, weights: list[BlockWeight]) -> BlockWeight:
        """``weights`` stacked by rows as one: their records joined, which equals packing the stacked codes when
        every weight but the last fills whole 16-row groups. All must be plain weights of one kind (bits, levels,
        activation_terms) and K."""
        first = weights[0]
        same = all(w.bits == first.bits and w.shape[1] == first.shape[1] and not w.lead
                   and w.activation_terms == first.activation_terms
                   and (w.levels is None) == (first.levels is None)
                   and (w.levels is None or torch.equal(w.levels, first.levels)) for w in weights)
        if not same or any(w.shape[0] % _GROUP for w in weights[:-1]):
            raise ValueError(f"BlockWeight.joined: expected plain weights of one kind and K whose rows (all but the "
                             f"last) are multiples of {_GROUP}, got {weights!r}")
        out = cls._of_records(torch.cat([w.data for w in weights]), (sum(w.shape[0] for w in weights), first.shape[1]),
                              first.bits, 0, first.activation_terms)
        out.levels = first.levels
        return out

    @classmethod
    def _of_records(cls, data: torch.Tensor, shape: tuple[int, int], bits: int, lead: int, terms: int,
                    lead_bits: int = 4) -> BlockWeight:
        """A weight over records packed already (``data``), checked by whoever packed them."""
        out = cls.__new__(cls)
        out.shape, out.bits, out.lead, out.device, out.data = shape, bits, lead, data.device, data
        out.activation_terms, out._mat, out.levels, out.lead_bits = terms, None, None, lead_bits
        return out

    @staticmethod
    def fits(scales: torch.Tensor, offsets: torch.Tensor | None = None) -> bool:
        """Whether ``scales`` (and ``offsets``) are exact in float16, as this layout stores them."""
        return _fp16_exact(scales) and (offsets is None or _fp16_exact(offsets))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def _records(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes [N, K] uint8 as stored, d [N, K/32] float32, m [N, K/32] float32 or None) of a plain weight."""
        if self.lead:
            raise ValueError("BlockWeight._records: a stacked weight has two kinds of records; see parts()")
        n, k = self.shape
        g, b = -(-n // _GROUP), k // BLOCK
        rec = self.data.view(g, b, _record_bytes(self.bits, self.levels))
        if self.bits in (4, 5):
            byte = rec[..., :256].reshape(g, b, 4, _GROUP, 4)  # (g, b, p, r, j)
            c = torch.stack((byte & 15, byte >> 4), dim=-1)  # (g, b, p, r, j, half)
            codes = c.permute(0, 3, 1, 5, 2, 4).reshape(g * _GROUP, k)  # (g, r, b, half, p, j)
            at = 256
            if self.bits == 5:  # bit s of plane byte (r, j): the fifth bit of column 4 s + j
                plane = rec[..., 256:320].reshape(g, b, 1, _GROUP, 4)  # (g, b, -, r, j)
                fifth = (plane >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1, 1)) & 1  # (g, b, s, r, j)
                codes = codes | (fifth.permute(0, 3, 1, 2, 4).reshape(g * _GROUP, k) << 4)
                at = 320
            d = rec[..., at:at + 32].contiguous().view(torch.float16)
            m = None if self.levels is not None else rec[..., at + 32:at + 64].contiguous().view(torch.float16)
        else:
            codes = rec[..., :512].reshape(g, b, 8, _GROUP, 4).permute(0, 3, 1, 2, 4).reshape(g * _GROUP, k)
            d = rec[..., 512:544].contiguous().view(torch.float16)
            m = None

        def rows(t):  # (g, b, r) -> [N, b]
            return t.permute(0, 2, 1).reshape(g * _GROUP, b)[:n].float()

        return codes[:n], rows(d), None if m is None else rows(m)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` matrix in ``dtype`` (computed in float32)."""
        return self.dequantize64().to(dtype)

    def parts(self) -> list[BlockWeight]:
        """The plain weights this one holds: itself, or a stacked weight's 4- or 5-bit head and 8-bit tail (views)."""
        if not self.lead:
            return [self]
        k = self.shape[1]
        split = self.lead // _GROUP * (k // BLOCK) * _record_bytes(self.lead_bits, None)
        return [self._of_records(self.data[:split], (self.lead, k), self.lead_bits, 0, self.activation_terms),
                self._of_records(self.data[split:], (self.shape[0] - self.lead, k), 8, 0, self.activation_terms)]

    def dequantize64(self) -> torch.Tensor:
        """The ``[N, K]`` matrix in float64, exactly."""
        if self.lead:
            return torch.cat([part.dequantize64() for part in self.parts()])
        n, k = self.shape
        codes, d, m = self._records()
        q = codes.double().reshape(n, k // BLOCK, BLOCK)
        if self.bits == 8:
            return ((q - 128) * d.double()[..., None]).reshape(n, k)
        if self.levels is not None:
            return (self.levels.double()[codes.long()].reshape(q.shape) * d.double()[..., None]).reshape(n, k)
        return (q * d.double()[..., None] + m.double()[..., None]).reshape(n, k)

    def mat(self):
        """The ``nf_mat`` structure the native kernels take (built once)."""
        if self._mat is None:
            self._mat = self.nf_mat()
        return self._mat

    def nf_mat(self, bias: int | None = None):
        """A new ``nf_mat`` of this weight with the address of a float32 ``bias`` (or None)."""
        from ninefold.ops import cpu_native

        return cpu_native.Mat(self.data.data_ptr(), self.shape[0], self.shape[1], self.bits, bias, self.lead,
                              self.levels_ptr(), self.lead_bits)

    def levels_ptr(self) -> int | None:
        """The address of the 16 levels for the native kernels (None: affine or 8-bit codes)."""
        return None if self.levels is None else self.levels.data_ptr()

    def __repr__(self) -> str:
        lead = f", 4-bit lead rows={self.lead}" if self.lead else ""
        levels = ", levels" if self.levels is not None else ""
        return f"BlockWeight(shape={self.shape}, bits={self.bits}{lead}{levels})"


def _record_bytes(bits: int, levels: torch.Tensor | None) -> int:
    """Bytes of one record (16 rows x 32 columns) in the native layout (nf_cpu.h)."""
    return {8: 544, 5: 384}.get(bits, 288 if levels is not None else 320)


def _pack_blocks(codes, scales, offsets, bits, levels=None) -> torch.Tensor:
    """The records of ``codes``/``scales``/``offsets`` in the native layout: by the native library on all threads
    where it is built, else by ``_pack_blocks_torch`` (the reference; the two agree byte for byte)."""
    from ninefold.ops import cpu_native

    lib = cpu_native.library()
    if lib is None:
        return _pack_blocks_torch(codes, scales, offsets, bits)
    n, k = codes.shape
    kind = bits if bits in (5, 8) else 3 if levels is not None else 4  # NF_KIND_5/8, NF_KIND_L4, NF_KIND_4 (nf_cpu.h)
    out = torch.empty(-(-n // _GROUP) * (k // BLOCK) * _record_bytes(bits, levels), dtype=torch.uint8)
    c = codes.to(torch.int8 if bits == 8 else torch.uint8).contiguous()
    d = scales.to(torch.float16).contiguous()
    m = None if offsets is None else offsets.to(torch.float16).contiguous()
    lib.nf_pack_blocks(c.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr(), n, k, kind, out.data_ptr())
    return out


def _pack_blocks_torch(codes, scales, offsets, bits) -> torch.Tensor:
    n, k = codes.shape
    g, b = -(-n // _GROUP), k // BLOCK
    rows = g * _GROUP

    def pad(t, dtype):
        out = torch.zeros((rows, t.shape[1]), dtype=dtype)
        out[:n] = t
        return out

    def fp16_bytes(t):  # [N, B] -> (g, b, 32 bytes): the 16 rows' fp16 values of each block
        return pad(t.float(), torch.float16).view(g, _GROUP, b).permute(0, 2, 1).contiguous().view(torch.uint8)

    if bits in (4, 5):
        full = pad(codes.to(torch.uint8), torch.uint8)
        c = (full & 15).view(g, _GROUP, b, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # (g, b, p, r, j, half)
        recs = [(c[..., 0] | (c[..., 1] << 4)).reshape(g, b, 256)]
        if bits == 5:  # bit s of plane byte (r, j): the fifth bit of column 4 s + j
            fifth = (full >> 4).view(g, _GROUP, b, 8, 4).permute(0, 2, 3, 1, 4)  # (g, b, s, r, j)
            shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1, 1)
            recs.append((fifth << shifts).sum(dim=2, dtype=torch.uint8).reshape(g, b, 64))
        recs.append(fp16_bytes(scales))
        if offsets is not None:  # none with levels
            recs.append(fp16_bytes(offsets))
    else:
        u = pad((codes.to(torch.int16) + 128).to(torch.uint8), torch.uint8).view(g, _GROUP, b, 8, 4)  # (g, r, b, s, j)
        recs = [u.permute(0, 2, 3, 1, 4).reshape(g, b, 512), fp16_bytes(scales)]
    return torch.cat(recs, dim=-1).reshape(-1).contiguous()


def quantize_activations(x: torch.Tensor, terms: int = 1) -> torch.Tensor:
    """``x`` (float, ``[..., K]``) rounded as the kernels see it: per 32 values ``q * dx``, with
    ``dx = max|x| / 127`` and ``q = round(x / dx)`` (float32 arithmetic, as in nf_cpu.h); float32.
    ``terms=2`` adds the same rounding of the remainder ``x - q * dx``."""
    xf = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    out = torch.zeros_like(xf)
    for _ in range(terms):
        rest = xf - out if terms > 1 else xf
        amax = rest.abs().amax(dim=-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        q = torch.round(rest * inv).clamp(-127, 127)
        out = out + q * (amax / 127.0)
    return out.reshape(x.shape)


def _linear_blocks_key(x, weight, bias=None):
    n, k = _check_quantized_linear("linear_blocks", BlockWeight, x, weight, bias)
    m = x.numel() // max(k, 1)
    kind = (weight.bits, weight.lead > 0, weight.levels is not None, weight.activation_terms)
    return x.device, x.dtype, (spec.pow2(m), n, k, *kind), bias is not None


def linear_blocks(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``quantize_activations(x, weight.activation_terms) @ weight.T (+ bias)`` for a ``BlockWeight``
    ``[N, K]``: x ``[..., K]`` -> ``[..., N]``.

    The activations are rounded to int8 per 32 values (``quantize_activations``), as llama.cpp does
    for its quantized dot products; each block's integer dot product is exact, the sums float32.
    The result has x's dtype (float32 or bfloat16 on the native kernels).
    """
    return _LINEAR_BLOCKS.call(x, weight, bias)


_LINEAR_BLOCKS = Operator("linear_blocks", linear_blocks, _linear_blocks_key)


def _native_ok(x, weight, bias):
    from ninefold.ops import cpu_native

    if x.dtype not in (torch.float32, torch.bfloat16):
        return f"x is {spec.dtype_name(x.dtype)}; the native kernels take float32 or bfloat16"
    if not cpu_native.available():
        return f"native CPU kernels unavailable: {cpu_native.reason()}"
    return None


@register("linear_blocks", "native", devices=("cpu",), supports=_native_ok, priority={"cpu": 10})
def _linear_blocks_native(x, weight, bias):
    from ninefold.ops import cpu_native

    lib = cpu_native.library()
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    if m:
        scratch = torch.empty(lib.nf_linear_scratch_bytes(m, k), dtype=torch.uint8)
        bf16 = int(x.dtype == torch.bfloat16)
        lib.nf_linear(weight.mat(), x2.data_ptr(), bf16, x2.stride(0), m, out.data_ptr(), bf16, n,
                      weight.activation_terms, scratch.data_ptr())
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


@register("linear_blocks", "dequantize", devices=("cpu",))
def _linear_blocks_dequantize(x, weight, bias):
    """torch: the activations rounded as the kernels round them, then a dense float32 matmul."""
    out = F.linear(quantize_activations(x, weight.activation_terms), weight.dequantize(torch.float32))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
