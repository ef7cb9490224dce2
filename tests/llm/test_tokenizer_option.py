"""``tokenizer=`` / ``--tokenizer`` (vLLM's): a tokenizer directory used instead of the model's own, for a model
directory without one, dummy weights, a GGUF file and tensor-parallel workers; and its errors."""

import shutil

import pytest
from tiny_models import build_model_dir

from ninefold import LLM, SamplingParams
from ninefold.llm.loader import MissingModelFile
from ninefold.llm.tokenizer import read_tokenizer_file

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def split_model(tmp_path_factory):
    """(a complete model directory, the same weights without tokenizer files, a directory of just those files)."""
    root = tmp_path_factory.mktemp("tokenizer_option")
    whole = build_model_dir(root / "whole", "llama")
    bare, tok = root / "bare", root / "tok"
    shutil.copytree(whole, bare)
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).rename(tok / name)
    return whole, bare, tok


def _texts(llm) -> tuple[str, str]:
    completion = llm.generate([PROMPT], GREEDY)[0].outputs[0].text
    chat = llm.chat([{"role": "user", "content": PROMPT}], GREEDY)[0].outputs[0].text
    return completion, chat


def test_a_model_without_tokenizer_files_runs_with_a_tokenizer_given_apart(split_model):
    whole, bare, tok = split_model
    with pytest.raises(MissingModelFile, match="tokenizer.json not found .*tokenizer="):
        LLM(str(bare), device="cpu", num_kv_blocks=32)
    expected = _texts(LLM(str(whole), device="cpu", num_kv_blocks=32))
    llm = LLM(str(bare), device="cpu", num_kv_blocks=32, tokenizer=tok)
    assert llm.engine.tokenizer.chat_template  # the chat template came from tok/tokenizer_config.json
    assert _texts(llm) == expected


def test_the_given_tokenizer_replaces_a_models_own(split_model, tmp_path):
    """The model directory's tokenizer is not read when one is given: a broken one there does not matter."""
    whole, _, tok = split_model
    broken = tmp_path / "broken"
    shutil.copytree(whole, broken)
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text('{"chat_template": "{{ 1 / 0 }}"}')
    llm = LLM(str(broken), device="cpu", num_kv_blocks=32, tokenizer=str(tok))
    assert _texts(llm) == _texts(LLM(str(whole), device="cpu", num_kv_blocks=32))


def test_dummy_weights_and_a_gguf_file_take_text_with_a_given_tokenizer(split_model, tmp_path):
    _, bare, tok = split_model
    dummy = LLM(str(bare), device="cpu", num_kv_blocks=32, load_format="dummy", tokenizer=tok)
    out = dummy.generate([PROMPT], GREEDY)[0]
    raw = read_tokenizer_file(tok / "tokenizer.json")
    assert out.prompt_token_ids == [raw.token_to_id("<s>"), *raw.encode(PROMPT).ids]  # the config's add_bos_token
    assert len(out.outputs[0].token_ids) == 12 and isinstance(out.outputs[0].text, str)

    from test_gguf import hf_weights, write_gguf

    gguf = write_gguf(tmp_path / "tiny.gguf", hf_weights())
    own = LLM(str(gguf), device="cpu", num_kv_blocks=32).engine.tokenizer
    given = LLM(str(gguf), device="cpu", num_kv_blocks=32, tokenizer=tok).engine.tokenizer
    words = "hello there"
    assert given.encode(words, add_special_tokens=False) == read_tokenizer_file(tok / "tokenizer.json").encode(
        words, add_special_tokens=False).ids
    assert given.encode(words, add_special_tokens=False) != own.encode(words, add_special_tokens=False)


def test_tensor_parallel_workers_load_a_model_directory_without_tokenizer_files(split_model):
    whole, bare, tok = split_model
    expected = _texts(LLM(str(whole), device="cpu", num_kv_blocks=32))
    with LLM(str(bare), device="cpu", num_kv_blocks=32, tokenizer=tok, tensor_parallel_size=2) as llm:
        assert _texts(llm) == expected


@pytest.mark.parametrize("value, words", [
    ("/no/such/dir", "tokenizer: '/no/such/dir' is not a directory; expected a Hugging Face tokenizer directory"),
    (3, "tokenizer: got 3; expected the path of a tokenizer directory"),
])
def test_a_bad_tokenizer_is_refused_naming_it(split_model, value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        LLM(str(split_model[0]), device="cpu", num_kv_blocks=32, tokenizer=value)


def test_a_directory_without_tokenizer_json_is_refused_naming_it(split_model):
    _, bare, _ = split_model
    with pytest.raises(ValueError, match=f"tokenizer: '{bare}' is a directory without tokenizer.json"):
        LLM(str(bare), device="cpu", num_kv_blocks=32, tokenizer=bare)
