"""Guided decoding to JSON following a JSON Schema: instances generated from random schemas are accepted,
whatever the recognizer calls complete validates under ``jsonschema`` (an independent implementation),
unsupported schemas are refused by name, masks match a brute-force check, and the engine's outputs validate."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninefold import LLM, GuidedDecodingParams, SamplingParams
from ninefold.llm.guided import SchemaMachine, TokenMasks, schema_machine

jsonschema = pytest.importorskip("jsonschema")  # a dev dependency; where it is missing, skip rather than error

NAMES = st.text(alphabet="abcxyz_", min_size=1, max_size=5)
SCALARS = st.none() | st.booleans() | st.integers(-999, 999) | st.text(alphabet="ab é\"\\", max_size=4)


def _schemas():
    leaf = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                            {"type": "null"}, {}, {"type": ["string", "null"]}, {"type": ["integer", "array"]}]) | \
        st.lists(SCALARS, min_size=1, max_size=3).map(lambda v: {"enum": v}) | SCALARS.map(lambda v: {"const": v})

    def extend(inner):
        objects = st.dictionaries(NAMES, inner, max_size=4).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)) if props else st.nothing(), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req}))
        arrays = st.tuples(inner, st.integers(0, 2), st.integers(0, 3)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
        return objects | arrays

    return st.recursive(leaf, extend, max_leaves=8)


def _instance(schema, rng: random.Random):
    """A value following ``schema`` (properties in schema order)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return _instance({**schema, "type": rng.choice(kind)}, rng)
    if kind == "object":
        return {k: _instance(v, rng) for k, v in schema["properties"].items()
                if k in schema.get("required", []) or rng.random() < 0.5}
    if kind == "array":
        n = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [_instance(schema.get("items", {}), rng) for _ in range(n)]
    if kind == "string":
        return rng.choice(["", "x", "é\\\"", "a b"])
    if kind == "integer":
        return rng.randint(-50, 50)
    if kind == "number":
        return rng.choice([0, -1.5, 2e20, 3.25])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return rng.choice([None, 1, "s", [1, {"k": [True]}], {"a": {"b": None}}])


def _valid(text: str, schema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@settings(max_examples=150, deadline=None)
@given(_schemas(), st.integers(0, 10**6), st.sampled_from([None, 1]))
def test_instances_of_random_schemas_are_accepted_and_complete(schema, seed, indent):
    schema = {"type": "object", "properties": {"root": schema}, "required": ["root"]}
    machine = SchemaMachine(schema)
    text = json.dumps(_instance(schema, random.Random(seed)), indent=indent, ensure_ascii=False)
    if indent is not None and any(k in json.dumps(schema) for k in ('"enum"', '"const"')):
        text = json.dumps(json.loads(text), ensure_ascii=False)  # enum members are matched in compact form
    state = machine.advance(machine.start, text.encode())
    assert state is not None and machine.complete(state), text


@settings(max_examples=300, deadline=None)
@given(_schemas(), st.integers(0, 10**6), st.data())
def test_whatever_the_recognizer_calls_complete_validates(schema, seed, data):
    schema = {"type": "object", "properties": {"root": schema, "n": {"type": "integer"}}, "required": ["root"]}
    machine = SchemaMachine(schema)
    chars = list(json.dumps(_instance(schema, random.Random(seed)), ensure_ascii=False))
    for _ in range(data.draw(st.integers(1, 3))):
        position = data.draw(st.integers(0, len(chars) - 1))
        chars[position] = data.draw(st.sampled_from(list('{}[]",:0123456789.e-tfnul x')))
    text = "".join(chars)
    state = machine.advance(machine.start, text.encode())
    if state is not None and machine.complete(state):
        assert _valid(text, schema), text


@pytest.mark.parametrize("schema, word", [
    ({"type": "string", "pattern": "a"}, "pattern"), ({"type": "string", "minLength": 2}, "minLength"),
    ({"$ref": "#/$defs/n", "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}, "recursive"),
    ({"$ref": "#/$defs/missing"}, "is not one of"), ({"anyOf": [{"type": "integer"}, {"type": "number"}]}, "same byte"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems"), ({"type": "object", "properties": {"a\"": {}}},
                                                                     "escaping"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"), ({"type": "date"}, "type"),
])
def test_unsupported_or_broken_schemas_are_refused_by_name(schema, word):
    with pytest.raises(ValueError, match=word):
        GuidedDecodingParams(json=schema)


def test_defs_references_are_followed():
    schema = {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"],
              "$defs": {"point": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}}}
    machine = GuidedDecodingParams(json=json.dumps(schema)).machine()
    assert machine.complete(machine.advance(machine.start, b'{"p":[1,2.5]}'))
    assert machine.advance(machine.start, b'{"p":[1,2,3') is None


def test_optional_properties_may_be_skipped_but_order_is_the_schemas():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                "c": {"type": "integer"}}, "required": ["c"]}
    m = SchemaMachine(schema)
    for text, ok in (('{"c":1}', True), ('{"a":1,"c":2}', True), ('{"b":1,"c":2}', True), ('{"c":1,"a":2}', False),
                     ('{"a":1}', False), ('{"a":1,"b":2,"c":3}', True)):
        state = m.advance(m.start, text.encode())
        assert (state is not None and m.complete(state)) == ok, text


