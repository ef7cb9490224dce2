"""The test checkpoint is a valid HF Llama and its scripted greedy path is what the tests expect."""

import torch

from .tiny_model import CHAIN_TEXT


def test_transformers_loads_it_and_greedy_follows_the_chain(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model.path))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model.path))
    prompt = torch.tensor([[5, 6, tiny_model.trigger_id]])
    out = model.generate(prompt, max_new_tokens=len(tiny_model.chain_ids) + 3, do_sample=False)
    new = out[0, 3:].tolist()
    assert new[: len(tiny_model.chain_ids)] == list(tiny_model.chain_ids)
    assert new[len(tiny_model.chain_ids)] == tiny_model.eos_id
    assert tokenizer.decode(new, skip_special_tokens=True) == CHAIN_TEXT
