"""Tensor-parallel sharding of a Llama-family checkpoint (Megatron-style).

Each rank holds a slice of every layer: the q/k/v and gate/up projections split by output rows
(whole attention heads, whole intermediate channels), the o and down projections by input columns,
so one all-reduce after each of those two restores the full hidden state. Norms and the embedding
are replicated; the output layer lives on rank 0 only, which samples (no gather of logits).

With fewer key/value heads than ranks, each key/value head is replicated on the ranks whose query
heads read it (``size`` must then be a multiple of the key/value heads).

A LoRA adapter follows the same split (``shard_lora``): B's rows with the projections split by rows, A's
columns with those split by columns, whose partial deltas the same all-reduce sums.

Checkpoints that store q/k/v and gate/up stacked (Phi-3's ``qkv_proj``, ``gate_up_proj``) give each rank
its slice of every part, stacked in the same order: the local matrix of a rank's own heads and channels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ninefold.llm.config import STACKED_PROJECTIONS, ModelConfig
from ninefold.llm.gguf_packed import QUANTIZED


@dataclass(frozen=True)
class ShardPlan:
    """Which heads and channels one rank of ``size`` holds."""

    rank: int
    size: int
    q_heads: tuple[int, int]  # [first, end) query heads
    kv_heads: tuple[int, int]  # [first, end) key/value heads
    channels: tuple[int, int]  # [first, end) intermediate channels

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` as this rank's model sees it: its own heads and channels, everything else unchanged."""
        return replace(config, num_heads=self.q_heads[1] - self.q_heads[0],
                       num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                       intermediate_size=self.channels[1] - self.channels[0])


def check_parallel_size(config: ModelConfig, size: int) -> None:
    """Raise ValueError naming ``tensor_parallel_size`` when ``config`` cannot be split ``size`` ways."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size: expected a positive int, got {size!r}")
    problems = []
    if config.num_heads % size:
        problems.append(f"num_attention_heads={config.num_heads} is not a multiple of it")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        problems.append(f"num_key_value_heads={config.num_kv_heads} is neither a multiple nor a divisor of it")
    if config.intermediate_size % size:
        problems.append(f"intermediate_size={config.intermediate_size} is not a multiple of it")
    if problems:
        raise ValueError(f"tensor_parallel_size: got {size}, but this model cannot be split {size} ways: "
                         + "; ".join(problems))


def shard_plan(config: ModelConfig, rank: int, size: int) -> ShardPlan:
    """The slice of ``config``'s heads and channels that ``rank`` of ``size`` holds."""
    check_parallel_size(config, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank: expected 0..{size - 1}, got {rank}")
    hq, hk, inter = config.num_heads // size, config.num_kv_heads, config.intermediate_size // size
    if hk % size == 0:
        kv = (rank * hk // size, (rank + 1) * hk // size)
    else:  # fewer kv heads than ranks: the one kv head this rank's query heads belong to
        head = rank * hk // size
        kv = (head, head + 1)
    return ShardPlan(rank, size, (rank * hq, (rank + 1) * hq), kv, (rank * inter, (rank + 1) * inter))


Index = tuple[slice, ...]


def _shifted(part: slice, offset: int) -> Index:
    return (slice(part.start + offset, part.stop + offset),)


def shard_index(name: str, config: ModelConfig, plan: ShardPlan) -> Index | list[Index] | None:
    """The part of HF tensor ``name`` that ``plan``'s rank holds, as an index into the full tensor (None: all of it),
    or for a stacked projection the list of indices whose rows, concatenated, are the rank's stacked matrix."""
    dh = config.head_dim
    q = slice(plan.q_heads[0] * dh, plan.q_heads[1] * dh)
    kv = slice(plan.kv_heads[0] * dh, plan.kv_heads[1] * dh)
    channels = slice(*plan.channels)
    if config.architecture in STACKED_PROJECTIONS:
        q_rows, kv_rows = config.num_heads * dh, config.num_kv_heads * dh
        if name.endswith("self_attn.qkv_proj.weight"):
            return [(q,), _shifted(kv, q_rows), _shifted(kv, q_rows + kv_rows)]
        if name.endswith("mlp.gate_up_proj.weight"):
            return [(channels,), _shifted(channels, config.intermediate_size)]
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return (q,)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                      "self_attn.v_proj.bias")):
        return (kv,)
    if name.endswith("self_attn.o_proj.weight"):
        return (slice(None), q)
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return (channels,)
    if name.endswith("mlp.down_proj.weight"):
        return (slice(None), channels)
    return None


def shard_tensors(tensors: dict, config: ModelConfig, plan: ShardPlan, *, keep_lm_head: bool) -> dict:
    """HF-named tensors of ``plan``'s rank (new dict; quantized GGUF matrices dequantized to float32).

    ``keep_lm_head``: keep an untied ``lm_head.weight`` (the rank that computes logits).
    """
    out = {}
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and not keep_lm_head:
            continue
        t = tensor.dequantize(torch.float32) if isinstance(tensor, QUANTIZED) else tensor
        out[name] = take(t, shard_index(name, config, plan))
    return out


def take(tensor, index: Index | list[Index] | None) -> torch.Tensor:
    """``tensor`` (a tensor, or a safetensors slice) at ``shard_index``'s ``index``, as a contiguous tensor."""
    if index is None:
        return tensor
    if isinstance(index, list):
        return torch.cat([tensor[part] for part in index])
    return tensor[index].contiguous()


def shard_lora(weights: dict, config: ModelConfig, plan: ShardPlan) -> dict:
    """An adapter's ``{(layer, matrix, part): (A [r, in], B [out, r])}`` (``ninefold.llm.lora.Adapter.weights``, full
    sizes) as ``plan``'s rank applies it: q/k/v and gate/up keep B's rows of the rank's heads and channels, o and down
    A's columns of them (each rank's ``(x_rank @ A_rank.T) @ B.T`` is a share of the delta that the all-reduce after
    the projection adds up)."""
    dh = config.head_dim
    q = slice(plan.q_heads[0] * dh, plan.q_heads[1] * dh)
    kv = slice(plan.kv_heads[0] * dh, plan.kv_heads[1] * dh)
    channels = slice(*plan.channels)
    rows = {("qkv", 0): q, ("qkv", 1): kv, ("qkv", 2): kv, ("gate_up", 0): channels, ("gate_up", 1): channels}
    columns = {"o": q, "down": channels}
    out = {}
    for (layer, matrix, part), (a, b) in weights.items():
        if matrix in columns:
            a = a[:, columns[matrix]].clone()
        else:
            b = b[rows[(matrix, part)]].clone()  # (a copy: a view of rows would pickle the whole matrix)
        out[(layer, matrix, part)] = (a, b)
    return out
