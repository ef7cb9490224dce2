"""Tiny random-weight Hugging Face checkpoints of every supported variant, built offline.

``build_model_dir(path, variant)`` writes config.json, model.safetensors, generation_config.json,
a byte-level BPE tokenizer.json trained here on a small corpus, and a tokenizer_config.json
with a ChatML chat template; ``write_embedding_model(path, ...)`` an embedding checkpoint of the decoder alone.
Other test suites may import it (``tests/llm`` on ``sys.path``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VARIANTS = ("llama", "llama_tied", "mistral", "qwen2", "qwen3")
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Hello world! How are you today? I am fine, thank you.",
    "Large language models generate text one token at a time.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: + - * / = < > ( ) [ ] { }",
    "Ünïcödé: café, naïve, 東京, 北京, 😀 emoji and more text for the tokenizer.",
] * 20


def build_tokenizer(vocab_size: int = 320):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``CORPUS`` (special tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def hf_config(variant: str, vocab_size: int, **overrides):
    """A transformers config object of ``variant`` with hidden 64 and 2 layers."""
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, initializer_range=0.05)
    if variant == "llama":
        cls = LlamaConfig
        common.update(rope_theta=10000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0, original_max_position_embeddings=64))
    elif variant == "llama_tied":
        cls = LlamaConfig
        common.update(tie_word_embeddings=True, num_key_value_heads=1)
    elif variant == "mistral":
        cls = MistralConfig
        common.update(sliding_window=None, head_dim=16)
    elif variant == "qwen2":
        cls = Qwen2Config
        common.update(tie_word_embeddings=True)
    elif variant == "qwen3":
        cls = Qwen3Config
        common.update(head_dim=32, tie_word_embeddings=False)
    elif variant == "phi3":  # (not in VARIANTS: tests/llm/test_phi3.py covers it)
        cls = Phi3Config
        common.update(tie_word_embeddings=False, pad_token_id=0, original_max_position_embeddings=512)
    else:
        raise ValueError(f"variant: {variant!r}; expected one of {VARIANTS}")
    common.update(overrides)
    return cls(**common)


def build_model_dir(path: str | Path, variant: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a complete tiny HF checkpoint directory of ``variant``; returns its path."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    config = hf_config(variant, tok.get_vocab_size(), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # q/k/v biases start at zero; make them matter
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>", "add_bos_token": variant.startswith("llama"),
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return path


def write_embedding_model(path, variant="qwen3", architecture=None, pooling=None, normalize=True, **overrides):
    """A tiny embedding checkpoint: the decoder alone (``AutoModel``), as Qwen3-Embedding and e5-mistral are
    saved; ``architecture`` overrides what config.json names (Qwen3-Embedding's says ``Qwen3ForCausalLM``);
    ``pooling``: a sentence-transformers Pooling mode written to modules.json."""
    from transformers import AutoModel

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    config = hf_config(variant, tok.get_vocab_size(), **overrides)
    torch.manual_seed(3)
    model = AutoModel.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "</s>"}))
    if architecture is not None:
        data = json.loads((path / "config.json").read_text())
        data["architectures"] = [architecture]
        (path / "config.json").write_text(json.dumps(data))
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": config.hidden_size, "pooling_mode_cls_token": pooling == "cls",
             "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": pooling == "max",
             "pooling_mode_lasttoken": pooling == "last"}))
    return path


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapter(model_dir, path, r=8, target_modules=LORA_MODULES, seed=1, **options) -> Path:
    """A PEFT LoRA adapter for the checkpoint in ``model_dir``, written by peft itself (its ``B`` matrices drawn at
    random: peft starts them at zero, which would make the adapter a no-op); ``options`` go to ``LoraConfig``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, target_modules=list(target_modules), lora_dropout=0.0, **{"lora_alpha": 16, **options})
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(path)
    return Path(path)
