"""``TokenMasks.allowed`` (the sorted-vocabulary walk, and the plain-string shortcut inside strings) against a
brute-force check of every token, on random vocabularies and the states of random walks of each recognizer."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninefold.llm.guided import ChoiceMachine, SchemaMachine, TokenMasks, masks
from ninefold.llm.guided.json_machine import JSON_OBJECT
from ninefold.llm.guided.reasoning_machine import AfterReasoning
from ninefold.llm.guided.regex_machine import RegexMachine

# Bytes that matter to JSON, plus the extremes of the byte range (the walk special-cases 255).
ALPHABET = list(b'{}[]":, \n\t\\-+.0123456789eEtrufalsnbxyz<>/hik') + [0x00, 0x1F, 0xC3, 0xA9, 0xFE, 0xFF]
MARKERS = [b"<think>", b"</think>", b"</think>\n\n{", b"</think>x", b"k>y", b"</th", b"ink>", b"</think>yes"]
TOKENS = st.lists(st.binary(min_size=1, max_size=6).map(lambda b: bytes(ALPHABET[x % len(ALPHABET)] for x in b)),
                  min_size=1, max_size=120)
MACHINES = [
    JSON_OBJECT,
    SchemaMachine({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "number"}},
                                                     "b": {"enum": ["x", "xyz", None]}, "c": {"type": "string"}},
                   "required": ["a"]}),
    SchemaMachine({"type": "array", "items": {"anyOf": [
        {"type": "object", "properties": {"n": {"const": "a"}, "p": {"type": "integer"}}, "required": ["n"]},
        {"type": "object", "properties": {"n": {"const": "ab"}, "q": {"type": "boolean"}}, "required": ["n", "q"]}]}}),
    ChoiceMachine(("true", "tru", "{\"x\": 1}", "\xe9t\xe9", "")),
    RegexMachine(r"(?:ab|\d)+.*x?[^a]{0,2}"),
    AfterReasoning(JSON_OBJECT, "</think>", "<think>"),  # Qwen3: thinking only after a leading <think>
    AfterReasoning(ChoiceMachine(("yes", "no")), "</think>"),  # DeepSeek-R1: thinking from the start
]


def _brute(machine, state, vocab):
    return [i for i, data in enumerate(vocab) if data and machine.advance(state, data) is not None]


@settings(max_examples=80, deadline=None)
@given(TOKENS, st.integers(0, len(MACHINES) - 1), st.integers(0, 10**6), st.sampled_from([20000, 3, 0]))
def test_allowed_tokens_match_a_brute_force_check(tokens, which, seed, budget):
    """With the walk's budget at 0 (or nearly), every mask outside strings comes from the sweep instead."""
    masks.WALK_BUDGET, saved = budget, masks.WALK_BUDGET
    try:
        _check_random_walk(tokens, MACHINES[which], seed)
    finally:
        masks.WALK_BUDGET = saved


def _check_random_walk(tokens, machine, seed):
    # every single byte of the alphabet, so that random walks can go on; None: a special token
    vocab = [None, *sorted(set(tokens) | set(MARKERS)), *[bytes((b,)) for b in ALPHABET]]
    table, rng = TokenMasks(vocab, len(vocab)), random.Random(seed)
    state = machine.start
    for _ in range(40):
        brute = _brute(machine, state, vocab)
        assert table.allowed(machine, state) == brute, (machine.key, state)
        if not brute or machine.complete(state):
            state = machine.start
            continue
        state = machine.advance(state, vocab[rng.choice(brute)])


ESCAPES = [b'\\', b'\\n', b'\\n"', b'\\n"x', b'\\n"}', b'\\nab', b'\\n\\', b'\\t"', b'\\"', b'\\u', b'\\u00e9x',
           b'\\u00', b'"', b'"}', b'}', b'a', b'ab"', b'ab\\', b'x"', b'\\\\', b'\\/', b'\\b\x01', b'\\q']
ESCAPES += [b'n', b'n"', b'n"x', b'n"}', b'nab', b'n\\', b't"', b'u00e9x', b'u00', b'b\x01', b'q', b'/x']


