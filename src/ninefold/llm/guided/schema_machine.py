"""A byte-level recognizer of JSON that follows a JSON Schema (a subset), for ``response_format`` ``json_schema``.

Supported keywords: ``type`` (one type or a list), ``properties``, ``required``, ``additionalProperties``
(``false`` or absent: only the listed properties; on an object without ``properties``, true: any keys,
false: ``{}``), ``items``, ``minItems``, ``maxItems``, ``enum``, ``const``, ``anyOf`` / ``oneOf``,
``$ref`` to ``#/$defs/NAME`` or ``#/definitions/NAME`` (not recursive), and annotations (``title``,
``description``, ...). Anything else (``pattern``, ``minLength``, ``format``, ...) is refused with a
``ValueError`` naming it, rather than generating output that may break it.

Restrictions, each refused rather than half-honoured: ``enum``, ``const``, ``anyOf``, ``oneOf`` and
``$ref`` stand alone (no other keywords beside them but annotations; ``type`` beside ``enum``/``const`` keeps the
members of that type; an enum holds at most ``MAX_ENUM_MEMBERS`` members, and all enums at most ``MAX_ENUM_BYTES``
bytes); anyOf/oneOf alternatives must
start with different bytes, except objects told apart by a discriminator (their first property, required
in each, named alike, whose const/enum strings differ: how tool calls and tagged unions look); keywords of another type (``items`` on an object, ...) and ``required``
without ``properties`` are refused; ``$id`` only at the root. What is generated is narrower than what
the schema allows: properties come in the schema's order (an optional one may be left out), no
additional properties, integers without fraction or exponent, property names that need no escaping,
enum members in compact JSON. Whitespace between tokens comes in runs of at most ``MAX_WHITESPACE``
bytes. A state is a tuple of frames, innermost last; the empty tuple means the value is complete.
"""

from __future__ import annotations

import json
from bisect import bisect_left

from ninefold.llm.guided.json_machine import (
    DIGITS,
    ESCAPES,
    HEX,
    MAX_WHITESPACE,
    NUMBER_ENDS,
    WHITESPACE,
    number_next,
    steps,
)

ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions"))
_VALUE_FIRST = {"object": b"{", "array": b"[", "string": b'"', "number": b"-0123456789",
                "integer": b"-0123456789", "boolean": b"tf", "null": b"n"}
