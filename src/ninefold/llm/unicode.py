"""Checks that text is valid Unicode.

JSON's ``"\\ud800"`` escape decodes to a lone UTF-16 surrogate: a Python string that no UTF-8 encoder, tokenizer
or model output can hold. Everything that takes text from a client checks it here.
"""

from __future__ import annotations

from typing import Any

UNPAIRED_SURROGATE = "holds an unpaired UTF-16 surrogate, which is not valid Unicode"


def is_valid_unicode(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form (no unpaired surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def first_invalid_string(value: Any) -> str | None:
    """The first string in ``value`` (nested lists, tuples and dicts, keys too) that is not valid Unicode, else
    None."""
    if isinstance(value, str):
        return None if is_valid_unicode(value) else value
    items = ()
    if isinstance(value, dict):
        items = (x for pair in value.items() for x in pair)
    elif isinstance(value, (list, tuple)):
        items = value
    for item in items:
        found = first_invalid_string(item)
        if found is not None:
            return found
    return None