def test_runs_inside_a_string_after_an_escape_match_a_brute_force_check():
    vocab = [None, *ESCAPES]
    table = TokenMasks(vocab, len(vocab))
    schema = SchemaMachine({"type": "object", "properties": {"s": {"type": "string"}, "t": {"enum": ["x"]}},
                            "required": ["s"]})
    for machine, prefix in ((JSON_OBJECT, b'{"k": "'), (JSON_OBJECT, b'{"'), (schema, b'{"s": "a'),
                            (schema, b'{"s": "\\n')):
        state = machine.advance(machine.start, prefix)
        for extra in (b"", b"\\", b"\\u0", b"ab"):
            inner = machine.advance(state, extra)
            if inner is not None:
                assert table.allowed(machine, inner) == _brute(machine, inner, vocab), (prefix, extra)


def test_the_engine_indexes_its_vocabulary_in_the_background_once(llama_dir):
    from ninefold import LLM

    engine = LLM(str(llama_dir), device="cpu").engine
    engine.index_vocabulary()
    table = engine._token_masks()  # waits for the background index
    engine.index_vocabulary()  # already built: nothing new starts
    assert engine._token_masks() is table and table.size == engine.model_config.vocab_size
    start = JSON_OBJECT.start
    assert table.allowed(JSON_OBJECT, start) == _brute(JSON_OBJECT, start, table.vocab)
    assert table.allowed(JSON_OBJECT, start)  # "{" and whitespace tokens at least


def _follow(guide, vocab, target: bytes) -> bytes:
    """Sample as a model that wants ``target`` would: the allowed token covering most of what is left."""
    out = b""
    while not guide.complete:
        allowed = guide.mask("cpu").nonzero().flatten().tolist()
        rest = target[len(out):]
        token = max((i for i in allowed if vocab[i] and rest.startswith(vocab[i])), key=lambda i: len(vocab[i]))
        out += vocab[token]
        guide.accept(token)
    return out


def test_a_format_after_thinking_lets_the_thinking_run_free_and_then_holds():
    from ninefold.llm.guided import Guide, GuidedDecodingParams

    vocab = [None, *MARKERS, b"<", b"think", b"</", b"Let me see", b"{", b"}", b'"a": 1', b" ", b"\n", b"x"]
    table = TokenMasks(vocab, len(vocab))
    target = b'<think>\nLet me see</think>\n\n{"a": 1}'
    guide = Guide(GuidedDecodingParams(json_object=True, reasoning="qwen3").machine(), table, end_ids=(0,))
    assert _follow(guide, vocab, target) == target
    thinking = Guide(guide.machine, table, end_ids=(0,))
    thinking.accept(vocab.index(b"<think>"))
    allowed = thinking.mask("cpu")
    assert allowed[0] and allowed[vocab.index(b"x")] and allowed[vocab.index(b"</think>\n\n{")]  # free, may end
    assert not allowed[vocab.index(b"</think>x")] and not allowed[vocab.index(b"</think>yes")]  # closes into "x"
    plain = Guide(guide.machine, table, end_ids=(0,))  # no leading <think>: the JSON from the first byte
    assert not plain.mask("cpu")[vocab.index(b"x")] and plain.mask("cpu")[vocab.index(b"<")]
    assert _follow(plain, vocab, b'{"a": 1}') == b'{"a": 1}'


@pytest.mark.parametrize("name, fmt, text", [
    ("qwen3", {"choice": ["\nyes", "no"]}, "<think>x</think>\n\nno"), ("qwen3", {"choice": ["no"]}, " \n<think>ok</think>no"),
    ("qwen3", {"choice": ["<think", "x"]}, "<think"), ("qwen3", {"json_object": True}, '\n{"a": 1}'),
    ("deepseek_r1", {"json_object": True}, "hm</think>\n\n{}"), ("deepseek_r1", {"regex": "[0-9]+"}, "a</think>\n42"),
])
def test_the_guide_splits_thinking_from_the_answer_where_the_reasoning_parser_does(name, fmt, text):
    from ninefold.llm.guided import GuidedDecodingParams
    from ninefold.llm.reasoning import get_reasoning_parser

    machine = GuidedDecodingParams(**fmt, reasoning=name).machine()
    state = machine.advance(machine.start, text.encode())
    assert state is not None and machine.may_end(state), (text, state)
    _, answer = get_reasoning_parser(name).split(text, final=True)
    inner = machine.inner
    assert inner.may_end(inner.advance(inner.start, answer.encode())), (text, answer)  # the answer alone fits
