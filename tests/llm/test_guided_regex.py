"""Guided decoding to a regular expression: the recognizer against Python's ``re.fullmatch`` (ASCII classes)
on random patterns and strings, liveness of prefixes, masks against a brute-force check, refusals by name,
and the engine's outputs."""

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninefold import LLM, GuidedDecodingParams, SamplingParams
from ninefold.llm.guided import TokenMasks, regex_machine
from ninefold.llm.guided.regex_machine import RegexMachine

CHARS = "ab-é. \n"


def _patterns():
    atoms = st.sampled_from(["a", "b", "é", "\\.", "-", ".", "[ab]", "[^a]", "[a-c]", "\\d", "\\w", "\\s", "\\W",
                             "[é-ê]", "\\x61", "[.-]", "\\n"])

    def extend(inner):
        return (st.tuples(inner, inner).map(lambda t: t[0] + t[1])
                | st.tuples(inner, inner).map(lambda t: f"(?:{t[0]}|{t[1]})")
                | st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{0,2}", "{1,}", "*?"])).map(
                    lambda t: f"(?:{t[0]}){t[1]}"))

    return st.recursive(atoms, extend, max_leaves=6)


def _matches(machine, text: str) -> bool:
    state = machine.advance(machine.start, text.encode())
    return state is not None and machine.may_end(state)


@settings(max_examples=400, deadline=None)
@given(_patterns(), st.lists(st.text(alphabet=CHARS + "1", max_size=6), min_size=1, max_size=8))
def test_whole_matches_agree_with_python_re(pattern, texts):
    machine = RegexMachine(pattern)
    compiled = re.compile(pattern, re.ASCII)
    for text in texts:
        assert _matches(machine, text) == bool(compiled.fullmatch(text)), (pattern, text)


@settings(max_examples=200, deadline=None)
@given(_patterns(), st.integers(0, 10**6))
def test_a_live_prefix_can_always_be_completed(pattern, seed):
    """Walk random allowed characters: the recognizer never reaches a state from which no match is possible."""
    machine, rng = RegexMachine(pattern), random.Random(seed)
    compiled = re.compile(pattern, re.ASCII)
    state, text = machine.start, ""
    for _ in range(12):
        options = [c for c in CHARS + "1" if machine.advance(state, c.encode()) is not None]
        if machine.may_end(state):
            assert compiled.fullmatch(text), (pattern, text)
        if not options:
            assert machine.may_end(state), (pattern, text)  # a dead end must be a match
            break
        c = rng.choice(options)
        state, text = machine.advance(state, c.encode()), text + c


def test_masks_match_a_brute_force_check():
    vocab = [None, b"a", b"ab", b"b", b"-", b"1", b"12", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xc3\xa9a", b".", b" ",
             b"\n", b"a-1", b"bb", b"\xff"]
    machine, table = RegexMachine(r"(?:ab|é)+-\d{1,2}[ .]?"), TokenMasks(vocab, len(vocab))
    rng, state = random.Random(0), machine.start
    for _ in range(200):
        brute = [i for i, data in enumerate(vocab) if data and machine.advance(state, data) is not None]
        assert table.allowed(machine, state) == brute
        if not brute or machine.complete(state):
            state = machine.start
            continue
        state = machine.advance(state, vocab[rng.choice(brute)])


def test_a_character_split_over_tokens_is_matched_whole():
    m = RegexMachine("é+")
    half = m.advance(m.start, b"\xc3")
    assert half is not None and not m.may_end(half)  # half of é
    assert m.may_end(m.advance(half, b"\xa9")) and m.advance(half, b"a") is None
    assert m.advance(m.start, b"\xa9") is None and m.advance(m.start, b"\xff") is None


def test_a_lead_byte_lives_only_if_a_character_it_starts_can_match():
    for pattern, data, live in (("[a-z]+", b"\xd5", False), ("[a-z]+", b"\xc3", False), ("é", b"\xc3", True),
                                ("é", b"\xc4", False), ("[^a]", b"\xf0\x9f", True), ("\u0100x", b"\xc4\x80", True),
                                ("[\u0100-\u0101]", b"\xc4\xbf", False), (".", b"\xe0\x80", False),
                                ("[^\u0800-\uffff]", b"\xe0", False), ("[^\u0800-\ufffe]", b"\xef", True),
                                ("\U0010ffff", b"\xf4\x8f", True), (".", b"\xed\xa0", False)):
        m = RegexMachine(pattern)
        assert (m.advance(m.start, data) is not None) == live, (pattern, data)


def test_complete_means_nothing_may_follow():
    m = RegexMachine("(yes|no)")
    assert m.complete(m.advance(m.start, b"yes")) and not m.complete(m.advance(m.start, b"n"))
    m = RegexMachine(r"\d+")
    assert m.may_end(m.advance(m.start, b"12")) and not m.complete(m.advance(m.start, b"12"))


