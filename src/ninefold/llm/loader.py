"""Checkpoint loading: a Hugging Face directory, a ``.gguf`` file, or a known model name.

Every source yields a ``Checkpoint`` with a HF-style config dict and HF-named tensors, so one
model definition serves them all. ``load_format="dummy"`` gives a config only (the model then
fills its weights with random values), from a named shape, a config dict or a directory.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ninefold.llm.config import NAMED_SHAPES, QUANTIZATION_MODES, ModelConfig, projection_shapes
from ninefold.llm.tokenizer import read_json_object, read_tokenizer_config, read_tokenizer_file


class MissingModelFile(FileNotFoundError, ValueError):
    """A file a checkpoint needs is not there (catchable as FileNotFoundError or ValueError)."""


@dataclass
class Checkpoint:
    """What a model source provides. ``tensors`` is None for dummy weights."""

    config: dict
    tensors: dict[str, torch.Tensor] | None
    tokenizer: Any = None  # a tokenizers.Tokenizer, or None (dummy weights of a shape without a directory)
    tokenizer_config: dict = field(default_factory=dict)
    generation_config: dict = field(default_factory=dict)
    source: str = ""
    # (rank, size) when ``tensors`` hold one tensor-parallel rank's slices (``parallel.sharding``), read as such
    tensor_parallel: tuple[int, int] | None = None


def load_checkpoint(model: str | Path | dict | None, load_format: str = "auto",
                    quantization: str = "auto", tensor_parallel: tuple[int, int] | None = None,
                    read_tokenizer: bool = True) -> Checkpoint:
    """Load ``model`` (``_load``); with ``quantization="fp8"`` the config says so for the model to act on.
    ``read_tokenizer=False``: a Hugging Face directory's tokenizer files are neither read nor required (the
    tokenizer comes from elsewhere, or is not needed: tensor-parallel workers)."""
    ckpt = _load(model, load_format, quantization, tensor_parallel, read_tokenizer)
    if quantization == "fp8":
        ckpt.config = {**ckpt.config, "ninefold_quantization": "fp8"}
    return ckpt


def _load(model: str | Path | dict | None, load_format: str = "auto",
          quantization: str = "auto", tensor_parallel: tuple[int, int] | None = None,
          read_tokenizer: bool = True) -> Checkpoint:
    """Load ``model``: a HF directory, a ``.gguf`` file or a known name (None = the default model).

    With ``load_format="dummy"``, ``model`` may also be a shape name from ``NAMED_SHAPES``
    (e.g. ``"llama-3.1-8b"``) or a config dict; no weights are read.
    ``quantization`` (``"auto"``, ``"int4"``, ``"none"``, ``"fp8"``; see ``EngineConfig``): with ``"auto"`` or
    ``"int4"`` a GGUF file's 4-bit and Q8_0 matrices stay quantized (``gguf_packed``) and the choice is
    recorded in the config as ``ninefold_quantization`` for the model to act on; ``"none"`` and ``"fp8"``
    dequantize them (the model requantizes its layer matrices to FP8 with ``"fp8"``).
    ``tensor_parallel`` (rank, size): a Hugging Face directory's weights are read as that rank's slices
    only (``Checkpoint.tensor_parallel`` says so); other sources are read whole.
    """
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization: got {quantization!r}; supported: "
                         f"{', '.join(repr(m) for m in QUANTIZATION_MODES)}")
    if load_format == "dummy":
        return _dummy(model, read_tokenizer)
    if load_format != "auto":
        raise ValueError(f"load_format: got {load_format!r}; supported: 'auto', 'dummy'")
    if isinstance(model, dict):
        raise TypeError("model: a config dict needs load_format='dummy'")
    if model is not None and not isinstance(model, (str, Path)):
        raise TypeError(f"model: expected a path or a model name, got {type(model).__name__}")
    if isinstance(model, str) and not model.strip():
        raise ValueError("model: got an empty string; expected a Hugging Face model directory, a .gguf file or a "
                         "known model name (None for the default model)")
    path = Path(model).expanduser() if model is not None else None
    if path is not None and (path.suffix.lower() == ".gguf" or _starts_like_gguf(path)):
        if not path.is_file():
            raise MissingModelFile(f"model: GGUF file {str(path)!r} not found")
        return _from_gguf(path, quantization)
    if path is not None and path.is_dir():
        return load_hf_dir(path, tensor_parallel, read_tokenizer)
    if path is not None and path.is_file():
        raise ValueError(
            f"model: {str(path)!r} is a file but not a GGUF file; give a Hugging Face model directory (the "
            "folder that holds config.json and the *.safetensors files), a .gguf file or a known model name"
        )
    try:
        from ninefold.llm import hub
    except ImportError as error:
        raise ValueError(
            f"model: {model!r} is neither a directory nor a .gguf file, and resolving model names "
            f"needs ninefold.llm.hub, which is not available ({error})"
        ) from error
    resolved = Path(hub.resolve_model(None if model is None else str(model)))
    if resolved.suffix == ".gguf":
        return _from_gguf(resolved, quantization)
    return load_hf_dir(resolved, tensor_parallel, read_tokenizer)


def load_hf_dir(path: str | Path, tensor_parallel: tuple[int, int] | None = None,
                read_tokenizer: bool = True) -> Checkpoint:
    """Read config.json, safetensors weights (single or sharded), tokenizer and generation config.

    The config is checked first (``ModelConfig.from_dict``: architecture, rope scaling, ...), so an
    unsupported model fails before any weight is read; then every tensor is checked against what
    that config describes (``check_tensors``): a missing, unexpected or misshapen tensor is an
    error naming it and its file, not a model that silently ignores or misreads it.
    With ``tensor_parallel`` (rank, size), the split tensors are read as that rank's slices only (the
    checks see their full shapes).
    """
    path = Path(path)
    config_file = path / "config.json"
    config = _read_json(config_file, required=True)
    try:
        model_config = ModelConfig.from_dict(config)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{config_file}: {error}") from error
    if read_tokenizer and not (path / "tokenizer.json").is_file():
        raise MissingModelFile(f"tokenizer.json not found in {path} (a model directory needs the tokenizers "
                               "library's tokenizer.json, or a tokenizer directory given apart: tokenizer=, "
                               "--tokenizer; tokenizer.model alone is not supported)")
    index_for = None
    if tensor_parallel is not None:
        from ninefold.llm.parallel.sharding import shard_index, shard_plan

        plan = shard_plan(model_config, *tensor_parallel)
        index_for = lambda name: shard_index(name, model_config, plan)  # noqa: E731
    tensors, origin, full_shapes, decoder_only = _read_weights(path, index_for)
    if decoder_only and model_config.has_lm_head and not model_config.tie_word_embeddings:
        config["ninefold_headless"] = True  # the decoder alone, saved from its base class: embeddings only
        model_config = ModelConfig.from_dict(config)
    check_tensors(model_config, config, tensors, origin, source=str(path), full_shapes=full_shapes)
    return Checkpoint(config=config, tensors=tensors, **_text_files(path, read_tokenizer), source=str(path),
                      tensor_parallel=tensor_parallel)


def _text_files(path: Path, read_tokenizer: bool = True) -> dict:
    """A model directory's tokenizer (None without tokenizer.json, or without ``read_tokenizer``), tokenizer config
    and generation config, as ``Checkpoint`` fields."""
    tokenizer_file = path / "tokenizer.json"
    found = read_tokenizer and tokenizer_file.is_file()
    return {"tokenizer": read_tokenizer_file(tokenizer_file) if found else None,
            "tokenizer_config": read_tokenizer_config(path) if read_tokenizer else {},
            "generation_config": _read_json(path / "generation_config.json", required=False)}


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read, and the index's weight map when one is read.

    ``model.safetensors``, else the files that ``model.safetensors.index.json`` names (transformers'
    order: with both, the index and its shards are not read); only without either, every
    ``*.safetensors`` file (other safetensors files beside a model, such as a LoRA adapter or
    Mistral's ``consolidated.safetensors``, are not part of it).
    """
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE], None
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file name; "
                             f"got {_short(weight_map)}")
        files = []
        for name in sorted(set(weight_map.values())):
            file = path / name
            if not file.is_file():
                raise MissingModelFile(f"{name} (listed in {INDEX_FILE}) not found in {path}")
            files.append(file)
        return files, weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f"; found {', '.join(others)} (not read: convert to safetensors)" if others else ""
        raise MissingModelFile(f"{SINGLE_FILE} not found in {path} (no {INDEX_FILE} and no *.safetensors files"
                               f"{found})")
    return files, None


