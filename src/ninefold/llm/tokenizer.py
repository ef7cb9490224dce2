"""Tokenizer: ``tokenizers`` for encode/decode, jinja2 for chat templates.

Built from a Hugging Face directory (``tokenizer.json`` + ``tokenizer_config.json``) or from a
``tokenizers.Tokenizer`` and a tokenizer_config dict (what the GGUF loader returns).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as ``{"content": ...}`` dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode, decode and render chat templates for one model."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, tokenizer_config: dict | None = None):
        if not isinstance(tokenizer, tokenizers.Tokenizer):
            raise TypeError(f"tokenizer: expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        self._tk = tokenizer
        self.config = dict(tokenizer_config or {})
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.bos_token_id = self._tk.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tk.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) from a directory."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in {path}")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        chat_file = path / "chat_template.jinja"
        if "chat_template" not in config and chat_file.is_file():
            config["chat_template"] = chat_file.read_text()
        return cls(tokenizers.Tokenizer.from_file(str(file)), config)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special."""
        decoder = self._tk.get_added_tokens_decoder()
        return frozenset(i for i, tok in decoder.items() if tok.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS token is added when the model uses one."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        ids = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id."""
        return self._tk.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template (text, or token ids with ``tokenize``)."""
        if not self.chat_template:
            raise ValueError("chat_template: this model's tokenizer_config has no chat template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages: expected a list of dicts with 'role' and 'content'")
        if not messages:
            raise ValueError("messages: an empty conversation (expected at least one message)")
        special = {
            key: _token_text(value)
            for key, value in self.config.items()
            if key.endswith("_token") and _token_text(value) is not None
        }
        text = _compiled(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special, **kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


_TEMPLATES: dict[str, Any] = {}


def _compiled(template: str):
    if template not in _TEMPLATES:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[template] = env.from_string(template)
    return _TEMPLATES[template]