@pytest.mark.parametrize("pattern, word", [
    (r"(a)\1", "backreferences"), (r"a(?=b)", "lookaround"), (r"\bword", "word boundaries"), (r"(?i)a", "flags"),
    ("a{3,1}", "min repeat greater than max"), ("a{5000}", "repetition counts"), ("*a", "nothing to repeat"),
    ("(a", "unterminated subpattern"), ("a)", "unbalanced parenthesis"), ("[b-a]", "bad character range"),
    (r"\q", "escape"), ("a^b", "inside the pattern"), ("", "non-empty"), ("[abc", "unterminated character set"),
    (r"\x4", "incomplete escape"), ("a++", "possessive"), ("a{2}+", "possessive"),
    ("a{1}{2}", "multiple repeat"), ("a**", "multiple repeat"), (r"\12", "invalid group reference"),
    ("(.?.?){900}", "more than"), ("(a?){300}", "ways to match open"), ("a\ud800", "unpaired UTF-16 surrogate"),
])
def test_unsupported_or_broken_patterns_are_refused_by_name(pattern, word):
    with pytest.raises(ValueError, match=f"regex.*{word}"):
        GuidedDecodingParams(regex=pattern)


@pytest.mark.parametrize("pattern, texts", [
    (r"\d{,3}", ["", "4", "42", "421", "4213", "4{,3}"]), (r"\012|\0|\101", ["\n", "\0", "A", "\x0012"]),
    (r"[\s\S]+", ["a\n", " ", "é", ""]), (r"[^\W\d]+", ["ab_", "a1", "é"]), (r"x{,0}y", ["y", "xy"]),
    (r"x{,}", ["", "x", "xx", "x{,}"]), (r"(?:ab){,}c", ["c", "ababc", "ab{,}c"]), (r"x{}", ["x{}", "x"]),
])
def test_python_forms_read_as_re_reads_them(pattern, texts):
    machine = RegexMachine(pattern)
    for text in texts:
        assert _matches(machine, text) == bool(re.fullmatch(pattern, text, re.ASCII)), (pattern, text)


@pytest.mark.parametrize("depth", [101, 400, 2000])
def test_deeply_nested_groups_are_a_value_error_not_a_recursion_error(depth):
    pattern = "(" * depth + "a" + ")" * depth
    with pytest.raises(ValueError, match="regex.*nest"):
        GuidedDecodingParams(regex=pattern)


def test_groups_nested_up_to_the_limit_are_accepted():
    depth = regex_machine.MAX_NESTING
    machine = RegexMachine("(?:" * depth + "a" + ")" * depth)
    assert _matches(machine, "a") and not _matches(machine, "aa")


@pytest.mark.parametrize("pattern, word", [
    (r"\777", "outside of range"), (r"\U00110000", "bad escape"), (r"[\d-z]", "bad character range"),
    (r"[a-\w]", "bad character range"), (r"(?P<1>a)", "group name"), (r"(?P<>a)", "group name"),
    (r"[^\x00-\U0010FFFF]", "no text matches"), (r"a(?:[^\x00-\U0010FFFF]|b[^\s\S])c", "no text matches"),
    (r"[\ud800-\udfff]+", "no text matches"),
])
def test_invalid_or_unmatchable_patterns_are_refused(pattern, word):
    with pytest.raises(ValueError, match=f"guided_decoding.regex.*{word}"):
        GuidedDecodingParams(regex=pattern)


@pytest.mark.parametrize("pattern, word", [
    (r"\777", "above"), (r"\U00110000", "above"), (r"[\d-z]", "cannot start a range"),
    (r"[a-\w]", "cannot end a range"), (r"[a-\D]", "cannot end a range"), (r"(?P<1>a)", "not an identifier"),
])
def test_the_parser_itself_refuses_escapes_re_refuses(pattern, word):
    with pytest.raises(ValueError, match=f"regex.*{word}"):
        regex_machine._Parser(pattern).parse()


def test_patterns_with_an_unmatchable_branch_still_compile():
    machine = RegexMachine(r"a|[^\x00-\U0010FFFF]|(?P<n_1>b)\377")
    assert _matches(machine, "a") and _matches(machine, "b\xff") and not _matches(machine, "")


def test_size_limits():
    with pytest.raises(ValueError, match="more than"):
        RegexMachine("(?:" * 1 + "a{1000}){1000}")
    with pytest.raises(ValueError, match="at most"):
        RegexMachine("a" * 5000)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=256)


def test_engine_outputs_match_the_pattern(llm):
    pattern = r"(?:[a-z]{2,5}\.){1,2}(?:com|org)"
    params = SamplingParams(guided_decoding=GuidedDecodingParams(regex=pattern), temperature=1.0, seed=1, n=6,
                            max_tokens=40)
    machine, finished = RegexMachine(pattern), 0
    for out in llm.generate(["Domain:", "x"], params):
        for c in out.outputs:
            state = machine.advance(machine.start, c.text.encode())
            assert state is not None, c.text
            if c.finish_reason == "stop":
                finished += 1
                assert re.fullmatch(pattern, c.text), c.text
            else:
                assert c.finish_reason == "length"
    assert finished >= 1
