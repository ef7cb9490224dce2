"""A byte-level recognizer of JSON that follows a JSON Schema (a subset), for ``response_format`` ``json_schema``.

Supported keywords: ``type`` (one type or a list), ``properties``, ``required``, ``additionalProperties``
(``false`` or absent: only the listed properties; on an object without ``properties`` any keys),
``items``, ``minItems``, ``maxItems``, ``enum``, ``const``, ``anyOf`` / ``oneOf`` (alternatives that start
with different bytes: an object, an array, a string, a number, ...), ``$ref`` to ``#/$defs/...`` or
``#/definitions/...`` (not recursive), and annotations (``title``, ``description``, ...). Anything
else (``pattern``, ``minLength``, ``format``, ...) is refused with a ``ValueError`` naming it, rather
than generating output that may break it.

Properties come in the schema's order; an optional one may be left out. Output is compact except for
whitespace between tokens (runs of at most ``MAX_WHITESPACE`` bytes). A state is a tuple of frames,
innermost last; the empty tuple means the value is complete.
"""

from __future__ import annotations

import json

from ninefold.llm.guided.json_machine import (
    DIGITS,
    ESCAPES,
    HEX,
    MAX_WHITESPACE,
    NUMBER_ENDS,
    WHITESPACE,
    number_next,
)

ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions", "name", "strict"))
_VALUE_FIRST = {"object": b"{", "array": b"[", "string": b'"', "number": b"-0123456789",
                "integer": b"-0123456789", "boolean": b"tf", "null": b"n"}
MAX_NODES = 2048


