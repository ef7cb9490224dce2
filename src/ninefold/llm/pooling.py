"""Embeddings from the decoder's final hidden states: how a prompt's states become one vector.

``PoolerConfig`` is the model's: which position(s) pool (``LAST`` token, ``MEAN`` of all, ``CLS`` =
first), whether vectors are normalized by default and which output sizes (Matryoshka) it was trained
for. It comes from what the checkpoint says: sentence-transformers' ``modules.json`` and its Pooling
module's ``config.json`` in a Hugging Face directory, ``is_matryoshka`` / ``matryoshka_dimensions`` in
``config.json``, ``{arch}.pooling_type`` in a GGUF file; else last-token pooling, normalized (what
decoder embedding models such as Qwen3-Embedding, gte-Qwen2 and e5-mistral use). ``PoolingParams``
are a request's options (mirror vLLM's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank
GGUF_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}
# sentence-transformers' Pooling options -> ours; the others have no equivalent here
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolingParams:
    """A request's embedding options.

    ``dimensions``: keep the first N values (models trained for it: Matryoshka); ``normalize``: scale to
    unit length (None: the model's default); ``truncate_prompt_tokens``: keep only the last N prompt tokens
    (-1: as many as fit).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions: got {self.dimensions!r}; expected a positive integer or None")
        if self.normalize not in (None, True, False):
            raise ValueError(f"normalize: got {self.normalize!r}; expected True, False or None (the model's default)")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens: got {t!r}; expected a positive integer, -1 or None")


@dataclass(frozen=True)
class PoolerConfig:
    """How this model pools (see the module docstring); ``source`` says where that was read."""

    pooling_type: str = "LAST"
    normalize: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default"

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type: got {self.pooling_type!r} ({self.source}); supported: "
                             f"{', '.join(POOLING_TYPES)}")

    def check(self, params: PoolingParams, hidden_size: int) -> None:
        """Refuse options this model cannot honour (ValueError naming the option)."""
        d = params.dimensions
        if d is None or d == hidden_size:
            return
        if not self.is_matryoshka:
            raise ValueError(f"dimensions: got {d}; this model was not trained for shortened embeddings (no "
                             "is_matryoshka or matryoshka_dimensions in its config.json), so it returns only its "
                             f"full {hidden_size} values")
        if d > hidden_size:
            raise ValueError(f"dimensions: got {d}; this model's embeddings have {hidden_size} values")
        if self.matryoshka_dimensions and d not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions: got {d}; this model supports {list(self.matryoshka_dimensions)}")

    def finish(self, vectors: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """Pooled vectors ``[B, D]`` (float32) shortened and normalized as ``params`` and the model say."""
        if params.dimensions is not None:
            vectors = vectors[:, :params.dimensions]
        if self.normalize if params.normalize is None else params.normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        return vectors


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One float32 vector per sequence from the packed hidden states ``[T, D]`` of the sequences that
    ``cu_seqlens`` ``[B+1]`` (their offsets, on ``hidden``'s device) delimit."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    if pooling_type == "CLS":
        return hidden[starts].float()
    if pooling_type == "MEAN":
        lengths = ends - starts
        owner = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
        sums = torch.zeros((len(lengths), hidden.shape[1]), dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, owner, hidden.float())
        return sums / lengths[:, None].float()
    raise ValueError(f"pooling_type: got {pooling_type!r}; supported: {', '.join(POOLING_TYPES)}")


def pooler_config(config: dict, source: str, override: str | None = None) -> PoolerConfig:
    """The checkpoint's pooling: ``config`` is its HF config dict (a GGUF file's carries
    ``ninefold_pooling_type``), ``source`` its directory or file; ``override`` (a pooling type) wins."""
    kind, normalize, origin = "LAST", True, "default"
    directory = Path(source)
    if directory.is_dir() and (directory / "modules.json").is_file():
        kind, normalize, origin = _sentence_transformers(directory)
    elif config.get("ninefold_pooling_type") is not None:
        kind, origin = config["ninefold_pooling_type"], f"{source}: pooling_type"
    if override is not None:
        kind, origin = str(override).upper(), "pooling_type argument"
    dims = config.get("matryoshka_dimensions")
    if dims is not None and (not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims)):
        raise ValueError(f"{source}: matryoshka_dimensions: got {dims!r}; expected a list of positive integers")
    return PoolerConfig(pooling_type=kind, normalize=normalize,
                        is_matryoshka=bool(config.get("is_matryoshka")) or bool(dims),
                        matryoshka_dimensions=tuple(dims) if dims else None, source=origin)


def _sentence_transformers(directory: Path) -> tuple[str, bool, str]:
    """(pooling type, normalize, where) from a sentence-transformers model directory."""
    where = directory / "modules.json"
    modules = _json(where)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{where}: expected a list of modules (objects with 'type' and 'path')")
    kinds = [str(m.get("type", "")) for m in modules]
    normalize = any(k.endswith(".Normalize") for k in kinds)
    pooling = [m for m, k in zip(modules, kinds) if k.endswith(".Pooling")]
    if not pooling:
        return "LAST", normalize, str(where)
    config_file = directory / str(pooling[0].get("path", "")) / "config.json"
    options = _json(config_file)
    chosen = [name for name, on in options.items() if name.startswith("pooling_mode_") and on is True]
    if len(chosen) != 1 or chosen[0] not in _SENTENCE_TRANSFORMERS_MODES:
        raise ValueError(f"{config_file}: pooling modes {chosen or 'none'} are on; supported: exactly one of "
                         f"{', '.join(_SENTENCE_TRANSFORMERS_MODES)}")
    return _SENTENCE_TRANSFORMERS_MODES[chosen[0]], normalize, str(config_file)


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: not found (named by the model's modules.json)") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable JSON: {error}") from error