VOCAB = [None, b"{", b"}", b'"', b'":', b"a", b"ab", b"1", b"12", b"-", b".", b"5e", b"[", b"]", b",", b" ", b'{"a',
         b'{"a":', b"true", b"nu", b"ll", b"x", b'"x"', b'"}', b"]}", b"}]", b'b":', b'c":', b"c"]


def test_masks_match_a_brute_force_check_along_random_walks():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, 12, "x"]}},
                                               "b": {"type": ["integer", "null"]}, "c": {}}, "required": ["a"]}
    checked, _ = _walk_against_brute_force(SchemaMachine(schema), VOCAB, random.Random(0))
    assert checked == 400


def _walk_against_brute_force(machine, vocab, rng, steps: int = 400) -> tuple[int, int]:
    """Walk random allowed tokens, checking each state's mask against every token; returns (states checked,
    outputs completed)."""
    table = TokenMasks(vocab, len(vocab))
    state, checked, completed = machine.start, 0, 0
    for _ in range(steps):
        brute = [i for i, data in enumerate(vocab) if data and machine.advance(state, data) is not None]
        assert table.allowed(machine, state) == brute, state
        checked += 1
        if not brute or machine.complete(state):
            completed += machine.complete(state)
            state = machine.start
            continue
        state = machine.advance(state, vocab[rng.choice(brute)])
    return checked, completed


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=256)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {
                                               "enum": ["a", "b"]}, "maxItems": 2}}, "required": ["n", "ok"]}


def test_engine_outputs_follow_the_schema_or_are_cut_by_max_tokens(llm):
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json=SCHEMA), temperature=1.0, seed=3, n=6,
                            max_tokens=48)
    machine = SchemaMachine(SCHEMA)
    stopped = 0
    for out in llm.generate(["JSON:", "x"], params):
        for c in out.outputs:
            state = machine.advance(machine.start, c.text.encode())
            assert state is not None, c.text
            if c.finish_reason == "stop":
                assert _valid(c.text, SCHEMA), c.text
                stopped += 1
            else:
                assert c.finish_reason == "length" and not machine.complete(state)
    biased = SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"]}), temperature=0, max_tokens=200)
    c = llm.generate(["x"], biased)[0].outputs[0]
    assert c.finish_reason == "stop" and json.loads(c.text)["ok"] in (True, False)


@pytest.mark.parametrize("schema", [
    {"type": "integer", "enum": ["a", 1.5, True]}, {"type": "string", "const": 1}, {"type": "text", "enum": ["a"]},
    {"type": [], "enum": ["a"]}, {"type": "string", "enum": []}, {"const": 1, "enum": [2]}, {"type": "integer", "anyOf": [{"type": "string"}]},
    {"anyOf": [{"type": "string"}], "oneOf": [{"type": "integer"}]}, {"oneOf": [{}, {}]},
    {"oneOf": [{"type": "object"}, {"type": "object", "title": "t"}]}, {"type": "object", "required": ["a"]},
    {"required": ["a"]}, {"minItems": 2}, {"maxItems": 0}, {"additionalProperties": False},
    {"$defs": {"a": {"type": "array"}}, "$ref": "#/$defs/a", "maxItems": 1},
    {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "minLength": 3},
    {"definitions": {"x": {"type": "string"}}, "$defs": {"y": {}}, "$ref": "#/$defs/x"},
    {"$defs": {"a": {"properties": {"b": {}}}}, "$ref": "#/$defs/a/properties/b"},
    {"properties": {"a": {"$id": "http://e/a", "type": "string"}}},
    {"$defs": [1]}, {"$defs": None}, {"definitions": "x"}, {"type": {}}, {"type": ["string", {}]},
    {"type": "object", "properties": {"a": {}}, "required": [["a"]]}, {"type": None}, {"anyOf": None},
    {"type": "array", "minItems": True}, {"type": "array", "maxItems": None}, {"type": "object", "additionalProperties": 0},
    {"enum": [float("nan")]}, {"const": float("inf")}, {"enum": ["\ud800"]}, {"type": "string", "items": {}},
])
def test_schemas_this_recognizer_could_not_honour_are_refused(schema):
    with pytest.raises(ValueError, match="json_schema"):
        SchemaMachine(schema)


