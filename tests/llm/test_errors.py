"""Each error case raises an error that names the problem; the engine stays usable."""

import json
import re
import shutil

import pytest

from ninefold import LLM, SamplingParams
from ninefold.llm.config import ModelConfig
from ninefold.llm.loader import MissingModelFile, load_checkpoint


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=32)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_is_named(tmp_path, llama_dir):
    path = _copy(llama_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*supported: LlamaForCausalLM"):
        LLM(str(path), device="cpu")


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(tmp_path, llama_dir, missing):
    path = _copy(llama_dir, tmp_path / "m")
    (path / missing).unlink()
    with pytest.raises(MissingModelFile, match=missing.replace(".", r"\.")):
        load_checkpoint(str(path))


def test_missing_shard_of_an_index_is_named(tmp_path, llama_dir):
    path = _copy(llama_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()  # beside model.safetensors, the index is not read (as in transformers)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002.safetensors"):
        load_checkpoint(str(path))


def test_missing_tensor_and_bad_shape_are_named(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    path = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LLM(str(path), device="cpu")


def test_model_that_is_neither_dir_nor_gguf_nor_known(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"), device="cpu")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        LLM(str(tmp_path / "missing.gguf"), device="cpu")


def test_config_errors_name_the_field():
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_hidden_layers=2, vocab_size=100)
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_dict({**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope_scaling.*yarn"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    for factors in ([1.0] * 7, [1.0] * 7 + [0.0], [1.0] * 7 + [float("inf")], None, "8"):  # head_dim 16: 8 needed
        with pytest.raises(ValueError, match=r"rope_type 'freq_factors' needs freq_factors, 8 positive finite"):
            ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "freq_factors", "freq_factors": factors}})
    assert ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "freq_factors", "freq_factors": [2] * 8}})
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "intermediate_size"})


def test_engine_argument_errors(llama_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(llama_dir), device="cpu", max_num_seq=4)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(llama_dir), device="cpu", block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(llama_dir), device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(llama_dir), device="cpu", max_model_len=100_000)


@pytest.mark.parametrize("name, value, accepted", [
    ("enable_prefix_caching", "false", "True or False"), ("enforce_eager", 0, "True or False"),
    ("seed", "abc", "an integer"), ("seed", True, "an integer"), ("max_model_len", True, "a positive integer or None"),
    ("num_kv_blocks", False, "a positive integer or None"), ("kv_cache_memory_fraction", "0.5", "a number in (0, 1]"),
    ("gpu_memory_utilization", 0, "a number in (0, 1] or None"), ("gpu_memory_utilization", True, "a number in (0, 1]"),
])
def test_engine_arguments_of_the_wrong_type_are_refused_naming_them(name, value, accepted):
    """(A string "false" would read as True; True would be a context of one token.)"""
    from ninefold.llm.config import split_engine_args

    with pytest.raises(ValueError, match=rf"{name}: got {value!r}; expected {re.escape(accepted)}"):
        split_engine_args({name: value})


def test_both_kv_cache_sizings_at_once_are_refused():
    from ninefold.llm.config import split_engine_args

    with pytest.raises(ValueError, match=r"gpu_memory_utilization: got 0.5 beside kv_cache_memory_fraction=0.8; "
                                         "give one of the two"):
        split_engine_args({"gpu_memory_utilization": 0.5, "kv_cache_memory_fraction": 0.8})
    assert split_engine_args({"gpu_memory_utilization": 0.5}).kv_cache_memory_fraction is None


def test_empty_batches_give_empty_results(llm):
    """As vLLM: generate([]), generate(prompt_token_ids=[]) and chat([]) return []; an empty conversation or prompt
    inside a batch is still an error."""
    assert llm.generate([]) == [] and llm.generate(prompt_token_ids=[]) == [] and llm.chat([]) == []
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]])


def test_bad_requests_fail_alone(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(prompt_token_ids=[[1, vocab]], sampling_params=greedy)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[[5] * llm.engine.max_model_len], sampling_params=greedy)
    # max_model_len shrinks to what the cache holds (32 blocks of 4), so a request always fits once alone
    assert llm.engine.max_model_len == 128
    (long,) = llm.generate(prompt_token_ids=[[5] * 100], sampling_params=SamplingParams(max_tokens=60, ignore_eos=True))
    assert len(long.outputs[0].token_ids) == 28 and long.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]], sampling_params=greedy)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(["hi"], sampling_params={"temperature": 0})
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["hi"], SamplingParams(logit_bias={vocab + 5: 1.0}))
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=greedy)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.pool.num_free + len(llm.engine.blocks._evictable) == 32


def test_a_token_budget_above_max_model_len_is_profiled_within_the_rotary_table(llama_dir):
    """The activation profile (run at start-up on GPUs, before the KV pool is sized) packs a budget
    longer than max_model_len as several sequences: positions past the rotary table would read out
    of bounds (an illegal memory access on CUDA)."""
    from ninefold.llm.engine import LLMEngine

    engine = LLMEngine(str(llama_dir), device="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=200)
    assert engine.model.cos_sin.shape[0] == 64
    engine._profile_forward()  # raised IndexError before (positions up to 199)


@pytest.mark.parametrize("extra, message", [
    (dict(partial_rotary_factor=0.2), r"partial_rotary_factor: got 0.2, which rotates 3 of the head's 16 dimensions; "
     r"supported: an even count of at least 2 with an even remainder"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}),
     r"partial_rotary_factor: got 1.5; expected a number in \(0, 1\]"),
    (dict(partial_rotary_factor=0.0), r"partial_rotary_factor: got 0.0; expected a number in \(0, 1\]"),
    (dict(partial_rotary_factor=0.1), r"partial_rotary_factor: got 0.1, which rotates 1 of the head's 16"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
     r"rope_scaling: got rope_type 'dynamic'; supported: 'default', 'llama3', 'freq_factors', 'longrope'"),
])
def test_phi3_configs_that_cannot_run_are_refused_naming_the_key(extra, message):
    from ninefold.llm.config import ModelConfig

    config = dict(architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_hidden_layers=1, vocab_size=50, **extra)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(config)
    ModelConfig.from_dict({k: v for k, v in config.items() if k not in extra})  # the plain config loads