MAX_NODES = 2048
MAX_WORK = 8192  # subschemas compiled, at most
MAX_DEPTH = 64
MAX_ENUM_MEMBERS = 1024  # one enum's members (as guided choice's MAX_CHOICES)
MAX_ENUM_BYTES = 1 << 16  # all enum members of a schema together, compact JSON (as MAX_CHOICE_BYTES)
SUPPORTED = frozenset(("type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                       "enum", "const", "anyOf", "oneOf", "$ref"))
_FOR_OBJECTS = frozenset(("properties", "required", "additionalProperties"))
_FOR_ARRAYS = frozenset(("items", "minItems", "maxItems"))


def _compact(value, where: str) -> bytes:
    """``value`` as the recognizer matches it: compact JSON, UTF-8, no NaN or infinities."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError, UnicodeEncodeError) as error:
        raise ValueError(f"json_schema: {where}: {value!r} is not a JSON value this can match ({error})") from None


def _is_member(members: tuple, value: bytes) -> bool:
    """Whether ``value`` is one of the sorted ``members`` (a binary search)."""
    i = bisect_left(members, value)
    return i < len(members) and members[i] == value


def _has_type(value, kind: str) -> bool:
    """Whether a JSON value is of a JSON Schema type (an integer is a number without a fraction)."""
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "object": dict, "array": list}
    return value is None if kind == "null" else isinstance(value, kinds[kind])


class SchemaMachine:
    """The compiled schema (a list of nodes) and the recognizer's step over it."""

    def __init__(self, schema: dict):
        self.nodes: list[tuple] = []
        self._work = 0
        self._enum_bytes = 0  # enum members compiled so far, compact JSON bytes
        # the nodes of values the schema leaves open: any value, any object, any array, the three literals
        self.any = self._add(("any",))
        self.any_object = self._add(("object", None, frozenset()))
        self.any_array = self._add(("array", self.any, 0, None))
        self.literals = self._add(("enum", (b"false", b"null", b"true")))
        if not isinstance(schema, dict) and schema is not True:
            raise ValueError(f"json_schema: the schema must be an object, got {type(schema).__name__}")
        root = schema if isinstance(schema, dict) else {}
        self._defs = {}
        for container in ("$defs", "definitions"):
            defs = root.get(container, {})
            if not isinstance(defs, dict):
                raise ValueError(f"json_schema: {container} must be an object, got {type(defs).__name__}")
            self._defs[container] = defs
        root_node = self._compile(schema, "schema", (), 0)
        self.start = (("value", root_node, 0),)
        # property order matters to the recognizer, so the key keeps the schema's own order
        try:
            self.key = ("json_schema", json.dumps(schema))
        except (TypeError, ValueError, RecursionError) as error:  # an annotation holding a non-JSON value
            raise ValueError(f"guided_decoding.json: the schema is not JSON ({str(error)[:200]}); expected JSON "
                             "values only (dicts, lists, strings, numbers, booleans, None)") from None

    # -- compiling -------------------------------------------------------------------------------

    def _add(self, node: tuple) -> int:
        if len(self.nodes) >= MAX_NODES:
            raise ValueError(f"json_schema: more than {MAX_NODES} nodes")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _compile(self, schema, where: str, refs: tuple, depth: int) -> int:
        self._work += 1
        if self._work > MAX_WORK or depth > MAX_DEPTH:
            raise ValueError(f"json_schema: too large or too deeply nested (at {where})")
        if schema is True or schema == {}:
            return self.any
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema: {where} must be an object or true, got {type(schema).__name__}")
        keywords = set(schema) - ANNOTATIONS
        unknown = sorted(keywords - SUPPORTED)
        if unknown:
            raise ValueError(f"json_schema: {where}: unsupported keyword(s) {', '.join(unknown)}")
        if "$id" in schema and depth:
            raise ValueError(f"json_schema: {where}: $id below the root is not supported")
        alone = [k for k in ("$ref", "enum", "const", "anyOf", "oneOf") if k in schema]
        if alone:
            if alone[0] in ("enum", "const") and keywords == {alone[0], "type"}:
                return self._compile_typed_enum(schema, alone[0], where)
            if len(keywords) > 1:
                raise ValueError(f"json_schema: {where}: {alone[0]} beside {', '.join(sorted(keywords - {alone[0]}))} "
                                 "is not supported")
            return getattr(self, "_compile_" + alone[0].strip("$").lower())(schema, where, refs, depth)
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind or not all(isinstance(t, str) for t in kind):
                raise ValueError(f"json_schema: {where}: type must be a string or a non-empty list of strings")
            alternatives = [self._compile({**schema, "type": t}, f"{where} ({t})", refs, depth + 1) for t in kind]
            return self._union(alternatives, where, distinct=True)
        if kind is None:
            if "type" in schema:
                raise ValueError(f"json_schema: {where}: type must be a string or a non-empty list of strings")
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
            if kind is None:
                if keywords:
                    raise ValueError(f"json_schema: {where}: {', '.join(sorted(keywords))} need a type (or "
                                     "properties / items)")
                return self.any
        if not isinstance(kind, str) or kind not in _VALUE_FIRST:
            raise ValueError(f"json_schema: {where}: unknown type {kind!r}")
        misplaced = sorted(keywords & (_FOR_OBJECTS if kind != "object" else set())
                           | keywords & (_FOR_ARRAYS if kind != "array" else set()))
        if misplaced:
            raise ValueError(f"json_schema: {where}: {', '.join(misplaced)} on a {kind} is not supported")
        if kind == "object":
            return self._compile_object(schema, where, refs, depth)
        if kind == "array":
            items = self._compile(schema.get("items", True), f"{where}[]", refs, depth + 1)
            low, high = schema.get("minItems", 0), schema.get("maxItems", None)
            if (type(low) is not int or low < 0 or ("maxItems" in schema and type(high) is not int)
                    or (high is not None and high < low)):
                raise ValueError(f"json_schema: {where}: minItems/maxItems must be integers with 0 <= min <= max")
            return self._add(("array", items, low, high))
        if kind == "boolean":
            return self._add(("enum", (b"false", b"true")))
        if kind == "null":
            return self._add(("enum", (b"null",)))
        return self._add((kind,))

    def _compile_object(self, schema: dict, where: str, refs: tuple, depth: int) -> int:
        props = schema.get("properties")
        extra = schema.get("additionalProperties", props is None)
        if not (extra is True or extra is False or (isinstance(extra, dict) and not extra)):
            raise ValueError(f"json_schema: {where}: additionalProperties must be true or false")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"json_schema: {where}: required must be a list of property names")
        if props is None:
            if required:
                raise ValueError(f"json_schema: {where}: required needs properties listing them")
            return self.any_object if extra is not False else self._add(("object", (), frozenset()))
        if extra is not False and "additionalProperties" in schema:
            raise ValueError(f"json_schema: {where}: additionalProperties must be false when properties are given")
        if not isinstance(props, dict) or not all(isinstance(n, str) for n in props):
            raise ValueError(f"json_schema: {where}: properties must be an object")
        if not set(required) <= set(props):
            raise ValueError(f"json_schema: {where}: required must list properties of this object")
        entries = []
        for name, sub in props.items():
            raw = _compact(name, f"{where}: property name")[1:-1]
            if raw != name.encode("utf-8", "surrogatepass"):
                raise ValueError(f"json_schema: {where}: property name {name!r} needs escaping; not supported")
            entries.append((raw, self._compile(sub, f"{where}.{name}", refs, depth + 1)))
        return self._add(("object", tuple(entries), frozenset(i for i, n in enumerate(props) if n in required)))

    def _compile_ref(self, schema: dict, where: str, refs: tuple, depth: int) -> int:
        ref = schema["$ref"]
        parts = ref.split("/") if isinstance(ref, str) else []
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in self._defs:
            raise ValueError(f"json_schema: {where}: $ref {ref!r} is not one of this schema's $defs/definitions")
        name = parts[2].replace("~1", "/").replace("~0", "~")
        if name not in self._defs[parts[1]]:
            raise ValueError(f"json_schema: {where}: $ref {ref!r} is not one of this schema's $defs/definitions")
        if ref in refs:
            raise ValueError(f"json_schema: {where}: recursive $ref {ref!r} is not supported")
        return self._compile(self._defs[parts[1]][name], f"{where} ({ref})", refs + (ref,), depth + 1)

    def _compile_enum(self, schema: dict, where: str, refs: tuple, depth: int) -> int:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError(f"json_schema: {where}: enum must be a non-empty list")
        return self._add_enum(values, "enum", where)

    def _compile_typed_enum(self, schema: dict, keyword: str, where: str) -> int:
        """``enum``/``const`` beside ``type``: the members that also have one of the types."""
        values = schema["enum"] if keyword == "enum" else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise ValueError(f"json_schema: {where}: enum must be a non-empty list")
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not kinds or not all(isinstance(k, str) and k in _VALUE_FIRST for k in kinds):
            raise ValueError(f"json_schema: {where}: type must be one of {', '.join(_VALUE_FIRST)} or a list of them")
        kept = [v for v in values if any(_has_type(v, k) for k in kinds)]
        if not kept:
            raise ValueError(f"json_schema: {where}: no {keyword} value is of type {schema['type']!r}")
        return self._add_enum(kept, keyword, where)

    def _add_enum(self, values: list, keyword: str, where: str) -> int:
        """An enum node of ``values`` as sorted compact JSON, within MAX_ENUM_MEMBERS and MAX_ENUM_BYTES."""
        if len(values) > MAX_ENUM_MEMBERS:
            raise ValueError(f"json_schema: {where}: {keyword} has {len(values)} members; at most {MAX_ENUM_MEMBERS}")
        members = tuple(sorted({_compact(v, f"{where}: {keyword}") for v in values}))
        self._enum_bytes += sum(map(len, members))
        if self._enum_bytes > MAX_ENUM_BYTES:
            raise ValueError(f"json_schema: {where}: {keyword}: {self._enum_bytes} bytes of enum members in the "
                             f"schema (compact JSON); at most {MAX_ENUM_BYTES}")
        return self._add(("enum", members))

    def _compile_const(self, schema: dict, where: str, refs: tuple, depth: int) -> int:
        return self._add(("enum", (_compact(schema["const"], f"{where}: const"),)))

    def _compile_anyof(self, schema: dict, where: str, refs: tuple, depth: int) -> int:
        return self._alternatives(schema["anyOf"], "anyOf", where, refs, depth)

    def _compile_oneof(self, schema: dict, where: str, refs: tuple, depth: int) -> int:
        return self._alternatives(schema["oneOf"], "oneOf", where, refs, depth)

    def _alternatives(self, alternatives, name: str, where: str, refs: tuple, depth: int) -> int:
        if not isinstance(alternatives, list) or not alternatives:
            raise ValueError(f"json_schema: {where}: {name} must be a non-empty list")
        nodes = [self._compile(a, f"{where}.{name}[{i}]", refs, depth + 1) for i, a in enumerate(alternatives)]
        return self._union(nodes, where, distinct=True)

    def _union(self, alternatives: list[int], where: str, distinct: bool) -> int:
        if distinct and len(set(alternatives)) != len(alternatives):
            raise ValueError(f"json_schema: {where}: alternatives that accept the same values are not supported")
        objects = [alt for alt in alternatives if self.nodes[alt][0] == "object"]
        tagged = self._tagged(objects) if len(objects) > 1 else None
        by_first: dict[int, int] = {}
        for alt in alternatives:
            target = tagged if tagged is not None and alt in objects else alt  # the objects share the tagged node
            for byte in b"{" if target == tagged else self._first_bytes(alt):
                if by_first.setdefault(byte, target) != target:
                    hint = (" (objects are told apart only by a discriminator: a first property, required in each, "
                            "whose const or enum strings differ)") if byte == 0x7B else ""
                    raise ValueError(f"json_schema: {where}: alternatives that can start with the same byte "
                                     f"({chr(byte)!r}) are not supported{hint}")
        return self._add(("union", by_first))

    def _tagged(self, objects: list[int]) -> int | None:
        """A node for objects told apart by their first property (a discriminator: required in each, the same
        name, const/enum strings that differ), or None when they are not."""
        members: dict[bytes, int] = {}
        key = None
        for alt in objects:
            _, props, required = self.nodes[alt]
            if not props or 0 not in required or (key is not None and props[0][0] != key):
                return None
            key = props[0][0]
            tag = self.nodes[props[0][1]]
            if tag[0] != "enum" or not all(m[:1] == b'"' for m in tag[1]):
                return None
            for member in tag[1]:
                if members.setdefault(member, alt) != alt:
                    return None
        return self._add(("tagged", key, members))

    def _first_bytes(self, index: int) -> bytes:
        node = self.nodes[index]
        if node[0] == "any":
            return b'{["-0123456789tfn'
        if node[0] == "enum":
            return bytes(sorted({m[0] for m in node[1]}))
        if node[0] == "union":
            return bytes(node[1])
        if node[0] == "tagged":
            return b"{"
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
        if kind == "tagged":
            return self._tagged_step(rest, frame, byte)
        return None

    def advance(self, state: tuple | None, data: bytes) -> tuple | None:
        return steps(self.step, state, data)

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
        return frame[0] == "enum" and _is_member(self.nodes[frame[1]][1], frame[2])

    def cache_key(self, state: tuple) -> tuple:
        """``state`` with each unbounded array's element count capped at its minimum (past it, more elements
        change nothing), so masks are shared along a long array."""
        out = []
        for frame in state:
            if frame[0] == "array" and self.nodes[frame[1]][3] is None:
                low = self.nodes[frame[1]][2]
                if frame[3] > low:
                    frame = frame[:3] + (low,) + frame[4:]
            out.append(frame)
        return tuple(out)

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
        if kind == "tagged":
            return rest + (("tagged", index, "open", b"", 0),) if byte == 0x7B else None
        if kind in ("object", "any") and byte == 0x7B:
            return rest + (("object", index if kind == "object" else self.any_object, "open", 0, 0),)
        if kind in ("array", "any") and byte == 0x5B:
            return rest + (("array", index if kind == "array" else self.any_array, "open", 0, 0),)
        return None

    def _enum(self, rest: tuple, frame: tuple, byte: int) -> tuple | None:
        members = self.nodes[frame[1]][1]  # sorted: the members starting with a prefix are a run from bisect_left
        prefix = frame[2] + bytes((byte,))
        i = bisect_left(members, prefix)
        if i < len(members) and members[i].startswith(prefix):
            if members[i] == prefix and not (i + 1 < len(members) and members[i + 1].startswith(prefix)):
                return rest  # a whole member nothing longer continues
            return rest + (("enum", frame[1], prefix),)
        if rest and _is_member(members, frame[2]):  # a member that a longer one could have continued: it ends here
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

    def _tagged_step(self, rest: tuple, frame: tuple, byte: int) -> tuple | None:
        """``{ "key" : "member"`` of a tagged union; once the member is whole, the rest is its object's."""
        _, index, phase, acc, ws = frame
        _, key, members = self.nodes[index]
        if phase in ("open", "colon", "value") and byte in WHITESPACE:
            return rest + (("tagged", index, phase, acc, ws + 1),) if ws < MAX_WHITESPACE else None
        if phase == "open":
            return rest + (("tagged", index, "key", b"", 0),) if byte == 0x22 else None
        if phase == "key":
            if byte == 0x22:
                return rest + (("tagged", index, "colon", b"", 0),) if acc == key else None
            acc += bytes((byte,))
            return rest + (("tagged", index, "key", acc, 0),) if key.startswith(acc) else None
        if phase == "colon":
            return rest + (("tagged", index, "value", b"", 0),) if byte == 0x3A else None
        acc += bytes((byte,))
        if acc in members:  # JSON strings are prefix-free, so the member is decided
            return rest + (("object", members[acc], "after", 1, 0),)
        return rest + (("tagged", index, "member", acc, 0),) if any(m.startswith(acc) for m in members) else None
