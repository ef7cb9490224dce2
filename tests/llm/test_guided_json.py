"""Guided decoding to one JSON object: the byte recognizer against ``json.loads``, the token masks
against a brute-force check of every token, and the engine's outputs (sampled from a random model)."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninefold import LLM, SamplingParams
from ninefold.llm.guided import Guide, GuidedDecodingParams, TokenMasks
from ninefold.llm.guided import json_machine as jm

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
OBJECTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)


def _strict_object(text: str) -> bool:
    """Whether ``text`` is exactly one JSON object (no NaN/Infinity, no trailing whitespace)."""
    if text != text.rstrip(" \t\n\r"):
        return False

    def refuse(name):
        raise ValueError(name)

    try:
        return isinstance(json.loads(text, parse_constant=refuse), dict)
    except ValueError:
        return False


def _accepts(text: str):
    return jm.advance(jm.START, text.encode())


@settings(max_examples=200, deadline=None)
@given(OBJECTS, st.sampled_from([None, 0, 2]), st.booleans())
def test_every_serialized_object_is_complete_and_each_prefix_can_continue(obj, indent, ascii_only):
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_only)
    state = jm.START
    for i, byte in enumerate(text.encode()):
        assert not jm.complete(state), f"complete before byte {i} of {text!r}"
        state = jm.step(state, byte)
        assert state is not None, f"refused byte {i} of {text!r}"
    assert jm.complete(state)


@settings(max_examples=400, deadline=None)
@given(OBJECTS, st.data())
def test_mutated_documents_are_complete_exactly_when_json_loads_takes_them(obj, data):
    text = json.dumps(obj)
    mutations = data.draw(st.lists(st.tuples(st.integers(0, max(len(text) - 1, 0)),
                                             st.sampled_from(list('{}[]",:0123456789.eE+-tfnrul \\/x\n'))),
                                   min_size=1, max_size=3))
    chars = list(text)
    for position, char in mutations:
        chars[position] = char
    mutated = "".join(chars)
    state = _accepts(mutated)
    assert jm.complete(state) == _strict_object(mutated), mutated


@pytest.mark.parametrize("text", ['{"a":01}', '{"a":1.}', '{"a":-}', '{"a":1e}', '{"a":tru}', "[1]", '"x"', "1",
                                  '{"a" 1}', '{"a":1,}', '{,}', '{"a":"\x01"}', '{"a":"\\q"}', '{"a":"\\u12G4"}',
                                  '{"a":1}}', '{"a":[1,]}', '{} ', '{"a":NaN}'])
def test_invalid_objects_are_refused(text):
    assert not jm.complete(_accepts(text))


@pytest.mark.parametrize("text", ['{}', ' {"a": [1, -2.5e+3, true, false, null, {"b": "\\u00e9\\n"}]}',
                                  '{"k":0,"l":-0.0E-1,"m":"東京"}', '{\n  "x": {\n    "y": []\n  }\n}'])
def test_valid_objects_are_complete(text):
    assert jm.complete(_accepts(text))


def test_whitespace_runs_are_capped():
    assert _accepts("{" + " " * jm.MAX_WHITESPACE) is not None
    assert _accepts("{" + " " * (jm.MAX_WHITESPACE + 1)) is None


VOCAB = [None, b"{", b"}", b'"', b'":', b'"}', b"a", b"ab", b" ", b"  ", b"\n", b"1", b"12", b"0", b"-", b".5",
         b"e", b"true", b"tr", b"ue", b"null", b"[", b"]", b"]}", b"}]", b"}}", b"}}}", b"}]}", b",", b'", "', b'{"',
         b"\\", b'\\"', b"\\u00", b"e9", b"x\x01", b"\xc3", b"\xa9", b"[[", b"]]", b", ", b":", b"f", b"alse"]


def _reachable_states(seed: int, count: int) -> list[tuple]:
    """States reached by walking random allowed tokens of ``VOCAB`` from the start."""
    rng = random.Random(seed)
    masks = TokenMasks(VOCAB, len(VOCAB))
    states, state = [], jm.START
    while len(states) < count:
        states.append(state)
        options = masks.allowed(jm.JSON_OBJECT, state)
        if not options or jm.complete(state):
            state = jm.START
            continue
        state = jm.advance(state, VOCAB[rng.choice(options)])
    return states


def test_masks_allow_exactly_the_tokens_a_brute_force_check_allows():
    masks = TokenMasks(VOCAB, len(VOCAB))
    for state in _reachable_states(0, 300):
        key = jm.cache_key(state)
        brute = [i for i, data in enumerate(VOCAB) if data and jm.advance(key, data) is not None]
        assert masks.allowed(jm.JSON_OBJECT, key) == brute, state
        # the key's state refuses only what closes past its innermost containers: never more than the real one
        real = {i for i, data in enumerate(VOCAB) if data and jm.advance(state, data) is not None}
        assert set(brute) <= real


def test_deep_nesting_masks_are_safe_below_the_kept_containers():
    state = _accepts('{"a":[[[[[')
    key = jm.cache_key(state, depth=4)
    assert key[1] == "*aaaa"
    assert jm.advance(key, b"]]]]") is not None and jm.advance(key, b"]]]]]") is None
    assert jm.advance(state, b"]]]]]") is not None  # the real state may close further


def test_guide_advances_with_tokens_and_refuses_what_the_mask_rules_out():
    guide = Guide(jm.JSON_OBJECT, TokenMasks(VOCAB, len(VOCAB)), ())
    allowed = guide.mask("cpu")
    assert allowed.tolist() == [data is not None and jm.advance(jm.START, data) is not None for data in VOCAB]
    assert not guide.accept(VOCAB.index(b'{"'))
    assert not guide.accept(VOCAB.index(b'":'))
    with pytest.raises(RuntimeError, match="cannot follow"):
        guide.accept(VOCAB.index(b"}}}"))
    assert guide.accept(VOCAB.index(b"12")) is False and guide.accept(VOCAB.index(b"}"))


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=256)


def _json_params(**kw):
    return SamplingParams(guided_decoding=GuidedDecodingParams(json_object=True), **kw)


def test_sampled_outputs_are_json_objects_or_prefixes_of_one(llm):
    outs = llm.generate(["Reply in JSON:", "{", "Hello"],
                        _json_params(temperature=1.0, seed=11, n=4, max_tokens=40))
    finished = 0
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "stop":
                assert _strict_object(c.text), c.text
                finished += 1
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 40
                assert _accepts(c.text) is not None and not jm.complete(_accepts(c.text)), c.text
    outs_again = llm.generate(["Reply in JSON:"], _json_params(temperature=1.0, seed=11, n=4, max_tokens=40))
    assert [c.text for c in outs_again[0].outputs] == [c.text for c in outs[0].outputs]  # seeded: reproducible


def test_a_biased_model_closes_the_object_and_stops_at_once(llm):
    tokenizer = llm.engine.tokenizer
    close = tokenizer.encode("}", add_special_tokens=False)
    assert len(close) == 1
    out = llm.generate(["x"], _json_params(temperature=0, max_tokens=20, logit_bias={close[0]: 50.0}))[0].outputs[0]
    assert out.text == "{}" and out.finish_reason == "stop" and len(out.token_ids) == 2


def test_greedy_guided_batches_agree_with_one_at_a_time(llm):
    prompts = ["a", "bb b", "Reply:"]
    params = _json_params(temperature=0, max_tokens=24, ignore_eos=True)
    together = [o.outputs[0].text for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].text for p in prompts]
    assert together == alone
    for text in together:
        assert _accepts(text) is not None


def test_guided_decoding_needs_a_tokenizer_and_valid_params():
    from ninefold.bench.llm import SMOKE_CONFIG
    from ninefold.llm.engine import LLMEngine

    engine = LLMEngine({k: v for k, v in SMOKE_CONFIG.items() if k != "name"}, load_format="dummy", device="cpu",
                       dtype="float32", num_kv_blocks=16)
    assert engine.tokenizer is None
    with pytest.raises(ValueError, match="guided_decoding: this model has no tokenizer"):
        engine.build_request([1, 2, 3], _json_params(max_tokens=4))
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(json_object=True, choice=["a"])
    for bad in ([], [""], "ab", [1]):
        with pytest.raises(ValueError, match="choice"):
            GuidedDecodingParams(choice=bad)
    with pytest.raises(ValueError, match="json_object"):
        GuidedDecodingParams(json_object="yes")
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(guided_decoding={"json_object": True})