def test_nesting_and_size_limits_are_value_errors():
    deep = {"type": "array"}
    for _ in range(1200):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="deeply"):
        SchemaMachine(deep)
    with pytest.raises(ValueError, match="not JSON"):
        GuidedDecodingParams(json='{"items":' * 3000 + "{}" + "}" * 3000)
    with pytest.raises(ValueError, match="not JSON"):
        GuidedDecodingParams(json='{"const": NaN}')
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(9000)}}
    with pytest.raises(ValueError, match="too large"):
        SchemaMachine(wide)


def test_property_order_is_part_of_the_mask_key():
    a = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    b = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}, "required": ["a", "b"]}
    ma, mb = SchemaMachine(a), SchemaMachine(b)
    assert ma.key != mb.key
    table = TokenMasks(VOCAB, len(VOCAB))
    in_a, in_b = ma.advance(ma.start, b'{"'), mb.advance(mb.start, b'{"')
    assert in_a == in_b  # the same state tuples: only the key tells the two masks apart
    first_a, first_b = table.mask(ma, in_a, "cpu"), table.mask(mb, in_b, "cpu")
    assert first_a[VOCAB.index(b"a")] and not first_a[VOCAB.index(b'b":')]
    assert first_b[VOCAB.index(b'b":')] and not first_b[VOCAB.index(b"a")]
    assert ma.complete(ma.advance(ma.start, b'{"a":1,"b":2}')) and mb.complete(mb.advance(mb.start, b'{"b":1,"a":2}'))


def test_closed_empty_objects_take_whitespace_and_long_arrays_share_masks():
    m = SchemaMachine({"type": "object", "additionalProperties": False})
    assert m.complete(m.advance(m.start, b"{ }")) and m.advance(m.start, b'{"') is None
    arr = SchemaMachine({"type": "array", "items": {"type": "integer"}, "minItems": 1})
    keys = {arr.cache_key(arr.advance(arr.start, b"[" + b",".join(b"7" for _ in range(n)) + b",")) for n in (1, 5, 50)}
    assert len(keys) == 1


# -- objects told apart by a discriminator (tool calls, tagged unions) ---------------------------------------

TAGS = st.lists(st.text(alphabet='ab_é"\\', min_size=1, max_size=4), min_size=2, max_size=4, unique=True)


def _tagged_union(tags, bodies, key="kind"):
    return {"anyOf": [{"type": "object", "properties": {key: {"const": tag}, **body}, "required": [key, *body]}
                      for tag, body in zip(tags, bodies)]}


@settings(max_examples=150, deadline=None)
@given(TAGS, st.lists(st.dictionaries(NAMES.filter(lambda n: n != "kind"), _schemas(), max_size=2), min_size=4,
                      max_size=4), st.integers(0, 10**6), st.data())
def test_tagged_unions_accept_their_instances_and_whatever_they_complete_validates(tags, bodies, seed, data):
    schema = {"type": "array", "items": _tagged_union(tags, bodies)}
    machine = SchemaMachine(schema)
    rng = random.Random(seed)
    value = [_instance(rng.choice(schema["items"]["anyOf"]), rng) for _ in range(rng.randint(0, 3))]
    text = json.dumps(value, ensure_ascii=False)
    state = machine.advance(machine.start, text.encode())
    assert state is not None and machine.complete(state), text
    chars = list(text)
    for _ in range(data.draw(st.integers(1, 3))):
        chars[data.draw(st.integers(0, len(chars) - 1))] = data.draw(st.sampled_from(list('{}[]",:0123456789ab_ x')))
    mutated = "".join(chars)
    state = machine.advance(machine.start, mutated.encode())
    if state is not None and machine.complete(state):
        assert _valid(mutated, schema), mutated