class SchemaMachine:
    """The compiled schema (a list of nodes) and the recognizer's step over it."""

    def __init__(self, schema: dict):
        self.key = ("json_schema", json.dumps(schema, sort_keys=True))
        self.nodes: list[tuple] = []
        # the nodes of values the schema leaves open: any value, any object, any array, the three literals
        self.any = self._add(("any",))
        self.any_object = self._add(("object", None, frozenset()))
        self.any_array = self._add(("array", self.any, 0, None))
        self.literals = self._add(("enum", (b"false", b"null", b"true")))
        if not isinstance(schema, dict) and schema is not True:
            raise ValueError(f"json_schema: the schema must be an object, got {type(schema).__name__}")
        defs = schema if isinstance(schema, dict) else {}
        self._defs = {**defs.get("definitions", {}), **defs.get("$defs", {})}
        root = self._compile(schema, "schema", ())
        self.start = (("value", root, 0),)

    # -- compiling -------------------------------------------------------------------------------

    def _add(self, node: tuple) -> int:
        if len(self.nodes) >= MAX_NODES:
            raise ValueError(f"json_schema: more than {MAX_NODES} nodes")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _compile(self, schema, where: str, refs: tuple) -> int:
        if schema is True or schema == {}:
            return self.any
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema: {where} must be an object, got {type(schema).__name__}")
        if "$ref" in schema:
            ref = schema["$ref"]
            name = ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None
            if (not isinstance(ref, str) or not ref.startswith(("#/$defs/", "#/definitions/"))
                    or name not in self._defs):
                raise ValueError(f"json_schema: {where}: $ref {ref!r} is not one of this schema's $defs")
            if ref in refs:
                raise ValueError(f"json_schema: {where}: recursive $ref {ref!r} is not supported")
            return self._compile(self._defs[name], f"{where} ({ref})", refs + (ref,))
        unknown = sorted(set(schema) - ANNOTATIONS - {"type", "properties", "required", "additionalProperties",
                                                      "items", "minItems", "maxItems", "enum", "const", "anyOf",
                                                      "oneOf"})
        if unknown:
            raise ValueError(f"json_schema: {where}: unsupported keyword(s) {', '.join(unknown)}")
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"json_schema: {where}: enum must be a non-empty list")
            members = tuple(sorted({json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode() for v in values}))
            return self._add(("enum", members))
        alternatives = schema.get("anyOf", schema.get("oneOf"))
        if alternatives is not None:
            if not isinstance(alternatives, list) or not alternatives:
                raise ValueError(f"json_schema: {where}: anyOf/oneOf must be a non-empty list")
            return self._union([self._compile({**{k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")},
                                                **a} if isinstance(a, dict) else a, f"{where}.anyOf[{i}]", refs)
                                for i, a in enumerate(alternatives)], where)
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise ValueError(f"json_schema: {where}: type must not be an empty list")
            return self._union([self._compile({**schema, "type": t}, f"{where} ({t})", refs) for t in kind], where)
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
            if kind is None:
                return self.any
        if kind not in _VALUE_FIRST:
            raise ValueError(f"json_schema: {where}: unknown type {kind!r}")
        if kind == "object":
            props = schema.get("properties")
            extra = schema.get("additionalProperties", props is None)
            if props is None:
                if extra is False:
                    return self._add(("enum", (b"{}",)))
                if extra not in (True, {}):
                    raise ValueError(f"json_schema: {where}: additionalProperties must be true or false here")
                return self.any_object
            if extra not in (False,) and "additionalProperties" in schema:
                raise ValueError(f"json_schema: {where}: additionalProperties must be false when properties are given")
            if not isinstance(props, dict):
                raise ValueError(f"json_schema: {where}: properties must be an object")
            required = schema.get("required", [])
            if not isinstance(required, list) or not set(required) <= set(props):
                raise ValueError(f"json_schema: {where}: required must list properties of this object")
            entries = []
            for name, sub in props.items():
                raw = json.dumps(name, ensure_ascii=False)[1:-1].encode()
                if raw != name.encode():
                    raise ValueError(f"json_schema: {where}: property name {name!r} needs escaping; not supported")
                entries.append((raw, self._compile(sub, f"{where}.{name}", refs)))
            return self._add(("object", tuple(entries), frozenset(i for i, (n, _) in enumerate(props.items())
                                                                  if n in required)))
        if kind == "array":
            items = self._compile(schema.get("items", True), f"{where}[]", refs)
            low, high = schema.get("minItems", 0), schema.get("maxItems", None)
            if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
                raise ValueError(f"json_schema: {where}: minItems/maxItems must be integers with 0 <= min <= max")
            return self._add(("array", items, low, high))
        if kind == "boolean":
            return self._add(("enum", (b"false", b"true")))
        if kind == "null":
            return self._add(("enum", (b"null",)))
        return self._add((kind,))

    def _union(self, alternatives: list[int], where: str) -> int:
        by_first: dict[int, int] = {}
        for alt in alternatives:
            for byte in self._first_bytes(alt):
                if by_first.setdefault(byte, alt) != alt:
                    raise ValueError(f"json_schema: {where}: alternatives that can start with the same byte "
                                     f"({chr(byte)!r}) are not supported")
        return self._add(("union", by_first))

    def _first_bytes(self, index: int) -> bytes:
        node = self.nodes[index]
        if node[0] == "any":
            return b'{["-0123456789tfn'
        if node[0] == "enum":
            return bytes(sorted({m[0] for m in node[1]}))
        if node[0] == "union":
            return bytes(node[1])
        return _VALUE_FIRST[node[0]]

    # -- recognizing -----------------------------------------------------------------------------

    def step(self, state: tuple, byte: int) -> tuple | None:
        """The state after ``byte``, or None when no schema-conforming value can continue with it."""
        if not state:
            return None
        frame = state[-1]
        rest = state[:-1]
        kind = frame[0]
        if kind == "value":
            if byte in WHITESPACE:
                return rest + (("value", frame[1], frame[2] + 1),) if frame[2] < MAX_WHITESPACE else None
            return self._begin(rest, frame[1], byte)
        if kind == "string":
            if byte == 0x22:
                return rest
            if byte == 0x5C:
                return rest + (("escape",),)
            return state if byte >= 0x20 else None
        if kind == "escape":
            if byte == 0x75:
                return rest + (("hex", 4),)
            return rest + (("string",),) if byte in ESCAPES else None
        if kind == "hex":
            if byte not in HEX:
                return None
            return rest + ((("string",),) if frame[1] == 1 else (("hex", frame[1] - 1),))
        if kind == "number":
            return self._number(rest, frame, byte)
        if kind == "enum":
            return self._enum(rest, frame, byte)
        if kind == "object":
            return self._object(rest, frame, byte)
        if kind == "key":
            return self._key(rest, frame, byte)
        if kind == "array":
            return self._array(rest, frame, byte)
        return None

    def advance(self, state: tuple | None, data: bytes) -> tuple | None:
        for byte in data:
            if state is None:
                return None
            state = self.step(state, byte)
        return state

    @staticmethod
    def complete(state) -> bool:
        return state == ()

    def may_end(self, state) -> bool:
        """Complete, or a top-level number or enum member that could also go on (the end token may come)."""
        if state == ():
            return True
        if len(state) != 1:
            return False
        frame = state[0]
        if frame[0] == "number":
            return frame[2] in NUMBER_ENDS
        return frame[0] == "enum" and frame[2] in self.nodes[frame[1]][1]

    @staticmethod
    def cache_key(state: tuple) -> tuple:
        return state

    @staticmethod
    def in_string(state) -> bool:
        return bool(state) and state[-1][0] == "string"

    def _begin(self, rest: tuple, index: int, byte: int) -> tuple | None:
        node = self.nodes[index]
        kind = node[0]
        if kind == "union":
            target = node[1].get(byte)
            return None if target is None else self._begin(rest, target, byte)
        if kind == "enum":
            return self._enum(rest, ("enum", index, b""), byte)
        if kind in ("string", "any") and byte == 0x22:
            return rest + (("string",),)
        if kind in ("number", "integer", "any") and (byte == 0x2D or byte in DIGITS):
            return rest + (("number", kind == "integer", "minus" if byte == 0x2D else "zero" if byte == 0x30
                            else "integer"),)
        if kind == "any" and byte in (0x74, 0x66, 0x6E):
            return self._enum(rest, ("enum", self.literals, b""), byte)
        if kind in ("object", "any") and byte == 0x7B:
            return rest + (("object", index if kind == "object" else self.any_object, "open", 0, 0),)
        if kind in ("array", "any") and byte == 0x5B:
            return rest + (("array", index if kind == "array" else self.any_array, "open", 0, 0),)
        return None

    def _enum(self, rest: tuple, frame: tuple, byte: int) -> tuple | None:
        members = self.nodes[frame[1]][1]
        prefix = frame[2] + bytes((byte,))
        if any(m.startswith(prefix) for m in members):
            if prefix in members and not any(len(m) > len(prefix) and m.startswith(prefix) for m in members):
                return rest  # a whole member nothing longer continues
            return rest + (("enum", frame[1], prefix),)
        if frame[2] in members and rest:  # a member that a longer one could have continued: it ends here
            return self.step(rest, byte)
        return None

    def _number(self, rest: tuple, frame: tuple, byte: int) -> tuple | None:
        _, integer, mode = frame
        nxt = number_next(mode, byte, integer)
        if nxt is not None:
            return rest + (("number", integer, nxt),)
        if mode not in NUMBER_ENDS or not rest:
            return None
        return self.step(rest, byte)  # the byte ends the number and belongs to what holds it

    def _object(self, rest: tuple, frame: tuple, byte: int) -> tuple | None:
        _, index, phase, pos, ws = frame
        _, props, required = self.nodes[index]
        if byte in WHITESPACE:
            return rest + (("object", index, phase, pos, ws + 1),) if ws < MAX_WHITESPACE else None
        if phase in ("open", "after") and byte == 0x7D:
            return rest if not any(i >= pos for i in required) else None
        if phase in ("open", "next") and byte == 0x22:
            if props is None:
                return rest + (("object", index, "colon", pos, 0), ("string",))
            if pos >= len(props):
                return None
            return rest + (("object", index, "colon", pos, 0), ("key", index, pos, b""))
        if phase == "after" and byte == 0x2C:
            return rest + (("object", index, "next", pos, 0),) if props is None or self._more(props, pos) else None
        if phase == "colon" and byte == 0x3A:
            value = self.any if props is None else props[pos][1]
            return rest + (("object", index, "after", pos + (props is not None), 0), ("value", value, 0))
        return None

    @staticmethod
    def _more(props: tuple, pos: int) -> bool:
        return pos < len(props)

    def _key(self, rest: tuple, frame: tuple, byte: int) -> tuple | None:
        _, index, pos, acc = frame
        _, props, required = self.nodes[index]
        candidates = []
        for i in range(pos, len(props)):  # optional properties may be skipped up to the next required one
            candidates.append(i)
            if i in required:
                break
        if byte == 0x22:
            for i in candidates:
                if props[i][0] == acc:
                    parent = rest[-1]  # the object frame, waiting in phase "colon" at the key's position
                    return rest[:-1] + (("object", parent[1], "colon", i, 0),)
            return None
        acc += bytes((byte,))
        if any(props[i][0].startswith(acc) for i in candidates):
            return rest + (("key", index, pos, acc),)
        return None

    def _array(self, rest: tuple, frame: tuple, byte: int) -> tuple | None:
        _, index, phase, count, ws = frame
        _, items, low, high = self.nodes[index]
        if byte in WHITESPACE:
            return rest + (("array", index, phase, count, ws + 1),) if ws < MAX_WHITESPACE else None
        if byte == 0x5D and phase in ("open", "after"):
            return rest if count >= low else None
        if phase == "after":
            if byte == 0x2C and (high is None or count < high):
                return rest + (("array", index, "next", count, 0),)
            return None
        if phase == "open" and high == 0:
            return None
        held = rest + (("array", index, "after", count + 1, 0),)
        return self._begin(held, items, byte)