def _read_weights(path: Path, index_for=None) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, tuple], bool]:
    """Every tensor of the checkpoint's safetensors files (``*ForCausalLM`` names), the file each came from, the
    full shape of each tensor read in part (``index_for(name)``, where given and not None, is the part to read),
    and whether the files hold the decoder alone (names without ``model.``, no ``lm_head``)."""
    from safetensors import SafetensorError, safe_open

    files, weight_map = _weight_files(path)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    full_shapes: dict[str, tuple] = {}
    decoder_only = True
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for stored in handle.keys():
                    name = _canonical_name(stored)
                    decoder_only = decoder_only and name != stored
                    if name in origin:
                        raise ValueError(f"{path}: tensor {name!r} is stored twice, in {origin[name]} and {file.name}")
                    index = index_for(name) if index_for is not None else None
                    if index is None:
                        tensors[name] = handle.get_tensor(stored)
                    else:
                        from ninefold.llm.parallel.sharding import take

                        part = handle.get_slice(stored)
                        full_shapes[name] = tuple(part.get_shape())
                        tensors[name] = take(part, index)
                    origin[name] = file.name
        except SafetensorError as error:
            raise ValueError(f"{file}: not a readable safetensors file (truncated or corrupt?): {error}") from error
    if weight_map is not None:
        for name, shard in ((_canonical_name(n), s) for n, s in weight_map.items()):
            if origin.get(name) != shard:
                where = f"it is in {origin[name]}" if name in origin else "no shard holds it"
                raise ValueError(f"{path / INDEX_FILE}: maps tensor {name!r} to {shard}, but {where}")
    return tensors, origin, full_shapes, decoder_only and bool(tensors)


