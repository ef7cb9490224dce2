"""Load a GGUF checkpoint as a Hugging Face-style config, state dict and tokenizer.

`load_gguf(path)` returns a `GGUFCheckpoint` whose `config` has `config.json` keys, whose
`tensors` carry HF names (`model.layers.0.self_attn.q_proj.weight`, ...) dequantized to one
dtype, and whose tokenizer is a `tokenizers.Tokenizer` built from the metadata; so the one
model definition that reads HF checkpoints reads GGUF files too.

llama.cpp's converter reorders the rows of the q and k projections of Llama-style models (so
its rotary embedding can rotate adjacent pairs); we put them back in HF order. Anything the
loader does not understand (architecture, tensor type, an unexpected or missing tensor, a shape
that disagrees with the metadata) raises `GGUFError` naming it, rather than building a wrong model.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from ninefold.llm.config import projection_shapes
from ninefold.llm.gguf_dequant import INT4_TYPES, SUPPORTED_TYPES, dequantize, int4_codes, q8_0_codes
from ninefold.llm.gguf_packed import GGUFRows, Int4Codes, Q8Codes
from ninefold.llm.gguf_reader import GGUFError, GGUFFile, read_gguf
from ninefold.llm.gguf_tokenizer import build_tokenizer
from ninefold.llm.pooling import GGUF_POOLING_TYPES

__all__ = ["GGUFCheckpoint", "GGUFError", "SUPPORTED_ARCHITECTURES", "load_gguf", "load_gguf_tokenizer", "read_gguf"]

# GGUF `general.architecture` -> (HF architecture, q/k rows permuted by llama.cpp's converter)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "phi3": ("Phi3ForCausalLM", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q/k/v stacked
}
# Phi-3's ffn_up holds gate and up stacked (llama.cpp splits it in halves: the gate first, as HF's gate_up_proj)
_STACKED_FFN = {"phi3": "mlp.gate_up_proj"}
# GGUF tensors read into the config (``rope_scaling``), not the state dict
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in Hugging Face terms."""

    config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    tokenizer_config: dict
    generation_config: dict
    name: str = ""
    metadata: dict = field(default_factory=dict, repr=False)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool | None = None,
              keep_quantized: bool = False) -> GGUFCheckpoint:
    """Read a GGUF file: config, dequantized HF-named tensors (`dtype`), tokenizer and its config.

    `progress` shows a tqdm bar while dequantizing (default: when stderr is a terminal).
    `keep_quantized`: Q4_0/Q4_1/Q4_K matrices come back as `gguf_packed.Int4Codes`, Q8_0
    matrices as `gguf_packed.Q8Codes` (their codes and scales, nothing dequantized) and other
    quantized matrices as `gguf_packed.GGUFRows` (their raw blocks); the model packs them
    (`gguf_packed.packed_linear`) or dequantizes them.
    Raises GGUFError (a ValueError) for unsupported architectures or tensor types, truncated or
    corrupt files and tensors that disagree with the metadata.
    """
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype: got {dtype!r}; supported: torch.float32, torch.float16, torch.bfloat16")
    file = read_gguf(path)
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"GGUF file {file.path} has architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config = gguf_config(file)
    tensors = _load_tensors(file, config, dtype, progress, keep_quantized)
    try:
        tokenizer = build_tokenizer(meta, source=f"GGUF file {file.path}")
    except ValueError as error:
        raise GGUFError(str(error)) from None
    return GGUFCheckpoint(
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        tokenizer_config=gguf_tokenizer_config(meta),
        generation_config=_generation_config(meta),
        name=str(meta.get("general.name") or file.path.stem),
        metadata={k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.")},
    )


def gguf_config(file: GGUFFile) -> dict:
    """The HF `config.json` dict that a GGUF file's metadata and tensor table describe."""
    meta = file.metadata
    arch = meta["general.architecture"]

    def get(key: str, default=None, required: bool = False):
        value = meta.get(f"{arch}.{key}", default)
        if value is None and required:
            raise GGUFError(f"GGUF file {file.path} lacks metadata {arch}.{key}")
        return value

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = get("attention.head_count_kv", heads)
    for key, value in (("attention.head_count", heads), ("attention.head_count_kv", kv_heads)):
        if not isinstance(value, int):
            raise GGUFError(f"GGUF file {file.path}: {arch}.{key} is {value!r}; per-layer head counts are not supported")
    head_dim = int(get("attention.key_length", hidden // heads))
    if get("attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"GGUF file {file.path}: key and value head sizes differ, which is not supported")
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":  # (llama.cpp's other converters permute q/k over the whole head)
        raise GGUFError(f"GGUF file {file.path}: rotary dimension {rope_dim} != head size {head_dim} (partial rotary) "
                        f"is supported for phi3 files only, not {arch}")
    tokens = meta.get("tokenizer.ggml.tokens")
    embed = file.tensors.get("token_embd.weight")
    vocab = get("vocab_size") or (len(tokens) if tokens is not None else None) or (embed.shape[0] if embed else None)
    if vocab is None:
        raise GGUFError(f"GGUF file {file.path} gives no vocabulary size ({arch}.vocab_size, tokenizer.ggml.tokens "
                        "and token_embd.weight are all missing)")
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch][0]],
        "model_type": SUPPORTED_ARCHITECTURES[arch][0].removesuffix("ForCausalLM").lower(),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "num_hidden_layers": int(get("block_count", required=True)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_freq_factors(file, rope_dim) or _longrope(file, rope_dim, get) or _rope_scaling(get),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if rope_dim != head_dim:  # Phi-4-mini's partial rotary embedding: the count itself (a factor may round short)
        config["partial_rotary_factor"] = rope_dim / head_dim
        config["ninefold_rotary_dim"] = rope_dim
    if get("attention.sliding_window") is not None:
        config["sliding_window"] = int(get("attention.sliding_window"))
    if get("pooling_type") in GGUF_POOLING_TYPES:  # an embedding model's (llama.cpp's --pooling)
        config["ninefold_pooling_type"] = GGUF_POOLING_TYPES[get("pooling_type")]
    return config


def _rope_freq_factors(file: GGUFFile, head_dim: int) -> dict | None:
    """A GGUF's ``rope_freqs.weight`` (per-frequency divisors, which llama.cpp's converter writes for Llama
    3.1/3.2's llama3 scaling) as ``rope_scaling`` ``{"rope_type": "freq_factors", "freq_factors": [...]}``."""
    info = file.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    arch = file.metadata["general.architecture"]
    if file.metadata.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise GGUFError(f"GGUF file {file.path} holds rope_freqs.weight and {arch}.rope.scaling.type "
                        f"{file.metadata[f'{arch}.rope.scaling.type']!r}; the two together are not supported")
    if tuple(info.shape) != (head_dim // 2,) or info.type_name not in ("F32", "F16", "BF16"):
        raise GGUFError(f"GGUF file {file.path}: rope_freqs.weight is {info.type_name} of shape {tuple(info.shape)}; "
                        f"expected float values of shape ({head_dim // 2},) (one per rotated pair)")
    factors = dequantize(file.tensor_bytes(info), info.ggml_type, tuple(info.shape)).tolist()
    if not all(0 < f < float("inf") for f in factors):
        raise GGUFError(f"GGUF file {file.path}: rope_freqs.weight holds values that are not positive and finite")
    return {"rope_type": "freq_factors", "freq_factors": factors}


def _longrope(file: GGUFFile, head_dim: int, get) -> dict | None:
    """Phi-3.5's longrope from a GGUF: ``rope_factors_long`` / ``rope_factors_short`` (what llama.cpp's converter writes
    for it), the pretraining context (``rope.scaling.original_context_length``) and, when given, the attention
    factor (``rope.scaling.attn_factor``), as the HF ``rope_scaling`` dict."""
    infos = [file.tensors.get(f"rope_factors_{kind}.weight") for kind in ("long", "short")]
    if infos == [None, None]:
        return None
    factors = []
    for kind, info in zip(("long", "short"), infos):
        if info is None or tuple(info.shape) != (head_dim // 2,) or info.type_name not in ("F32", "F16", "BF16"):
            shown = "missing" if info is None else f"{info.type_name} of shape {tuple(info.shape)}"
            raise GGUFError(f"GGUF file {file.path}: rope_factors_{kind}.weight is {shown}; longrope needs both "
                            f"factor tensors as float values of shape ({head_dim // 2},) (one per rotated pair)")
        factors.append(dequantize(file.tensor_bytes(info), info.ggml_type, tuple(info.shape)).tolist())
    scaling = {"rope_type": "longrope", "long_factor": factors[0], "short_factor": factors[1]}
    if get("rope.scaling.original_context_length") is not None:
        scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    if get("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(get("rope.scaling.attn_factor"))
    return scaling


def _rope_scaling(get) -> dict | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(get("rope.scaling.factor", 1.0))}
    if get("rope.scaling.original_context_length") is not None:
        scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    return scaling


def _expected_shapes(config: dict) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(tensors the model needs, tensors it may have), HF name -> shape."""
    h, d = config["hidden_size"], config["head_dim"]
    q, kv, ff = config["num_attention_heads"] * d, config["num_key_value_heads"] * d, config["intermediate_size"]
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.o_proj.weight": (h, q),
        "mlp.down_proj.weight": (h, ff),
    }
    per_layer |= projection_shapes(config["architectures"][0], h, q, kv, ff)
    optional = {
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
    }
    if config["architectures"][0] == "Qwen2ForCausalLM":
        per_layer |= {k: v for k, v in optional.items() if k.endswith("bias")}
    elif config["architectures"][0] == "Qwen3ForCausalLM":
        per_layer |= {k: v for k, v in optional.items() if "norm" in k}
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{k}": v for k, v in per_layer.items()}
    # Optional extras a file may carry (e.g. q/k/v biases on a Llama); checked when present.
    extras = {f"model.layers.{i}.{k}": v for i in range(config["num_hidden_layers"]) for k, v in optional.items()}
    return shapes, extras


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The HF name of a GGUF tensor name (in a file of GGUF architecture ``arch``), or None when it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        module = _STACKED_FFN.get(arch, "mlp.up_proj") if match.group(2) == "ffn_up" else _LAYER_NAMES[match.group(2)]
        return f"model.layers.{match.group(1)}.{module}.{match.group(3)}"
    return None


def _load_tensors(file: GGUFFile, config: dict, dtype: torch.dtype, progress: bool | None,
                  keep_quantized: bool = False) -> dict[str, torch.Tensor | Int4Codes | Q8Codes | GGUFRows]:
    required, extras = _expected_shapes(config)
    arch = file.metadata["general.architecture"]
    permuted = SUPPORTED_ARCHITECTURES[arch][1]
    names = {}
    for name, info in file.tensors.items():
        if name in _ROPE_TENSORS:  # read into the config (rope_scaling) by gguf_config
            continue
        target = hf_name(name, arch)
        if target is None or (target not in required and target not in extras):
            raise GGUFError(
                f"GGUF file {file.path} holds tensor {name!r}, which a {config['architectures'][0]} "
                f"with {config['num_hidden_layers']} layers does not have"
            )
        if info.type_name not in SUPPORTED_TYPES:
            raise GGUFError(
                f"GGUF file {file.path}: tensor {name!r} has type {info.type_name}; "
                f"supported: {', '.join(SUPPORTED_TYPES)}"
            )
        expected = required.get(target, extras.get(target))
        if tuple(info.shape) != expected:
            raise GGUFError(
                f"GGUF file {file.path}: tensor {name!r} has shape {tuple(info.shape)}, the metadata implies {expected}"
            )
        names[name] = target
    missing = sorted(set(required) - set(names.values()), key=_natural)
    if missing:
        raise GGUFError(f"GGUF file {file.path} lacks tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")

    if progress is None:
        progress = _stderr_is_tty()
    tensors: dict[str, torch.Tensor] = {}
    bar = tqdm(total=sum(i.nbytes for i in file.tensors.values()), unit="B", unit_scale=True,
               desc=f"loading {file.path.name}", disable=not progress, leave=False)
    with bar:
        for name, target in names.items():
            info = file.tensors[name]
            tensor = _read_tensor(file, info, dtype, keep_quantized)
            heads = None
            if permuted and target.endswith(("q_proj.weight", "q_proj.bias")):
                heads = config["num_attention_heads"]
            elif permuted and target.endswith(("k_proj.weight", "k_proj.bias")):
                heads = config["num_key_value_heads"]
            if heads is not None:
                if isinstance(tensor, torch.Tensor):
                    tensor = unpermute_rows(tensor, heads)
                else:
                    tensor = tensor.map_rows(lambda t, h=heads: unpermute_rows(t, h))
            tensors[target] = tensor
            bar.update(info.nbytes)
    return dict(sorted(tensors.items(), key=lambda kv: _natural(kv[0])))


def _read_tensor(file: GGUFFile, info, dtype: torch.dtype, keep_quantized: bool):
    raw = file.tensor_bytes(info)
    if keep_quantized and len(info.shape) == 2:
        if info.type_name in INT4_TYPES:
            return Int4Codes(*int4_codes(raw, info.ggml_type, tuple(info.shape)), info.type_name)
        if info.type_name == "Q8_0":
            return Q8Codes(*q8_0_codes(raw, tuple(info.shape)))
        if info.type_name not in ("F32", "F16", "BF16"):
            rows = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(info.shape[0], -1)
            return GGUFRows(rows, info.ggml_type, info.shape[1])
    return dequantize(raw, info.ggml_type, info.shape, dtype)


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows (0, 2, 4, ..., 1, 3, 5, ...) of HF
    become interleaved pairs in GGUF; this restores the HF order."""
    rows = weight.shape[0]
    head = rows // num_heads
    return weight.reshape(num_heads, head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def load_gguf_tokenizer(path: str | os.PathLike) -> tuple[Tokenizer, dict]:
    """Only the tokenizer of a GGUF file and its config (chat template, special tokens); no tensors read."""
    file = read_gguf(path)
    try:
        return build_tokenizer(file.metadata, source=f"GGUF file {file.path}"), gguf_tokenizer_config(file.metadata)
    except ValueError as error:
        raise GGUFError(str(error)) from None


def gguf_tokenizer_config(meta: dict) -> dict:
    """The `tokenizer_config.json`-style dict of GGUF metadata: special tokens, BOS/EOS flags, chat template."""
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def token(key: str):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    kind = meta.get("tokenizer.ggml.model")
    config = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _generation_config(meta: dict) -> dict:
    """Stop ids and sampling defaults: the end-of-sequence and end-of-turn tokens, and llama.cpp's
    optional `general.sampling.*` keys."""
    stops = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and int(token_id) not in stops:
            stops.append(int(token_id))
    config: dict = {}
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if stops:
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    for key, name in (("temp", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
                      ("penalty_repeat", "repetition_penalty")):
        if meta.get(f"general.sampling.{key}") is not None:
            config[name] = meta[f"general.sampling.{key}"]
    if any(k in config for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")):
        config["do_sample"] = True
    return config


def _natural(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _stderr_is_tty() -> bool:
    import sys

    return bool(getattr(sys.stderr, "isatty", lambda: False)())

