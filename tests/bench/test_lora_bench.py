"""``python -m ninefold.bench.lora`` on a tiny checkpoint: ninefold and transformers + peft agree on the adapted
logits before anything is timed; the GGUF LoRA file for llama.cpp has llama.cpp's names, shapes and q/k order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ninefold.bench import lora

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llm"))
from tiny_models import build_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("lora-bench") / "llama", "llama")


def test_lora_bench_checks_then_times(tiny, tmp_path, capsys):
    code = lora.main(["--model", str(tiny), "--rank", "4", "--adapters", "2", "--decode-tokens", "4", "--repeats", "1",
                      "--systems", "ninefold,transformers", "--work-dir", str(tmp_path / "adapters"),
                      "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "lora_bench.json").read_text())
    ninefold, peer = report["rows"]
    assert ninefold["system"] == "ninefold" and peer["system"] == "transformers+peft"
    assert peer["cosine_vs_ninefold"] > 0.9999
    assert all(ninefold[k] > 0 for k in ("base_tok_s", "lora_tok_s", "mixed_tok_s"))
    assert "ninefold against the best peer" in capsys.readouterr().out
    assert (tmp_path / "lora_bench.png").stat().st_size > 0


def test_a_disagreeing_peer_stops_the_run(tiny, tmp_path, monkeypatch):
    real = lora.bench_transformers

    def other(*args, **kwargs):
        row, logits = real(*args, **kwargs)
        return row, np.roll(logits, 1)

    monkeypatch.setattr(lora, "bench_transformers", other)
    assert lora.main(["--model", str(tiny), "--rank", "2", "--adapters", "1", "--decode-tokens", "2", "--repeats",
                      "1", "--systems", "ninefold,transformers", "--work-dir", str(tmp_path / "a")]) == 1


def test_gguf_lora_file_follows_llama_cpps_layout(tmp_path):
    import gguf
    from test_gguf import hf_weights, write_gguf

    from ninefold.llm.config import ModelConfig
    from ninefold.llm.loader import load_checkpoint

    model = write_gguf(tmp_path / "m.gguf", hf_weights(), gguf.GGMLQuantizationType.F32)

    config = ModelConfig.from_dict(load_checkpoint(str(model), "auto").config)
    tensors = lora.write_peft_adapter(tmp_path / "peft", config, rank=4, seed=0)
    path = lora.write_gguf_lora(tmp_path / "a.gguf", tensors, config, str(model), rank=4)
    reader = gguf.GGUFReader(str(path))
    fields = {k: f for k, f in reader.fields.items()}
    assert bytes(fields["general.type"].parts[-1]).decode() == "adapter"
    by_name = {t.name: t for t in reader.tensors}
    assert len(by_name) == 2 * 7 * config.num_layers
    q_b = by_name["blk.0.attn_q.weight.lora_b"]
    d, q = config.hidden_size, config.num_heads * config.head_dim
    assert list(by_name["blk.0.attn_q.weight.lora_a"].shape) == [d, 4] and list(q_b.shape) == [4, q]
    hf_b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].numpy()
    stored = np.asarray(q_b.data).reshape(q, 4)
    half = config.head_dim // 2  # llama.cpp interleaves each head's rotary halves: row 1 is HF's row `half`
    np.testing.assert_array_equal(stored[0], hf_b[0])
    np.testing.assert_array_equal(stored[1], hf_b[half])
    assert torch.equal(torch.from_numpy(np.asarray(by_name["blk.1.ffn_down.weight.lora_a"].data)),
                       tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"])