def _canonical_name(name: str) -> str:
    """The ``*ForCausalLM`` name of a tensor: checkpoints of the decoder alone (transformers' ``*Model``
    classes, as embedding models are saved) store ``layers.0...`` for ``model.layers.0...``."""
    return name if name.startswith(("model.", "lm_head.")) else "model." + name


# Tensors a checkpoint may hold that the model does not use: per-layer rotary buffers of old
# checkpoints (transformers ignores them too).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def expected_tensor_shapes(mc: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the model definition reads for ``mc``."""
    D, Dh, ff = mc.hidden_size, mc.head_dim, mc.intermediate_size
    q, kv = mc.num_heads * Dh, mc.num_kv_heads * Dh
    shapes = {"model.embed_tokens.weight": (mc.vocab_size, D), "model.norm.weight": (D,)}
    if not mc.tie_word_embeddings and mc.has_lm_head:
        shapes["lm_head.weight"] = (mc.vocab_size, D)
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.o_proj.weight": (D, q), p + "mlp.down_proj.weight": (D, ff),
        })
        shapes.update({p + name: shape for name, shape in projection_shapes(mc.architecture, D, q, kv, ff).items()})
        if mc.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if mc.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (Dh,), p + "self_attn.k_norm.weight": (Dh,)})
    return shapes


