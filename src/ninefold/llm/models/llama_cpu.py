"""The decode step of ``LlamaForCausalLM`` on CPUs, with as little Python per token as possible.

A decode step on a small model is bound by per-op host cost, not arithmetic: SmolLM2-135M has 30
layers and ~10 ms per token at llama.cpp's rate, so ~180 dispatched op calls of 10-20 us each
were a third of the step. Here the linear and norm implementations are fetched once (per weight,
per row count) with ``ops.implementation`` / ``ops.candidates`` (no per-call signature or
validation; on one row the norms are ``ops.norm_row``'s ``cpu_row``), and the rest is plain torch with the per-step parts hoisted
out of the layer loop: the rotary rows, the KV-cache block indices and the attention mask are
built once per step, not once per layer.

The formulas are those of the ``vendor`` implementations of ``rope`` (float32, halves rotated),
``reshape_and_cache``, ``attention_decode`` and ``silu_and_mul``, with fewer tensor ops (the
rotation is one multiply and one fused multiply-add stored in the model's dtype), so the results
agree with the generic path to float32 rounding (``tests/llm/test_parity.py`` checks it).

When the layer matrices are ``ops.BlockWeight`` (GGUF Q4_0/Q4_1/Q8_0 with ninefold's native CPU
kernels built, ``ninefold.ops.cpu_native``), the whole step is one native call instead
(``NativeDecoder``): every layer's norms, int8 activations, GEMMs, rope, KV-cache write, attention
and silu * up run in C on all threads, the residual stream in float32 (``nf_decode.c``).
"""

from __future__ import annotations

import ctypes
import math

import torch
import torch.nn.functional as F

from ninefold import ops
from ninefold.llm.gguf_packed import PackedLinear, embed_rows


class CpuDecoder:
    """Runs pure decode steps (one new token per sequence) of a ``LlamaForCausalLM`` on the CPU."""

    def __init__(self, model):
        c = model.config
        self.model = model
        self.dtype = model.dtype
        self.eps = c.rms_norm_eps
        self.hq, self.hk, self.d = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = model.q_size, model.kv_size
        self.inter = c.intermediate_size
        self.scale = model.scale
        self.cast = self.dtype != torch.float32
        self.norm_fns: dict[int, tuple] = {}  # rows -> bound (rms_norm, add_rms_norm)
        self.linears: dict[int, object] = {}  # id(weight) -> bound callable(x, bias)
        self.cos_sin = model.cos_sin
        self.native = NativeDecoder(model) if NativeDecoder.why_not(model) is None else None

    # -- pieces ----------------------------------------------------------------------------------

    def _norms(self, x: torch.Tensor, weight: torch.Tensor):
        """(rms_norm, add_rms_norm) implementations for this step's row count, bound once per count."""
        fns = self.norm_fns.get(x.shape[0])
        if fns is None:
            fns = self.norm_fns[x.shape[0]] = (_prefer("rms_norm", "cpu_row", x, weight, self.eps),
                                               _prefer("add_rms_norm", "cpu_row", x, x, weight, self.eps))
        return fns

    def _linear(self, x: torch.Tensor, weight, bias=None) -> torch.Tensor:
        if type(weight) is PackedLinear:
            return weight(x, bias)
        fn = self.linears.get(id(weight))
        if fn is None:
            fn = self.linears[id(weight)] = ops.implementation("linear", x, weight, bias)
        return fn(x, weight, bias)

    # -- the step --------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, lora=None) -> torch.Tensor:
        """Hidden states ``[B, D]`` after the final norm, for one new token per sequence (``lora``: adapters'
        deltas, on the native step only)."""
        if self.native is not None:
            return self.native.forward(input_ids, positions, meta, lora)
        if lora is not None:
            raise ValueError("CpuDecoder: LoRA steps run on the native step or the generic path")
        m = self.model
        b, hq, hk, d = input_ids.shape[0], self.hq, self.hk, self.d
        half = self.cos_sin.shape[1] // 2
        cs = self.cos_sin.index_select(0, positions)
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        cos2 = torch.cat((cos, cos), dim=-1)  # x * cos2 + swap_halves(x) * sin2 = neox rotation
        sin2 = torch.cat((-sin, sin), dim=-1)
        slots = meta.slot_mapping
        bs = m.kv_caches[0][0].shape[1]
        lens = meta.context_lens
        longest = int(lens.max())
        n = -(-longest // bs)
        tables = meta.block_tables[:, :n].reshape(-1).long()
        if b == 1:
            mask, keys = None, longest
        else:
            keys = n * bs
            mask = (torch.arange(keys)[None, :] < lens[:, None])[:, None, None, :]
        hidden = embed_rows(m.embed, input_ids)
        # Scratch reused by every layer of this step: each is consumed before the next layer refills it.
        rot = torch.empty((b, hq + hk, d), dtype=self.dtype)
        rms_norm, add_rms_norm = self._norms(hidden, m.norm)
        eps = self.eps
        residual = None
        qk_heads = hq + hk
        for i, layer in enumerate(m.layers):
            if residual is None:
                residual = hidden
                x = rms_norm(hidden, layer.input_norm, eps)
            else:
                x, residual = add_rms_norm(hidden, residual, layer.input_norm, eps)
            qkv = self._linear(x, layer.qkv, layer.qkv_bias)
            qk = qkv[:, : self.q_size + self.kv_size].reshape(b, qk_heads, d)
            v = qkv[:, self.q_size + self.kv_size:].reshape(b, hk, d)
            if layer.q_norm is not None:
                qk = torch.cat((ops.rms_norm(qk[:, :hq], layer.q_norm, eps), ops.rms_norm(qk[:, hq:], layer.k_norm, eps)),
                               dim=1)
            # bf16 * float32 promotes to float32 exactly as qk.float() would (the rotation runs in float32)
            swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
            if self.cast:  # computed in float32, rounded once when stored into rot (the model's dtype)
                rotated = torch.addcmul(qk * cos2, swapped, sin2, out=rot)
            else:
                rotated = (qk * cos2).addcmul_(swapped, sin2)
            q, k = rotated[:, :hq], rotated[:, hq:]
            k_cache, v_cache = m.kv_caches[i]
            k_cache.view(-1, hk, d).index_copy_(0, slots, k)
            v_cache.view(-1, hk, d).index_copy_(0, slots, v)
            kk = k_cache.index_select(0, tables).view(b, n * bs, hk, d)[:, :keys].transpose(1, 2)
            vv = v_cache.index_select(0, tables).view(b, n * bs, hk, d)[:, :keys].transpose(1, 2)
            # GQA without copies: the query heads of one KV head become that head's query rows.
            o = F.scaled_dot_product_attention(q.reshape(b, hk, hq // hk, d), kk, vv, attn_mask=mask,
                                               scale=self.scale)
            o = self._linear(o.reshape(b, hq * d), layer.o)
            x, residual = add_rms_norm(o, residual, layer.post_norm, eps)
            gu = self._linear(x, layer.gate_up)
            hidden = self._linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter:], layer.down)
        return add_rms_norm(hidden, residual, m.norm, eps)[0]


