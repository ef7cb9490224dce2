"""A tiny Llama checkpoint for server tests: random weights plus one scripted greedy path.

The model has one layer whose attention and MLP outputs are zeroed, so it is a bigram model: the
next-token logits depend only on the current token. Most rows are random (sampling is random,
seeds matter), and one chain of single-byte tokens is wired so that after ``trigger`` greedy
decoding spells ``CHAIN_TEXT`` (CJK characters, three byte-level tokens each) and then emits EOS.
That gives a deterministic multi-byte stream to check incremental detokenization end to end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CHAIN_TEXT = "中文好"
TRIGGER_CHAR = "~"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny test model for the ninefold server.",
    "Streaming tokens arrive one by one; the client reads server-sent events.",
    "Numbers 0123456789 and punctuation: !?,.;:'\"()[]{}",
    "汉字测试：中文字符需要多个字节。你好，世界！",
    "日本語のテキストも少し含めます。",
]


@dataclass(frozen=True)
class TinyModel:
    """Where the checkpoint is and the ids of its scripted chain."""

    path: Path
    vocab_size: int
    eos_id: int
    trigger_id: int
    chain_ids: tuple[int, ...]  # the tokens greedy decoding emits after the trigger, before EOS


def _byte_token_strings() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tiny_model(path: Path, vocab_size: int = 384, seed: int = 0, model_vocab: int | None = None) -> TinyModel:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.

    ``model_vocab``: a model with fewer embedding rows than the tokenizer has tokens (default: as many).

    The weights are written with safetensors directly (HF Llama names), which avoids importing
    transformers' model code; tests/server/test_tiny_model.py checks the result with transformers.
    """
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    eos_id = tokenizer.token_to_id("<|im_end|>")
    byte_tokens = _byte_token_strings()
    trigger_id = tokenizer.token_to_id(TRIGGER_CHAR)
    chain_ids = tuple(tokenizer.token_to_id(byte_tokens[b]) for b in CHAIN_TEXT.encode("utf-8"))
    assert len(set(chain_ids + (trigger_id,))) == len(chain_ids) + 1, "chain tokens must be distinct"
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHATML,
        "model_max_length": 8192,
    }))

    vocab = model_vocab or tokenizer.get_vocab_size(with_added_tokens=True)
    assert max(chain_ids + (trigger_id, eos_id)) < vocab, "the scripted tokens must be in the model's vocabulary"
    hidden, inter, heads, kv_heads, head_dim, chain_dims = 64, 128, 4, 2, 16, 16
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale

    prefix = "model.layers.0."
    tensors = {
        prefix + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        prefix + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        prefix + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        prefix + "self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim),  # attention adds nothing
        prefix + "mlp.gate_proj.weight": rand(inter, hidden),
        prefix + "mlp.up_proj.weight": rand(inter, hidden),
        prefix + "mlp.down_proj.weight": torch.zeros(hidden, inter),  # nor does the MLP: a bigram model
        prefix + "input_layernorm.weight": torch.ones(hidden),
        prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    embed = rand(vocab, hidden, scale=1.0)
    embed[:, :chain_dims] = 0.0
    head = rand(vocab, hidden, scale=0.25)
    head[:, :chain_dims] = 0.0
    script = (trigger_id,) + chain_ids + (eos_id,)
    for step, (current, following) in enumerate(zip(script, script[1:])):
        embed[current] = 0.0
        embed[current, step] = 1.0  # one-hot; rms-normalized to 8 on that dimension
        head[following, step] = 10.0  # logit 80 for the scripted successor, 0 for every other token
    tensors["model.embed_tokens.weight"] = embed
    tensors["lm_head.weight"] = head
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return TinyModel(path, vocab, eos_id, trigger_id, chain_ids)
