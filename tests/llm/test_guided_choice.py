"""Guided decoding to one of a list of strings (``GuidedDecodingParams(choice=...)``), and the mask cache's bound."""

import pytest

from ninefold import LLM, SamplingParams
from ninefold.llm.guided import ChoiceMachine, GuidedDecodingParams, TokenMasks, masks

VOCAB = [None, b"y", b"ye", b"yes", b"es", b"s", b"n", b"no", b"o", b"m", b"may", b"be", b"maybe", b"a", b"ab",
         b"b", b"abc", b"c", b"caf", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xe6\x9d\xb1", b"\xe4\xba\xac", b"x"]


def test_prefixes_leaves_and_endings():
    machine = ChoiceMachine(("a", "ab", "abc", "b"))
    state = machine.advance(machine.start, b"a")
    assert machine.may_end(state) and not machine.complete(state)  # "ab" continues it
    assert machine.advance(state, b"bc") == b"abc" and machine.complete(b"abc") and machine.complete(b"b")
    assert machine.advance(state, b"c") is None and machine.step(b"ab", ord("x")) is None


@pytest.mark.parametrize("choices", [("yes", "no", "maybe"), ("a", "ab", "abc"), ("café", "東京", "caf")])
def test_masks_allow_exactly_the_tokens_that_keep_a_choice_reachable(choices):
    machine, table = ChoiceMachine(choices), TokenMasks(VOCAB, len(VOCAB))
    prefixes = {c.encode()[:i] for c in choices for i in range(len(c.encode()) + 1)}
    assert all(machine.advance(b"", p) == p for p in prefixes)
    assert machine.advance(b"", b"q") is None and machine.advance(b"", choices[0].encode() + b"!") is None
    for state in sorted(prefixes):
        brute = [i for i, data in enumerate(VOCAB) if data and machine.advance(state, data) is not None]
        assert table.allowed(machine, state) == brute, state
        mask = table.mask(machine, state, "cpu", end_ids=(0,))
        # the end token where a choice ends, or where no token can continue (this vocabulary's dead ends)
        assert mask[0].item() == (machine.may_end(state) or not brute)


def test_the_mask_cache_keeps_only_the_most_recent(monkeypatch):
    monkeypatch.setattr(masks, "MAX_MASKS", 3)
    table = TokenMasks(VOCAB, len(VOCAB))
    machine = ChoiceMachine(("yes", "no", "maybe"))
    for state in (b"", b"y", b"ye", b"m", b"ma"):
        table.mask(machine, state, "cpu")
    assert len(table._masks) == 3
    assert [key[1] for key in table._masks] == [b"ye", b"m", b"ma"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=256)


@pytest.mark.parametrize("choices", [["yes", "no", "maybe"], ["café", "東京", "naïve"], ["a", "ab", "abc"]])
def test_every_output_is_one_of_the_choices(llm, choices):
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=choices), temperature=1.0, seed=1, n=8,
                            max_tokens=16)
    for out in llm.generate(["Pick one:", "x"], params):
        for c in out.outputs:
            assert c.text in choices and c.finish_reason == "stop", (c.text, c.finish_reason)


def test_a_choice_cut_by_max_tokens_is_a_prefix_of_one(llm):
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["abcdefghijklmnop qrstuvwxyz"]),
                            temperature=0, max_tokens=2)
    c = llm.generate(["x"], params)[0].outputs[0]
    assert c.finish_reason == "length" and "abcdefghijklmnop qrstuvwxyz".startswith(c.text) and c.text


def test_long_choices_cost_linear_memory_and_oversized_lists_are_refused():
    machine = ChoiceMachine(("x" * 60_000,))
    assert machine.advance(b"", b"x" * 59_999) is not None and machine.complete(b"x" * 60_000)
    with pytest.raises(ValueError, match="bytes of choices"):
        GuidedDecodingParams(choice=["y" * 70_000])
    with pytest.raises(ValueError, match="unpaired UTF-16 surrogate"):
        GuidedDecodingParams(choice=["\ud800"])


def test_a_choice_the_vocabulary_cannot_spell_ends_by_the_end_token():
    table = TokenMasks(VOCAB, len(VOCAB))
    machine = ChoiceMachine(("qq",))  # no token holds a "q"
    mask = table.mask(machine, b"", "cpu", end_ids=(0,))
    assert mask.nonzero().flatten().tolist() == [0]


def test_min_tokens_is_refused_with_guided_decoding(llm):
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate(["x"], SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a"]), min_tokens=1))


def test_ignore_eos_keeps_a_prefix_choice_going(llm):
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "abcabc"]), temperature=1.0, seed=5,
                            n=6, max_tokens=16, ignore_eos=True)
    outs = llm.generate(["x"], params)[0].outputs
    assert all(c.text == "abcabc" and c.finish_reason == "stop" for c in outs)  # "a" could only end by EOS