class NativeDecoder:
    """A whole decode step in one call of the native kernels (``nf_decode_step``)."""

    def __init__(self, model):
        from ninefold.ops import cpu_native

        c = model.config
        self.model = model
        self.lib = cpu_native.library()
        # a QuantizedEmbedding: each step decodes its rows into a small table the C code indexes 0 .. B-1
        self._quantized_table = not isinstance(model.embed, torch.Tensor)
        keep = self._keep = []  # float32 copies whose addresses the structures hold

        def f32(t):
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t.data_ptr()

        def mat(linear, bias=None):
            return linear.blocks.nf_mat(f32(bias))

        self.layers = (cpu_native.Layer * c.num_layers)()
        for i, ly in enumerate(model.layers):
            self.layers[i] = cpu_native.Layer(f32(ly.input_norm), f32(ly.post_norm), f32(ly.q_norm), f32(ly.k_norm),
                                              mat(ly.qkv, ly.qkv_bias), mat(ly.o), mat(ly.gate_up), mat(ly.down),
                                              None, None)
        self._lora_bound: tuple | None = None  # (slots object, projections in use) the layers point at
        bf16 = int(model.dtype == torch.bfloat16)
        self.md = cpu_native.Model(
            n_layers=c.num_layers, dim=c.hidden_size, hq=c.num_heads, hk=c.num_kv_heads, hd=c.head_dim,
            inter=c.intermediate_size, block_size=0, table_stride=0, cache_bf16=bf16, io_bf16=bf16,
            eps=c.rms_norm_eps, scale=model.scale, layers=ctypes.addressof(self.layers),
            embed=None if self._quantized_table else model.embed.data_ptr(), final_norm=f32(model.norm),
            cos_sin=model.cos_sin.data_ptr())
        self._kv = None
        self._scratch = torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def why_not(model) -> str | None:
        """Why this model's decode step cannot run natively (None when it can)."""
        from ninefold.ops import cpu_native

        c = model.config
        if model.dtype not in (torch.float32, torch.bfloat16):
            return f"model dtype {model.dtype}"
        if not all(type(getattr(ly, f)) is PackedLinear and getattr(ly, f).blocks is not None
                   for ly in model.layers for f in ("qkv", "o", "gate_up", "down")):
            return "the layer matrices are not all native block weights"
        if c.head_dim % 32 or c.head_dim > 512 or c.num_heads % c.num_kv_heads:
            return f"head_dim {c.head_dim} (needs a multiple of 32, at most 512) or GQA {c.num_heads}/{c.num_kv_heads}"
        embed, cs = model.embed, model.cos_sin
        if isinstance(embed, torch.Tensor) and not (embed.dtype == model.dtype and embed.is_contiguous()):
            return "the embedding is not a contiguous table in the model's dtype"
        if not isinstance(embed, torch.Tensor) and embed.dtype != model.dtype:
            return "the quantized embedding does not decode to the model's dtype"
        if cs.dtype != torch.float32 or cs.shape[1] != c.head_dim or not cs.is_contiguous():
            return "rotary table"
        if not cpu_native.available():
            return f"native kernels unavailable: {cpu_native.reason()}"
        return None

    def _bind_caches(self) -> None:
        m = self.model
        for i, (k, v) in enumerate(m.kv_caches):
            if k.dtype != m.dtype or not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError(f"NativeDecoder: layer {i}'s KV cache must be contiguous {m.dtype}, got {k.dtype}")
            self.layers[i].k_cache, self.layers[i].v_cache = k.data_ptr(), v.data_ptr()
        self.md.block_size = m.kv_caches[0][0].shape[1]
        self._kv = m.kv_caches

    def _bind_lora(self, lora) -> None:
        """Point each layer's ``nf_lora`` at the adapters' slot-major bfloat16 copies (``r`` 0 for projections no
        adapter uses)."""
        from ninefold.ops import cpu_native

        slots, used = lora.slots, frozenset(lora.used)
        if self._lora_bound == (slots, used):
            return
        fields = {"qkv": "lqkv", "o": "lo", "gate_up": "lgate_up", "down": "ldown"}
        widest = 0
        for matrix, field in fields.items():
            a, b = slots.a_rows[matrix], slots.b_tiles[matrix]  # bfloat16 [L, S, in, R], [L, S, groups, R, 16]
            r = a.shape[-1] if matrix in used else 0
            widest = max(widest, r)
            for i in range(len(self.layers)):
                setattr(self.layers[i], field, cpu_native.Lora(a[i].data_ptr(), b[i].data_ptr(), r))
        self.md.lora_r = widest
        self._lora_bound = (slots, used)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, lora=None) -> torch.Tensor:
        """Hidden states ``[B, D]`` after the final norm (the model's dtype); ``lora``: a ``LoRAStep`` whose
        adapters the step adds."""
        m, md = self.model, self.md
        row_slots = None
        if lora is not None:
            self._bind_lora(lora)
            row_slots = lora.row_slots.to(torch.int64).contiguous()
        md.lora_slots = row_slots.data_ptr() if row_slots is not None else None
        if m.kv_caches is not self._kv:
            self._bind_caches()
        ids = input_ids.to(torch.int64).contiguous()
        pos = positions.to(torch.int64).contiguous()
        # the C code indexes the embedding and rotary tables with these: out of range must not read memory
        if int(ids.min()) < 0 or int(ids.max()) >= m.embed.shape[0]:
            raise ValueError(f"token ids must lie in [0, {m.embed.shape[0]}), got {ids.tolist()}")
        if int(pos.min()) < 0 or int(pos.max()) >= m.cos_sin.shape[0]:
            raise ValueError(f"positions must lie in [0, {m.cos_sin.shape[0]}), got {pos.tolist()}")
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        lens = meta.context_lens.to(torch.int32).contiguous()
        tables = meta.block_tables.to(torch.int32)
        if tables.stride(-1) != 1:
            tables = tables.contiguous()
        b = ids.shape[0]
        if self._quantized_table:  # this step's rows, decoded; the C code reads row i for the i-th sequence
            rows = m.embed(ids).contiguous()
            ids = torch.arange(b, dtype=torch.int64)
            md.embed = rows.data_ptr()
        md.m, md.max_ctx, md.table_stride = b, int(lens.max()), tables.stride(0)
        md.ids, md.positions, md.slots = ids.data_ptr(), pos.data_ptr(), slots.data_ptr()
        md.block_tables, md.context_lens = tables.data_ptr(), lens.data_ptr()
        need = self.lib.nf_decode_scratch_bytes(md)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need + need // 2, dtype=torch.uint8)
        out = torch.empty((b, md.dim), dtype=m.dtype)
        md.scratch, md.out = self._scratch.data_ptr(), out.data_ptr()
        self.lib.nf_decode_step(md)
        return out


def _prefer(op: str, name: str, *args):
    """Implementation ``name`` of ``op`` when it can run ``args`` (validated once), else dispatch's choice."""
    for impl in ops.candidates(op, *args):
        if impl.name == name:
            return impl.fn
    return ops.implementation(op, *args)


def supports(model, meta) -> bool:
    """Whether ``CpuDecoder`` can run this step: a CPU model, a pure decode step, neox rope over the whole head, a
    cache of the model's dtype (not FP8 codes)."""
    return (model.device.type == "cpu" and model.cpu_fast_decode and meta.is_decode and meta.block_tables is not None
            and model.cos_sin.shape[1] == model.config.head_dim and math.isfinite(model.scale)
            and model.kv_caches[0][0].dtype == model.dtype)
