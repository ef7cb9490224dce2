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


def _default_template(template: Any) -> str | None:
    """The default chat template of a ``chat_template`` entry: a string, a list of
    ``{"name": ..., "template": ...}`` (tokenizer_config.json) or a ``{name: template}`` dict."""
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template else None


def read_json_object(file: Path) -> dict:
    """A JSON file that must hold an object; ValueError naming the file otherwise."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object, got a {type(value).__name__}")
    return value


def read_tokenizer_file(file: str | Path) -> tokenizers.Tokenizer:
    """``tokenizers.Tokenizer.from_file``, with an error naming the file when it cannot be read."""
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{file}: not a valid tokenizer.json for the tokenizers library ({error})") from error


def read_tokenizer_dir(path: str | Path) -> tuple[tokenizers.Tokenizer, dict]:
    """The tokenizer and tokenizer config (chat templates included) of a directory given apart from the model
    (``EngineConfig.tokenizer``, vLLM's ``--tokenizer``); ValueError naming ``tokenizer`` when it holds none."""
    root = Path(path)
    if not (root / "tokenizer.json").is_file():
        what = "a directory without tokenizer.json" if root.is_dir() else "not a directory"
        raise ValueError(f"tokenizer: {str(path)!r} is {what}; expected a Hugging Face tokenizer directory "
                         "(tokenizer.json, and tokenizer_config.json for special tokens and the chat template)")
    return read_tokenizer_file(root / "tokenizer.json"), read_tokenizer_config(root)


def read_tokenizer_config(path: str | Path) -> dict:
    """``tokenizer_config.json`` of a model directory (``{}`` when absent) with its chat templates.

    As transformers reads them, templates saved beside the config take priority over its
    ``chat_template`` entry: ``chat_template.jinja`` (the default) and
    ``additional_chat_templates/<name>.jinja`` (named ones; several templates come back as the
    ``[{"name", "template"}]`` list tokenizer_config.json uses). A ``chat_template.json``
    (``{"chat_template": ...}``, what processors save) is used only when nothing else gives one.
    """
    path = Path(path)
    config_file = path / "tokenizer_config.json"
    config = read_json_object(config_file) if config_file.is_file() else {}
    entry = config.get("chat_template")
    if isinstance(entry, list):
        templates = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
    elif isinstance(entry, dict):
        templates = dict(entry)
    else:
        templates = {"default": entry} if isinstance(entry, str) and entry else {}
    default_file = path / "chat_template.jinja"
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    legacy = path / "chat_template.json"
    if not templates and legacy.is_file():
        value = read_json_object(legacy).get("chat_template")
        if isinstance(value, str) and value:
            templates["default"] = value
    if list(templates) == ["default"]:
        config["chat_template"] = templates["default"]
    elif templates:
        config["chat_template"] = [{"name": name, "template": text} for name, text in templates.items()]
    return config


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
        self.chat_template: str | None = _default_template(self.config.get("chat_template"))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) from a directory."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in {path}")
        return cls(read_tokenizer_file(file), read_tokenizer_config(path))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special."""
        decoder = self._tk.get_added_tokens_decoder()
        return frozenset(i for i, tok in decoder.items() if tok.special)

    @cached_property
    def byte_level(self) -> bool:
        """Whether the vocabulary is byte-level BPE (GPT-2's byte alphabet, a ``ByteLevel`` decoder)."""
        try:
            decoder = json.loads(self._tk.to_str()).get("decoder")
        except (ValueError, TypeError):
            return False
        return '"ByteLevel"' in json.dumps(decoder)

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
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template (text, or token ids with ``tokenize``).

        ``continue_final_message`` (as in transformers): the text stops right after the last message's
        content, without what the template closes a turn with, so the model continues that message (an
        assistant reply begun by the caller); it excludes ``add_generation_prompt``."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt (set it False)")
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
        def render(conversation: list[dict]) -> str:
            return _compiled(self.chat_template).render(
                messages=conversation, add_generation_prompt=add_generation_prompt, **{**special, **kwargs}
            )

        text = _open_final_message(render, messages) if continue_final_message else render(messages)
        return self.encode(text, add_special_tokens=False) if tokenize else text


_CONTINUE_MARK = "\u2063ninefold-continue-here\u2063"  # (invisible separators around it: text never holds it)


def _open_final_message(render, messages: list[dict]) -> str:
    """The conversation rendered up to the end of the last message's text, its turn left open: the template
    renders that text with a mark after it and the output is cut at the mark (content parts: the last text
    part). Where the template trims the text's trailing spaces, the cut text is trimmed too."""
    final = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, list):  # OpenAI content parts: the last text part is continued
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        texts = [i for i, p in enumerate(parts) if isinstance(p, dict) and isinstance(p.get("text"), str)]
        text = parts[texts[-1]]["text"] if texts else ""
        if texts:
            parts[texts[-1]]["text"] = text + _CONTINUE_MARK
        final["content"] = parts
    else:
        text = content if isinstance(content, str) else ""
        final["content"] = text + _CONTINUE_MARK
    if not text.strip():
        raise ValueError("continue_final_message: the final message has no text to continue")
    marked = render([*messages[:-1], final])
    at = marked.rfind(_CONTINUE_MARK)
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not show the final message's text as given")
    head = marked[:at]
    if text != text.rstrip() and text not in render(messages):  # the template trims the text's end
        head = head.rstrip()
    return head


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """The chat templates' ``tojson`` filter, with transformers' arguments and defaults."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_tag():
    """The ``{% generation %}...{% endgeneration %}`` block of transformers' chat templates (it marks the
    assistant's tokens for training masks): rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


_TEMPLATES: dict[str, Any] = {}


def _compiled(template: str):
    if template not in _TEMPLATES:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _generation_tag()]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[template] = env.from_string(template)
    return _TEMPLATES[template]