def test_the_discriminator_picks_the_alternative_and_its_properties():
    schema = _tagged_union(["get_weather", "get_time"], [
        {"city": {"type": "string"}, "days": {"type": "integer"}}, {"zone": {"enum": ["utc", "local"]}}])
    m = SchemaMachine(schema)
    for text, ok in (('{"kind":"get_weather","city":"Paris","days":3}', True),
                     ('{ "kind" : "get_time" , "zone": "utc" }', True), ('{"kind":"get_time","city":"Paris"}', False),
                     ('{"kind":"get_weather","zone":"utc"}', False), ('{"kind":"get_week"', False),
                     ('{"city":"Paris"}', False), ('{"kind":"get_time"}', False)):
        state = m.advance(m.start, text.encode())
        assert (state is not None and m.complete(state)) == ok, text
    # a prefix shared by two tags stays open until the tags part
    assert m.advance(m.start, b'{"kind":"get_') is not None


@pytest.mark.parametrize("schema", [
    _tagged_union(["a", "a"], [{"x": {}}, {"y": {}}]),  # the same tag twice
    {"anyOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
               {"type": "object", "properties": {"j": {"const": "b"}}, "required": ["j"]}]},  # different keys
    {"anyOf": [{"type": "object", "properties": {"k": {"const": "a"}}},  # the discriminator is optional
               {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]},
    {"anyOf": [{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},  # not strings
               {"type": "object", "properties": {"k": {"const": 2}}, "required": ["k"]}]},
    {"anyOf": [{"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]},
               {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]},
    {"anyOf": [{"type": "object"}, {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]},
    # another alternative that can start with "{", before or after the tagged objects
    *[{"oneOf": order} for first in ({}, {"type": ["object", "string"]}, {"anyOf": [
        {"type": "object", "properties": {"d": {"const": "d"}}, "required": ["d"]}, {"type": "array"}]})
      for order in ([first, *_tagged_union(["a", "b"], [{"x": {"type": "integer"}}, {}], key="t")["anyOf"]],
                    [*_tagged_union(["a", "b"], [{"x": {"type": "integer"}}, {}], key="t")["anyOf"], first])],
])
def test_objects_without_a_discriminator_are_still_refused(schema):
    with pytest.raises(ValueError, match="same byte.*discriminator|discriminator"):
        SchemaMachine(schema)


def test_tagged_union_masks_match_a_brute_force_check():
    vocab = [None, b"{", b"}", b'"', b'":', b"a", b"ab", b"1", b"[", b"]", b",", b" ", b'{"k', b'k":', b'"a"', b'"b',
             b'b"', b'":"', b'x":', b'y":', b"x", b"y", b"2"]
    schema = {"type": "array", "items": _tagged_union(["a", "ab", "b"], [{"x": {"type": "integer"}}, {},
                                                                       {"y": {"type": "array"}}], key="k")}
    _, completed = _walk_against_brute_force(SchemaMachine(schema), vocab, random.Random(1))
    assert completed > 0


def test_type_beside_enum_or_const_keeps_the_members_of_that_type():
    for schema, accepted, refused in (
            ({"type": "string", "enum": ["celsius", "fahrenheit", 1]}, ['"celsius"', '"fahrenheit"'], ["1"]),
            ({"type": "integer", "enum": [1, 2.0, 2.5, True, "3"]}, ["1", "2.0"], ["2.5", "true", '"3"']),
            ({"type": ["string", "null"], "enum": ["a", None, 0]}, ['"a"', "null"], ["0"]),
            ({"type": "boolean", "const": False}, ["false"], ["true"])):
        m = SchemaMachine(schema)
        for text in accepted:
            assert m.may_end(m.advance(m.start, text.encode())), (schema, text)
            assert _valid(text, schema)
        for text in refused:
            state = m.advance(m.start, text.encode())
            assert state is None or not m.may_end(state), (schema, text)


def _words(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct lowercase words, many sharing prefixes (and some whole words prefixes of others)."""
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice("abc") for _ in range(rng.randint(1, 8))))
    return sorted(words)


def test_enums_over_the_member_or_byte_caps_are_refused_by_name():
    cap = schema_machine.MAX_ENUM_MEMBERS
    SchemaMachine({"enum": list(range(cap))})
    with pytest.raises(ValueError, match=f"enum has {cap + 1} members; at most {cap}"):
        SchemaMachine({"enum": list(range(cap + 1))})
    with pytest.raises(ValueError, match=f"enum has {cap + 1} members; at most {cap}"):
        SchemaMachine({"type": "integer", "enum": list(range(cap + 1))})
    long = ["x" * 1000 + str(i) for i in range(70)]  # about 70,000 bytes in one enum
    with pytest.raises(ValueError, match=f"enum: .* bytes .*; at most {schema_machine.MAX_ENUM_BYTES}"):
        SchemaMachine({"enum": long})
    spread = {"type": "object", "properties": {f"p{i}": {"enum": long[i * 10:i * 10 + 10]} for i in range(7)}}
    with pytest.raises(ValueError, match="bytes of enum members in the schema"):
        SchemaMachine(spread)


class _NoScan(tuple):
    """Enum members that fail the test when anything walks through all of them."""

    def __iter__(self):
        raise AssertionError("scanned every enum member")

    def __contains__(self, item):
        raise AssertionError("scanned every enum member")


def _reference_enum_step(members, prefix: bytes, byte: int, nested: bool):
    """What an enum frame holding ``prefix`` does with ``byte``, by scanning every member: ``"whole"`` (a member nothing
    longer continues), ``"more"`` (still a prefix of a member), ``"ends"`` (ends a member; the byte goes on to the
    value that holds it) or None."""
    nxt = prefix + bytes((byte,))
    if any(m.startswith(nxt) for m in members):
        return "whole" if nxt in members and not any(m != nxt and m.startswith(nxt) for m in members) else "more"
    return "ends" if nested and prefix in members else None


def test_enum_steps_use_a_binary_search_and_agree_with_scanning_every_member():
    words = _words(1000)
    machine = SchemaMachine({"type": "array", "items": {"enum": words}})
    enum_index = next(i for i, node in enumerate(machine.nodes) if node[0] == "enum" and len(node[1]) == len(words))
    members = machine.nodes[enum_index][1]
    machine.nodes[enum_index] = ("enum", _NoScan(members))
    outer = machine.advance(machine.start, b"[")
    prefixes = {m[:k] for m in members for k in range(1, len(m) + 1)}
    for prefix in sorted(prefixes)[:400] + [b'"', b'"a"', b'"abc"', b'"cc']:
        state = outer[:-1] + (("array", outer[-1][1], "after", 1, 0), ("enum", enum_index, prefix))
        for byte in b'"abcd,] ':
            got = machine.step(state, byte)
            expected = _reference_enum_step(members, prefix, byte, nested=True)
            if expected == "whole":
                assert got == state[:-1], (prefix, byte)
            elif expected == "more":
                assert got == state[:-1] + (("enum", enum_index, prefix + bytes((byte,))),), (prefix, byte)
            elif expected == "ends":
                assert got == machine.step(state[:-1], byte), (prefix, byte)
            else:
                assert got is None, (prefix, byte)


def test_masks_over_a_large_enum_match_a_brute_force_check():
    words = _words(1000, seed=1)
    vocab = [None, b'"', b'",', b'"]', b"[", b"]", b",", b" ", b"a", b"b", b"c", b"ab", b"abc", b"ca", b'"a', b'c"']
    checked, completed = _walk_against_brute_force(SchemaMachine({"type": "array", "items": {"enum": words}}),
                                                    vocab, random.Random(2))
    assert checked == 400 and completed > 0


@pytest.mark.parametrize("schema", [
    {"type": "string", "default": {1, 2}}, {"type": "string", "examples": [b"x"]},
    {"type": "object", "properties": {"a": {"type": "integer", "description": object()}}},
    {"type": "string", "title": {(1, 2): "tuple key"}},
])
def test_schemas_holding_values_that_are_not_json_are_value_errors(schema):
    with pytest.raises(ValueError, match="guided_decoding.json: the schema is not JSON"):
        GuidedDecodingParams(json=schema)
