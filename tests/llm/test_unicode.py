"""Text from clients must be valid Unicode: one check (``ninefold.llm.unicode``) serves every entry point."""

import pytest

from ninefold.llm.guided import GuidedDecodingParams
from ninefold.llm.sampling import SamplingParams
from ninefold.llm.unicode import first_invalid_string, is_valid_unicode

LONE = "x\ud800y"  # what JSON's "x\ud800y" decodes to


def test_valid_unicode_and_the_first_invalid_string_anywhere_in_a_value():
    assert is_valid_unicode("héllo 😀") and not is_valid_unicode(LONE)
    assert first_invalid_string({"a": ["ok", ("fine", {"k": 1})]}) is None
    assert first_invalid_string({"a": ["ok", ("fine", {LONE: 1})]}) == LONE  # a key, three levels down
    assert first_invalid_string([1, 2.0, None, LONE, "\udfff"]) == LONE
    assert first_invalid_string(LONE.encode("utf-8", "surrogatepass")) is None  # bytes are not text


@pytest.mark.parametrize("build, field", [
    (lambda: SamplingParams(stop=["ok", LONE]), "stop"),
    (lambda: SamplingParams(bad_words=[LONE]), "bad_words"),
    (lambda: GuidedDecodingParams(choice=["yes", LONE]), "guided_decoding.choice"),
    (lambda: GuidedDecodingParams(regex=LONE).guide(None), "guided_decoding.regex"),
])
def test_each_entry_point_rejects_a_lone_surrogate_naming_its_field(build, field):
    with pytest.raises(ValueError, match=field) as info:
        build()
    assert "surrogate" in str(info.value)
