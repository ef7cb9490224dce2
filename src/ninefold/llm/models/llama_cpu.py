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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ninefold import ops
from ninefold.llm.gguf_packed import PackedLinear


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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Hidden states ``[B, D]`` after the final norm, for one new token per sequence."""
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
        hidden = F.embedding(input_ids, m.embed)
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


def _prefer(op: str, name: str, *args):
    """Implementation ``name`` of ``op`` when it can run ``args`` (validated once), else dispatch's choice."""
    for impl in ops.candidates(op, *args):
        if impl.name == name:
            return impl.fn
    return ops.implementation(op, *args)


def supports(model, meta) -> bool:
    """Whether ``CpuDecoder`` can run this step: a CPU model, a pure decode step, neox rope over the whole head."""
    return (model.device.type == "cpu" and model.cpu_fast_decode and meta.is_decode and meta.block_tables is not None
            and model.cos_sin.shape[1] == model.config.head_dim and math.isfinite(model.scale))