def check_tensors(mc: ModelConfig, config: dict, tensors: dict, origin: dict[str, str] | None = None,
                  source: str = "checkpoint", full_shapes: dict[str, tuple] | None = None) -> None:
    """Check ``tensors`` (HF names) against what ``mc`` describes; raise ValueError naming the first
    missing, unexpected, misshapen or non-float tensor. Edits ``tensors`` and ``config`` in place
    where transformers would read the checkpoint differently from the config:

    - tied embeddings with an ``lm_head.weight`` equal to the embedding: the copy is dropped;
      one that differs is used as an untied head (``tie_word_embeddings`` becomes false), as
      transformers does, with a warning;
    - tied embeddings with ``lm_head.weight`` but no ``model.embed_tokens.weight``: the head is
      the embedding too;
    - per-layer ``rotary_emb.inv_freq`` buffers are dropped.

    ``full_shapes``: the shapes of tensors read in part (tensor parallelism), checked instead of theirs.
    """
    full_shapes = full_shapes or {}
    origin = origin or {}

    def where(name: str) -> str:
        return f" in {origin[name]}" if name in origin else ""

    for name in [n for n in tensors if n.endswith(_IGNORED_SUFFIXES)]:
        del tensors[name]
    if mc.tie_word_embeddings and "lm_head.weight" in tensors:
        head, embed = tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")
        if embed is None:
            tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")
            if "lm_head.weight" in origin:
                origin["model.embed_tokens.weight"] = origin["lm_head.weight"]
        elif isinstance(head, torch.Tensor) and isinstance(embed, torch.Tensor) and (
                head.shape != embed.shape or not torch.equal(head, embed)):
            warnings.warn(f"{source}: config.json says tie_word_embeddings, but lm_head.weight differs from "
                          "model.embed_tokens.weight; using it as an untied output layer (as transformers does)",
                          stacklevel=3)
            config["tie_word_embeddings"] = False
            mc = replace(mc, tie_word_embeddings=False)
        else:
            del tensors["lm_head.weight"]
    expected = expected_tensor_shapes(mc)
    missing = [name for name in expected if name not in tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{source}: checkpoint: tensor(s) {', '.join(repr(n) for n in missing[:5])}{more} "
                         f"missing; {_describe(mc)} needs them")
    for name, tensor in tensors.items():
        if name not in expected:
            raise ValueError(f"{source}: checkpoint: unexpected tensor {name!r}{where(name)}: {_describe(mc)} "
                             "has no such weight, so the checkpoint does not match its config.json")
        shape = full_shapes.get(name, tuple(tensor.shape))
        if shape != expected[name]:
            raise ValueError(f"{source}: checkpoint: tensor {name!r}{where(name)} has shape {shape}, expected "
                             f"{expected[name]} from config.json")
        if isinstance(tensor, torch.Tensor) and tensor.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{source}: checkpoint: tensor {name!r}{where(name)} has dtype {tensor.dtype}; "
                             "supported: float32, float16, bfloat16")


def _describe(mc: ModelConfig) -> str:
    return (f"a {mc.architecture} with {mc.num_layers} layers (attention_bias={mc.attention_bias}, "
            f"qk_norm={mc.qk_norm}, tie_word_embeddings={mc.tie_word_embeddings})")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _from_gguf(path: Path, quantization: str = "auto") -> Checkpoint:
    try:
        from ninefold.llm.gguf import load_gguf
    except ImportError as error:
        raise ValueError(f"model: loading {str(path)!r} needs ninefold.llm.gguf, not available ({error})") from error
    ckpt = load_gguf(path, keep_quantized=quantization not in ("none", "fp8"))
    config = dict(ckpt.config)
    config["ninefold_quantization"] = quantization
    try:
        model_config = ModelConfig.from_dict(config)
    except (TypeError, ValueError) as error:
        raise type(error)(f"GGUF file {path}: {error}") from error
    # The GGUF loader accepts a few optional tensors (q/k/v biases, q/k norms); the model reads
    # them only where the config says so, so one it would ignore is an error here.
    check_tensors(model_config, config, ckpt.tensors, source=f"GGUF file {path}")
    return Checkpoint(
        config=config,
        tensors=ckpt.tensors,
        tokenizer=ckpt.tokenizer,
        tokenizer_config=dict(getattr(ckpt, "tokenizer_config", None) or {}),
        generation_config=dict(getattr(ckpt, "generation_config", None) or {}),
        source=str(path),
    )


def _dummy(model: str | Path | dict | None, read_tokenizer: bool = True) -> Checkpoint:
    if isinstance(model, dict):
        return Checkpoint(config=dict(model), tensors=None, source="dummy:config")
    if isinstance(model, str) and model.lower() in NAMED_SHAPES:
        return Checkpoint(config=dict(NAMED_SHAPES[model.lower()]), tensors=None, source=f"dummy:{model}")
    if model is not None:
        path = Path(model)
        if path.is_dir():  # random weights, the rest as the directory has it (as vLLM's dummy format)
            return Checkpoint(config=_read_json(path / "config.json", required=True), tensors=None,
                              **_text_files(path, read_tokenizer), source=f"dummy:{path}")
        if path.suffix == ".json" and path.is_file():
            return Checkpoint(config=_read_json(path, required=True), tensors=None, source=f"dummy:{path}")
    raise ValueError(
        f"model: got {model!r} with load_format='dummy'; expected one of {sorted(NAMED_SHAPES)}, "
        "a config dict, a config.json file or a model directory"
    )


def _read_json(file: Path, *, required: bool) -> dict:
    if not file.is_file():
        if required:
            raise MissingModelFile(f"{file.name} not found in {file.parent}")
        return {}
    return read_json_object(file)


def _starts_like_gguf(path: Path) -> bool:
    """A file whose first bytes are GGUF's magic, whatever its name."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False
