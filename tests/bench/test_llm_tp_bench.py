"""``python -m ninefold.bench.llm_tp`` end to end on the CPU with a tiny random model: one and two ranks."""

import json

from ninefold.bench import llm_tp


def test_the_bench_measures_each_size_and_writes_its_results(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, vocab_size=300, max_position_embeddings=256, head_dim=16)))
    assert llm_tp.main(["--model", str(config), "--device", "cpu", "--sizes", "1,2", "--batch", "1,3",
                        "--prompt-len", "12", "--new-tokens", "5", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "llm_tp.json").read_text())
    assert [r["tensor_parallel_size"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["ttft_ms"] > 0 and set(row["decode_tok_s"]) == {"1", "3"}
        assert all(rate > 0 for rate in row["decode_tok_s"].values())
    table = capsys.readouterr().out
    assert "b=3 tok/s" in table and "wrote" in table
