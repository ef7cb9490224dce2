"""Checkpoint loading on broken or unusual Hugging Face directories and GGUF files.

Each case is a tiny checkpoint written here (transformers' save_pretrained, safetensors files,
GGUF files from ``test_gguf``'s writer). A checkpoint the model would misread is refused with
an error naming the tensor or file; one transformers reads in a particular way (tied heads that
differ, templates beside tokenizer_config.json) is read the same way here.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import CHAT_TEMPLATE, build_model_dir
from transformers import AutoModelForCausalLM

from ninefold.llm.config import ModelConfig
from ninefold.llm.engine import LLMEngine
from ninefold.llm.loader import MissingModelFile, load_checkpoint
from ninefold.llm.sampling import SamplingParams
from ninefold.llm.tokenizer import Tokenizer

from .test_gguf import hf_weights, write_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
PROMPTS = ([5, 17, 42, 99, 3], [7, 8, 250, 11, 12, 13, 14, 200, 31])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(file: Path, **changes) -> dict:
    data = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    file.write_text(json.dumps(data))
    return data


def _save(tensors: dict, file: Path) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def _logits(path: Path) -> torch.Tensor:
    """ninefold's last-position logits of ``PROMPTS`` (float32 on the CPU)."""
    engine = LLMEngine(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=32,
                       enable_prefix_caching=False)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(engine.build_request(list(prompt), GREEDY, f"r{i}"))
    return engine.runner.forward_logits(engine.scheduler.schedule())


