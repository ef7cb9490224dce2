"""Reading a LoRA adapter saved in PEFT's format, checked against the model it will run on.

An adapter adds ``scale * B @ A`` to some of a layer's projections (``A`` is ``[r, in]``, ``B`` is
``[out, r]``; ``scale`` is ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA). The
decoder's projections are q/k/v, o, gate/up and down (``MODULES``); the adapter's matrices are
returned per (layer, projection) with ``scale`` folded into ``B``, in float32.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ninefold.llm.config import STACKED_PROJECTIONS, ModelConfig, rotary_rows

# projection name -> (its fused matrix in the model, its part within that matrix; None: all of its parts, for the
# projections Phi-3 stores stacked, whose B rows split into the parts' B matrices with A shared)
MODULES = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
    "qkv_proj": ("qkv", None), "gate_up_proj": ("gate_up", None),
}
STACKED = ("qkv_proj", "gate_up_proj")
SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


def part_sizes(config: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """Per fused matrix, the ``(in, out)`` size of each of its parts."""
    d, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv": [(d, q), (d, kv), (d, kv)], "o": [(q, d)], "gate_up": [(d, inter), (d, inter)],
            "down": [(inter, d)]}


@dataclass
class Adapter:
    """An adapter's matrices, ``weights[(layer, matrix, part)] = (A [r, in], scale * B [out, r])``, float32."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    generation: int = 0  # which loading of its ``lora_int_id`` this is (``LoRASlots.forget`` starts a new one)

    @property
    def matrices(self) -> set[str]:
        """The fused matrices (``"qkv"``, ``"o"``, ``"gate_up"``, ``"down"``) this adapter changes."""
        return {matrix for _, matrix, _ in self.weights}


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> Adapter:
    """Read the PEFT adapter in directory ``path`` for a model of ``config``; ValueError naming what does not fit."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"lora_path: {str(path)!r} is not a directory (expected a PEFT adapter: adapter_config.json "
                         "and adapter_model.safetensors)")
    settings = _read_config(root)
    tensors = _read_tensors(root)
    sizes = part_sizes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (layer, "self_attn.q_proj") -> {"A": .., "B": ..}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(3) not in MODULES:
            raise ValueError(f"lora_path: adapter {name!r} has tensor {key!r}; only LoRA matrices of the decoder's "
                             f"projections ({', '.join(MODULES)}) are supported (no embedding, output-layer or "
                             "fully trained modules)")
        if m.group(3) in (SPLIT if config.architecture in STACKED_PROJECTIONS else STACKED):
            raise ValueError(f"lora_path: adapter {name!r} has tensor {key!r}, a projection a {config.architecture} "
                             "does not have (it stores q/k/v and gate/up "
                             f"{'stacked' if config.architecture in STACKED_PROJECTIONS else 'separately'}); "
                             "an adapter for another base model?")
        pairs.setdefault((int(m.group(1)), f"{m.group(2)}.{m.group(3)}"), {})[m.group(4)] = tensor
    if not pairs:
        raise ValueError(f"lora_path: adapter {name!r} in {str(path)!r} holds no LoRA matrices")
    adapter = Adapter(name, str(path), rank=0)
    for (layer, path_in_layer), ab in sorted(pairs.items()):
        where = f"model.layers.{layer}.{path_in_layer}"
        module = path_in_layer.split(".")[1]
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora_path: adapter {name!r} has lora_{next(iter(ab))} for {where} without its pair")
        if layer >= config.num_layers:
            raise ValueError(f"lora_path: adapter {name!r} changes {where}; the model has {config.num_layers} layers")
        a, b = ab["A"].float(), ab["B"].float()
        matrix, part = MODULES[module]
        parts = range(len(sizes[matrix])) if part is None else [part]
        d_in, d_out = sizes[matrix][parts[0]][0], sum(sizes[matrix][j][1] for j in parts)
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != d_in or b.shape != (d_out, r):
            raise ValueError(f"lora_path: adapter {name!r} has {where} lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; this model needs [r, {d_in}] and [{d_out}, r] (another base model?)")
        if r > max_rank:
            raise ValueError(f"lora_path: adapter {name!r} has rank {r} at {where}; this engine takes at most "
                             f"max_lora_rank={max_rank}")
        alpha = _pattern_value(settings.get("alpha_pattern"), where, settings.get("lora_alpha", 8))
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise ValueError(f"lora_path: adapter {name!r} has lora_alpha {alpha!r} for {where}; expected a number")
        scale = alpha / math.sqrt(r) if settings.get("use_rslora") else alpha / r
        rows = 0
        for j in parts:
            out = sizes[matrix][j][1]
            b_part = b[rows:rows + out] * scale
            if matrix == "qkv" and j < 2:  # q's and k's rows as the model stores them (a partial rotary embedding)
                b_part = rotary_rows(b_part, config)
            adapter.weights[(layer, matrix, j)] = (a.contiguous(), b_part.contiguous())
            rows += out
        adapter.rank = max(adapter.rank, r)
    return adapter


def _read_config(root: Path) -> dict:
    file = root / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"lora_path: {str(root)!r} has no adapter_config.json")
    try:
        settings = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_path: {str(file)!r} is not readable JSON ({e})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"lora_path: {str(file)!r} holds {type(settings).__name__}, expected an object")
    kind = settings.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"lora_path: {str(file)!r} has peft_type {kind!r}; supported: 'LORA'")
    unsupported = {"use_dora": bool(settings.get("use_dora")),
                   "bias": settings.get("bias", "none") not in (None, "none"),
                   "modules_to_save": bool(settings.get("modules_to_save")),
                   "fan_in_fan_out": bool(settings.get("fan_in_fan_out"))}
    for option, used in unsupported.items():
        if used:
            raise ValueError(f"lora_path: {str(file)!r} sets {option}={settings[option]!r}, which is not supported")
    return settings


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    st, pt = root / "adapter_model.safetensors", root / "adapter_model.bin"
    if not st.is_file() and not pt.is_file():
        raise ValueError(f"lora_path: {str(root)!r} has neither adapter_model.safetensors nor adapter_model.bin")
    file = st if st.is_file() else pt
    try:
        if file is st:
            from safetensors.torch import load_file

            tensors = load_file(str(st))
        else:
            tensors = torch.load(str(pt), map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: whatever the reader raises, the caller gets a ValueError
        raise ValueError(f"lora_path: cannot read {str(file)!r} ({type(e).__name__}: {e})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"lora_path: {str(file)!r} does not hold a dict of tensors")
    return tensors


def _pattern_value(patterns: dict | None, where: str, default):
    """PEFT's per-module override: the value of the first pattern matching the end of the module's name."""
    if patterns is not None and not isinstance(patterns, dict):
        raise ValueError(f"lora_path: alpha_pattern must be an object, got {type(patterns).__name__}")
    for pattern, value in (patterns or {}).items():
        try:
            found = re.search(rf"(^|\.){pattern}$", where)
        except re.error as e:
            raise ValueError(f"lora_path: alpha_pattern key {pattern!r} is not a regular expression ({e})") from None
        if found:
            return value
    return default
