"""``load_format='dummy'``: random weights of a named or given shape."""

import pytest

from ninefold import LLM, SamplingParams
from ninefold.llm.config import NAMED_SHAPES, ModelConfig


@pytest.mark.parametrize("name", sorted(NAMED_SHAPES))
def test_named_shapes_are_valid_configs(name):
    config = ModelConfig.from_dict(NAMED_SHAPES[name])
    assert config.num_heads % config.num_kv_heads == 0


def test_llama_3_1_8b_shape_has_8b_parameters():
    c = ModelConfig.from_dict(NAMED_SHAPES["llama-3.1-8b"])
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    total = c.num_layers * (attn + mlp + 2 * c.hidden_size) + 2 * c.vocab_size * c.hidden_size + c.hidden_size
    assert total == 8_030_261_248


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_dummy_weights_from_a_config_dict_or_directory_generate(model_dirs, variant):
    """A config alone has no tokenizer (token ids only); a model directory keeps its tokenizer, as vLLM's dummy
    format does: only the weights are random."""
    import json

    config = json.loads((model_dirs[variant] / "config.json").read_text())
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bare = LLM(config, device="cpu", load_format="dummy", num_kv_blocks=16)
    assert bare.tokenizer is None
    out = bare.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params)
    assert len(out[0].outputs[0].token_ids) == 8 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.generate(["text"], params)
    with pytest.raises(ValueError, match="^stop: this model has no tokenizer, so its output has no text to find stop "
                                         "strings in; use stop_token_ids"):
        bare.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=4, stop=["a"]))
    directory = LLM(str(model_dirs[variant]), device="cpu", load_format="dummy", num_kv_blocks=16)
    assert directory.tokenizer is not None
    request = directory.generate(["The quick brown fox"], params)[0]
    out = request.outputs[0]
    assert len(out.token_ids) == 8 and out.text == directory.tokenizer.decode(out.token_ids)
    same = bare.generate(prompt_token_ids=[request.prompt_token_ids], sampling_params=params)
    assert same[0].outputs[0].token_ids == out.token_ids  # the same seed: the same random weights


def test_unknown_dummy_shape_lists_the_known_ones():
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        LLM("llama-9000", device="cpu", load_format="dummy")