def _assert_matches_transformers(path: Path) -> None:
    ours = _logits(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for row, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(ours[row], ref, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- tensors vs config


def test_an_unexpected_tensor_is_named_not_ignored(tmp_path, llama_dir):
    """A q_proj bias in a checkpoint whose config has no attention bias was dropped silently."""
    path = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones(64)
    _save(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' in "
                                         r"model\.safetensors"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("switch, tensor", [("attention_bias", r"self_attn\.o_proj\.bias"),
                                            ("mlp_bias", r"mlp\.(gate|up|down)_proj\.bias")])
def test_llama_biases_the_model_cannot_apply_are_refused(tmp_path, switch, tensor):
    """transformers' Llama with attention_bias has an o_proj bias too, with mlp_bias biases on the
    MLP; the model definition applies neither, so such a checkpoint gave wrong logits."""
    path = build_model_dir(tmp_path / "m", "llama", **{switch: True})
    with pytest.raises(ValueError, match=rf"unexpected tensor 'model\.layers\.0\.{tensor}' in model\.safetensors"):
        LLMEngine(str(path), device="cpu", num_kv_blocks=8)


def test_old_per_layer_rotary_buffers_are_ignored(tmp_path, llama_dir):
    path = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    _save(tensors, path / "model.safetensors")
    ckpt = load_checkpoint(str(path))
    assert not any("inv_freq" in name for name in ckpt.tensors)
    _assert_matches_transformers(path)


def test_tied_config_with_a_different_lm_head_uses_it_as_transformers_does(tmp_path, model_dirs):
    """transformers 5 does not tie a head that the checkpoint stores with other values than the
    embedding; the loader used the embedding, so every logit differed."""
    path = _copy(model_dirs["llama_tied"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    tensors["lm_head.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape, generator=gen) * 0.05
    _save(tensors, path / "model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _assert_matches_transformers(path)
    with pytest.warns(UserWarning, match="lm_head.weight differs"):
        ckpt = load_checkpoint(str(path))
    assert ckpt.config["tie_word_embeddings"] is False


def test_tied_checkpoint_storing_only_lm_head(tmp_path, model_dirs):
    """transformers ties the other way round when only the head is stored; the loader raised."""
    path = _copy(model_dirs["llama_tied"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    _save(tensors, path / "model.safetensors")
    _assert_matches_transformers(path)


def test_a_tied_checkpoint_with_an_equal_head_copy_loads(tmp_path, model_dirs):
    path = _copy(model_dirs["llama_tied"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    _save(tensors, path / "model.safetensors")
    ckpt = load_checkpoint(str(path))
    assert "lm_head.weight" not in ckpt.tensors and ckpt.config["tie_word_embeddings"] is True


def test_non_float_tensors_are_refused(tmp_path, llama_dir):
    """An int8 matrix was cast to float and used as if it were the weight."""
    path = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.ones(64, 128, dtype=torch.int8)
    _save(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' in model\.safetensors has "
                                         r"dtype torch\.int8; supported: float32, float16, bfloat16"):
        load_checkpoint(str(path))


def test_a_quantization_config_is_refused_by_name(tmp_path, llama_dir):
    """A quantized checkpoint's config loaded silently when its tensors happened to have float names."""
    path = _copy(llama_dir, tmp_path / "m")
    _edit_json(path / "config.json", quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(ValueError, match=r"config\.json: quantization_config: got .*'fp8'.*supported: unquantized"):
        load_checkpoint(str(path))


def test_misshapen_tensor_names_its_file(tmp_path, llama_dir):
    path = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 32)
    _save(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' in model\.safetensors has shape "
                                         r"\(128, 32\), expected \(128, 64\)"):
        load_checkpoint(str(path))


# ----------------------------------------------------------------------------- files


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, model_dirs):
    """The qwen3 tiny checkpoint saved by transformers in several shards with an index."""
    src = model_dirs["qwen3"]
    path = tmp_path_factory.mktemp("sharded") / "qwen3"
    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).save_pretrained(path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, path / name)
    assert len(list(path.glob("model-*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    return path


def test_sharded_checkpoint_matches_transformers(sharded_dir):
    _assert_matches_transformers(sharded_dir)


def _sharded_tensors(path: Path) -> dict:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return {k: v for shard in sorted(set(index["weight_map"].values())) for k, v in load_file(path / shard).items()}


@pytest.mark.parametrize("layout", ["single file", "index and shards", "both"])
def test_weight_files_are_chosen_as_transformers_chooses(tmp_path, sharded_dir, layout):
    """With both model.safetensors and an index, transformers reads model.safetensors; the index was read."""
    path = _copy(sharded_dir, tmp_path / "m")
    tensors = _sharded_tensors(path)
    if layout != "index and shards":
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2  # tells the two sources apart
        _save(tensors, path / "model.safetensors")
    if layout == "single file":
        for file in [path / "model.safetensors.index.json", *path.glob("model-*.safetensors")]:
            file.unlink()
    loaded = load_checkpoint(str(path)).tensors
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    _assert_matches_transformers(path)


def test_index_naming_a_tensor_no_shard_holds(tmp_path, sharded_dir):
    path = _copy(sharded_dir, tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.k_norm.weight"
    shard = index["weight_map"][name]
    tensors = load_file(path / shard)
    del tensors[name]
    _save(tensors, path / shard)
    with pytest.raises(ValueError, match=rf"model\.safetensors\.index\.json: maps tensor '{name}' to {shard}, "
                                         "but no shard holds it"):
        load_checkpoint(str(path))


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path, sharded_dir):
    """The later shard's copy won silently."""
    path = _copy(sharded_dir, tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    first, last = load_file(path / shards[0]), load_file(path / shards[-1])
    last[name] = torch.zeros_like(first[name])
    _save(last, path / shards[-1])
    with pytest.raises(ValueError, match=rf"tensor '{name}' is stored twice, in {shards[0]} and {shards[-1]}"):
        load_checkpoint(str(path))


def test_an_index_without_a_weight_map_is_named(tmp_path, sharded_dir):
    path = _copy(sharded_dir, tmp_path / "m")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: 'weight_map' must be"):
        load_checkpoint(str(path))


def test_other_safetensors_files_beside_model_safetensors_are_not_read(tmp_path, llama_dir):
    """Every *.safetensors file was merged in: a stray file's tensors replaced the model's."""
    path = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    _save({"model.embed_tokens.weight": torch.zeros_like(tensors["model.embed_tokens.weight"])},
          path / "optimizer_state.safetensors")
    _assert_matches_transformers(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_safetensors_file_is_named(tmp_path, llama_dir, damage):
    path = _copy(llama_dir, tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a model")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_checkpoint(str(path))


def test_a_malformed_tokenizer_json_is_named(tmp_path, llama_dir):
    path = _copy(llama_dir, tmp_path / "m")
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizer\.json"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json"])
def test_a_json_file_that_is_not_an_object_is_named(tmp_path, llama_dir, name):
    path = _copy(llama_dir, tmp_path / "m")
    (path / name).write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}: expected a JSON object, got a list"):
        load_checkpoint(str(path))


def test_pytorch_bin_only_directory_says_what_it_found(tmp_path, llama_dir):
    path = _copy(llama_dir, tmp_path / "m")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(MissingModelFile, match=r"model\.safetensors not found.*found pytorch_model\.bin"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_file_that_is_not_a_model_is_named(llama_dir, name):
    """A path to a file inside the directory said 'config.json not found in .../model.safetensors'."""
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}' is a file but not a GGUF file; give a "
                                         "Hugging Face model directory"):
        load_checkpoint(str(llama_dir / name))


# ----------------------------------------------------------------------------- config.json


def test_llama3_rope_scaling_without_factor_is_named(tmp_path, llama_dir):
    path = _copy(llama_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    del config["rope_parameters"]["factor"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"rope_scaling: rope_type 'llama3' needs factor \(a number > 0\); got None"):
        LLMEngine(str(path), device="cpu", num_kv_blocks=8)
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_hidden_layers=2, vocab_size=100)
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                        "high_freq_factor": 4.0}})
    with pytest.raises(ValueError, match="rope_scaling: got 'llama3'; expected a dict"):
        ModelConfig.from_dict({**base, "rope_scaling": "llama3"})


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_qwen_sliding_window_applies_only_with_use_sliding_window(tmp_path, model_dirs, variant):
    """transformers ignores a Qwen sliding_window unless use_sliding_window is set; for Qwen3 the
    engine capped max_model_len at it."""
    path = _copy(model_dirs[variant], tmp_path / "m")
    _edit_json(path / "config.json", sliding_window=64, use_sliding_window=False)
    engine = LLMEngine(str(path), device="cpu", max_model_len=512, num_kv_blocks=64, block_size=8)
    assert engine.model_config.sliding_window is None and engine.max_model_len == 512
    _edit_json(path / "config.json", use_sliding_window=True)
    assert ModelConfig.from_dict(json.loads((path / "config.json").read_text())).sliding_window == 64


def test_config_without_architectures_goes_by_model_type(tmp_path, llama_dir):
    path = _copy(llama_dir, tmp_path / "m")
    _edit_json(path / "config.json", architectures=None)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    _assert_matches_transformers(path)
    _edit_json(path / "config.json", model_type="gpt2")
    with pytest.raises(ValueError, match=r"architectures: missing, and model_type is 'gpt2'; supported"):
        load_checkpoint(str(path))


def test_generation_config_eos_list_and_int(tmp_path, llama_dir):
    path = _copy(llama_dir, tmp_path / "m")
    _edit_json(path / "generation_config.json", eos_token_id=[1, 3])
    assert LLMEngine(str(path), device="cpu", num_kv_blocks=8).eos_token_ids == (1, 3)
    _edit_json(path / "generation_config.json", eos_token_id=4)
    assert LLMEngine(str(path), device="cpu", num_kv_blocks=8).eos_token_ids == (1, 4)


# ----------------------------------------------------------------------------- chat templates


MESSAGES = [{"role": "user", "content": "Hello world"}]


def _saved_by_transformers(tmp_path: Path, llama_dir: Path, chat_template) -> Path:
    from transformers import AutoTokenizer

    path = _copy(llama_dir, tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = chat_template
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    tok.save_pretrained(str(path))
    assert (path / "chat_template.jinja").is_file()
    return path


def test_chat_template_jinja_wins_over_tokenizer_config_as_in_transformers(tmp_path, llama_dir):
    """A stale template in tokenizer_config.json was used instead of chat_template.jinja."""
    from transformers import AutoTokenizer

    path = _saved_by_transformers(tmp_path, llama_dir, CHAT_TEMPLATE)
    _edit_json(path / "tokenizer_config.json", chat_template="STALE {{ messages[0]['content'] }}")
    want = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(MESSAGES, tokenize=False,
                                                                        add_generation_prompt=True)
    assert want.startswith("<|im_start|>user")
    ckpt = load_checkpoint(str(path))
    assert Tokenizer(ckpt.tokenizer, ckpt.tokenizer_config).apply_chat_template(MESSAGES) == want
    assert Tokenizer.from_dir(path).apply_chat_template(MESSAGES) == want


def test_additional_chat_templates_keep_the_default(tmp_path, llama_dir):
    path = _saved_by_transformers(tmp_path, llama_dir, {"default": CHAT_TEMPLATE, "tool_use": "TOOLS"})
    assert (path / "additional_chat_templates" / "tool_use.jinja").is_file()
    ckpt = load_checkpoint(str(path))
    assert {t["name"] for t in ckpt.tokenizer_config["chat_template"]} == {"default", "tool_use"}
    assert Tokenizer(ckpt.tokenizer, ckpt.tokenizer_config).apply_chat_template(MESSAGES).startswith("<|im_start|>")


def test_chat_template_json_is_the_last_resort(tmp_path, llama_dir):
    path = _copy(llama_dir, tmp_path / "m")
    _edit_json(path / "tokenizer_config.json", chat_template=None)
    (path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    ckpt = load_checkpoint(str(path))
    rendered = Tokenizer(ckpt.tokenizer, ckpt.tokenizer_config).apply_chat_template(MESSAGES)
    assert rendered == "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- GGUF


def test_gguf_file_without_the_suffix_or_under_home(tmp_path, monkeypatch):
    """A GGUF file named otherwise, or given as ~/..., was not recognised."""
    path = write_gguf(tmp_path / "model.gguf", hf_weights(), arch="llama")
    other = tmp_path / "model.bin"
    shutil.copy(path, other)
    assert load_checkpoint(str(other), quantization="none").config["architectures"] == ["LlamaForCausalLM"]
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_checkpoint("~/model.gguf", quantization="none").source == str(path)


@pytest.mark.parametrize("extra", ["q_norm", "k_bias"])
def test_gguf_tensors_the_model_would_ignore_are_refused(tmp_path, extra):
    """The GGUF loader accepts q/k norms and q/k/v biases as optional tensors, but the model reads
    norms only for Qwen3 and biases only when blk.0.attn_q.bias is there: a Llama file with
    q/k norms, or with k biases alone, loaded with those tensors silently unused."""
    weights = hf_weights("llama")
    donor = hf_weights("qwen3" if extra == "q_norm" else "qwen2")
    suffix = ("q_norm.weight", "k_norm.weight") if extra == "q_norm" else ("k_proj.bias",)
    weights.update({k: v for k, v in donor.items() if k.endswith(suffix)})
    path = write_gguf(tmp_path / "m.gguf", weights, arch="llama")
    tensor = r"self_attn\.[qk]_norm\.weight" if extra == "q_norm" else r"self_attn\.k_proj\.bias"
    with pytest.raises(ValueError, match=rf"GGUF file .*m\.gguf: checkpoint: unexpected tensor "
                                         rf"'model\.layers\.0\.{tensor}'"):
        load_checkpoint(str(path), quantization="none")


def test_gguf_without_any_vocabulary_size_is_named(tmp_path):
    """No vocab_size key, no token list and no embedding table raised int(None)'s TypeError."""
    import numpy as np
    from gguf import GGUFWriter

    from ninefold.llm.gguf import GGUFError, load_gguf

    path = tmp_path / "novocab.gguf"
    writer = GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                       ("attention.head_count", 2), ("context_length", 64)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("output_norm.weight", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="gives no vocabulary size"):
        load_gguf(path)


def test_an_empty_model_string_is_named(tmp_path, monkeypatch):
    """'' became Path('.'), read as a model directory: 'config.json not found in .'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="model: got an empty string"):
        load_checkpoint("")
