"""Checkpoint loading: a Hugging Face directory, a ``.gguf`` file, or a known model name.

Every source yields a ``Checkpoint`` with a HF-style config dict and HF-named tensors, so one
model definition serves them all. ``load_format="dummy"`` gives a config only (the model then
fills its weights with random values), from a named shape, a config dict or a directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ninefold.llm.config import NAMED_SHAPES, QUANTIZATION_MODES


class MissingModelFile(FileNotFoundError, ValueError):
    """A file a checkpoint needs is not there (catchable as FileNotFoundError or ValueError)."""


@dataclass
class Checkpoint:
    """What a model source provides. ``tensors`` is None for dummy weights."""

    config: dict
    tensors: dict[str, torch.Tensor] | None
    tokenizer: Any = None  # a tokenizers.Tokenizer, or None (dummy weights)
    tokenizer_config: dict = field(default_factory=dict)
    generation_config: dict = field(default_factory=dict)
    source: str = ""


def load_checkpoint(model: str | Path | dict | None, load_format: str = "auto",
                    quantization: str = "auto") -> Checkpoint:
    """Load ``model``: a HF directory, a ``.gguf`` file or a known name (None = the default model).

    With ``load_format="dummy"``, ``model`` may also be a shape name from ``NAMED_SHAPES``
    (e.g. ``"llama-3.1-8b"``) or a config dict; no weights are read.
    ``quantization`` (``"auto"``, ``"int4"``, ``"none"``; see ``EngineConfig``): unless ``"none"``,
    a GGUF file's 4-bit and Q8_0 matrices stay quantized (``gguf_packed``) and the choice is
    recorded in the config as ``ninefold_quantization`` for the model to act on.
    """
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization: got {quantization!r}; supported: "
                         f"{', '.join(repr(m) for m in QUANTIZATION_MODES)}")
    if load_format == "dummy":
        return _dummy(model)
    if load_format != "auto":
        raise ValueError(f"load_format: got {load_format!r}; supported: 'auto', 'dummy'")
    if isinstance(model, dict):
        raise TypeError("model: a config dict needs load_format='dummy'")
    if model is not None and not isinstance(model, (str, Path)):
        raise TypeError(f"model: expected a path or a model name, got {type(model).__name__}")
    path = Path(model) if model is not None else None
    if path is not None and path.suffix == ".gguf":
        if not path.is_file():
            raise MissingModelFile(f"model: GGUF file {str(path)!r} not found")
        return _from_gguf(path, quantization)
    if path is not None and path.is_dir():
        return load_hf_dir(path)
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
    return load_hf_dir(resolved)


def load_hf_dir(path: str | Path) -> Checkpoint:
    """Read config.json, safetensors weights (single or sharded), tokenizer and generation config."""
    import tokenizers
    from safetensors import safe_open

    path = Path(path)
    config = _read_json(path / "config.json", required=True)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MissingModelFile(f"model.safetensors not found in {path} (no *.safetensors files)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise MissingModelFile(f"{file.name} (listed in model.safetensors.index.json) not found in {path}")
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise MissingModelFile(f"tokenizer.json not found in {path}")
    tokenizer_config = _read_json(path / "tokenizer_config.json", required=False)
    chat_file = path / "chat_template.jinja"
    if "chat_template" not in tokenizer_config and chat_file.is_file():
        tokenizer_config["chat_template"] = chat_file.read_text()
    return Checkpoint(
        config=config,
        tensors=tensors,
        tokenizer=tokenizers.Tokenizer.from_file(str(tokenizer_file)),
        tokenizer_config=tokenizer_config,
        generation_config=_read_json(path / "generation_config.json", required=False),
        source=str(path),
    )


def _from_gguf(path: Path, quantization: str = "auto") -> Checkpoint:
    try:
        from ninefold.llm.gguf import load_gguf
    except ImportError as error:
        raise ValueError(f"model: loading {str(path)!r} needs ninefold.llm.gguf, not available ({error})") from error
    ckpt = load_gguf(path, keep_quantized=quantization != "none")
    config = dict(ckpt.config)
    config["ninefold_quantization"] = quantization
    return Checkpoint(
        config=config,
        tensors=ckpt.tensors,
        tokenizer=ckpt.tokenizer,
        tokenizer_config=dict(getattr(ckpt, "tokenizer_config", None) or {}),
        generation_config=dict(getattr(ckpt, "generation_config", None) or {}),
        source=str(path),
    )


def _dummy(model: str | Path | dict | None) -> Checkpoint:
    if isinstance(model, dict):
        return Checkpoint(config=dict(model), tensors=None, source="dummy:config")
    if isinstance(model, str) and model.lower() in NAMED_SHAPES:
        return Checkpoint(config=dict(NAMED_SHAPES[model.lower()]), tensors=None, source=f"dummy:{model}")
    if model is not None:
        path = Path(model)
        if path.is_dir():
            return Checkpoint(config=_read_json(path / "config.json", required=True), tensors=None,
                              source=f"dummy:{path}")
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
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from error
