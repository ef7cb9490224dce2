"""LoRA adapters over time: a host cache that drops an adapter still in a slot, an id unloaded and loaded again
with other weights, sequences waiting for a slot not overtaken by later ones, and adapter files that cannot be
read (a ValueError naming the file, never another exception)."""

import json

import pytest
import torch
from test_lora import _references, peft_greedy, request
from test_parity import prompts_for
from tiny_models import build_model_dir, write_lora_adapter

from ninefold import LoRARequest, SamplingParams
from ninefold.llm.engine import LLMEngine
from ninefold.llm.sequence import Status


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-lifecycle")
    base = build_model_dir(root / "base", "llama")
    adapters = {"a": write_lora_adapter(base, root / "a", r=4, seed=1),
                "b": write_lora_adapter(base, root / "b", r=4, seed=2)}
    return root, base, adapters


def engine_for(base, **kwargs) -> LLMEngine:
    return LLMEngine(str(base), device="cpu", enable_lora=True, max_lora_rank=8, block_size=4, num_kv_blocks=128,
                     **kwargs)


def params(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def test_an_adapter_dropped_from_the_host_cache_keeps_its_slot(setup):
    """max_cpu_loras=2 holds two adapters: reading a third drops 'a' while its sequence runs; a later request for
    'a' joins the running one in its slot instead of waiting for a second copy."""
    _, base, adapters = setup
    engine = engine_for(base, max_loras=2, max_cpu_loras=2)
    first = engine.build_request([5, 6, 7], params(20), "a1", lora_request=request(adapters, "a", 1))
    engine.add_request(first)
    engine.step()
    engine.build_request([5, 6], params(4), "b1", lora_request=request(adapters, "b", 2))
    engine.build_request([5, 6], params(4), "c1", lora_request=LoRARequest("c", 3, str(adapters["b"])))
    assert 1 not in engine.lora_slots._cached  # dropped from the host cache, still in its slot
    again = engine.build_request([8, 9, 10], params(4), "a2", lora_request=request(adapters, "a", 1))
    assert again.seqs[0].lora_adapter is first.seqs[0].lora_adapter  # taken from the slot, not read again
    engine.add_request(again)
    engine.step()
    assert again.seqs[0].status is Status.RUNNING and again.seqs[0].lora_slot == first.seqs[0].lora_slot


def test_an_id_loaded_again_after_forget_gets_new_weights_and_no_old_cache(setup, tmp_path):
    _, base, adapters = setup
    engine = engine_for(base, max_loras=1)
    path = tmp_path / "changing"
    write_lora_adapter(base, path, r=4, seed=5)
    prompt = prompts_for(320, lengths=(21,), seed=4)[0]
    lora = LoRARequest("changing", 1, str(path))

    def run():
        engine.add_request(engine.build_request(prompt, params(16), "x", lora_request=lora))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        return outs[0]

    old = run()
    assert run().num_cached_tokens == 20  # the same weights: the cached prefix serves
    expected_old = peft_greedy(base, path, prompt, 16)
    assert old.outputs[0].token_ids == expected_old
    write_lora_adapter(base, path, r=4, seed=6)  # retrained in place, then unloaded and loaded again
    engine.lora_slots.forget(1)
    new = run()
    _references.pop((str(base), str(path), tuple(prompt), 16))  # the reference reads the new files
    assert new.num_cached_tokens == 0
    assert new.outputs[0].token_ids == peft_greedy(base, path, prompt, 16) != expected_old


def test_sequences_waiting_for_a_slot_are_not_overtaken_by_later_adapter_sequences(setup):
    """One slot, 'a' running: 'b' waits for it, and later 'a' requests wait behind 'b' (so 'a' finishes and frees
    the slot); a request without an adapter still goes ahead."""
    _, base, adapters = setup
    engine = engine_for(base, max_loras=1, max_cpu_loras=2)
    a, b = request(adapters, "a", 1), request(adapters, "b", 2)
    order = [("a1", a, 6), ("b1", b, 6), ("a2", a, 6), ("base", None, 6), ("a3", a, 6)]
    requests = {rid: engine.build_request([5 + i, 6, 7], params(n), rid, lora_request=lora)
                for i, (rid, lora, n) in enumerate(order)}
    for r in requests.values():
        engine.add_request(r)
    admitted = []
    while engine.has_unfinished_requests():
        engine.step()
        for rid, r in requests.items():
            if rid not in admitted and r.seqs[0].status is not Status.WAITING:
                admitted.append(rid)
    assert admitted.index("base") < admitted.index("b1") < admitted.index("a2") < admitted.index("a3")
    assert engine.lora_slots.refs == [0]


@pytest.mark.parametrize("broken, match", [
    ("truncated", r"cannot read .*adapter_model.safetensors"),
    ("alpha", r"lora_alpha 'sixteen' .*expected a number"),
    ("pattern", r"alpha_pattern key '\(' is not a regular expression"),
    ("pickle", r"cannot read .*adapter_model.bin"),
])
def test_unreadable_adapters_are_value_errors(setup, tmp_path, broken, match):
    _, base, adapters = setup
    path = tmp_path / broken
    path.mkdir()
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    weights = (adapters["a"] / "adapter_model.safetensors").read_bytes()
    if broken == "truncated":
        (path / "adapter_model.safetensors").write_bytes(weights[: len(weights) // 2])
    elif broken == "pickle":
        (path / "adapter_model.bin").write_bytes(b"not a pickle at all")
    else:
        (path / "adapter_model.safetensors").write_bytes(weights)
        config.update({"lora_alpha": "sixteen"} if broken == "alpha" else {"alpha_pattern": {"(": 4}})
    (path / "adapter_config.json").write_text(json.dumps(config))
    engine = engine_for(base)
    with pytest.raises(ValueError, match=match):
        engine.build_request([5, 6], params(2), lora_request=LoRARequest(broken, 9, str(path)))
    assert engine.lora_slots._cached == {} and engine.lora_slots._names == {}


def test_max_cpu_loras_below_max_loras_is_refused(setup):
    _, base, _ = setup
    with pytest.raises(ValueError, match=r"max_cpu_loras: got 1; expected at least max_loras \(2\)"):
        engine_for(base, max_loras=2, max_cpu_loras=1)


def test_a_refused_request_reads_no_adapter(setup):
    _, base, adapters = setup
    engine = engine_for(base)
    with pytest.raises(ValueError, match="logprobs: got 5000"):
        engine.build_request([5] * 10, SamplingParams(logprobs=5000), lora_request=request(adapters, "a", 1))
    assert engine.lora_slots._cached == {}
    assert torch.count_nonzero(engine.lora_slots.a["qkv"]) == 0


def test_kv_reserve_counts_the_adapter_graphs_logits():
    """On CUDA with adapters and graphs, the KV pool leaves room for the second graph set's logits at every
    captured size; nothing is reserved without adapters, eagerly or on the CPU."""
    from types import SimpleNamespace

    from ninefold.llm.cuda_graphs import capture_sizes

    engine = LLMEngine.__new__(LLMEngine)  # only the fields _lora_graph_bytes reads
    engine.config = SimpleNamespace(enforce_eager=False, cuda_graph_max_batch=256, max_num_seqs=64)
    engine.model_config = SimpleNamespace(vocab_size=1000)
    engine.dtype, engine.device, engine.lora_slots = torch.bfloat16, torch.device("cuda"), object()
    engine.parallel_group = None
    assert engine._lora_graph_bytes() == sum(capture_sizes(64)) * 1000 * 2
    engine.parallel_group = object()  # tensor-parallel engines capture no graphs
    assert engine._lora_graph_bytes() == 0
    engine.parallel_group, engine.config.enforce_eager = None, True
    assert engine._lora_graph_bytes() == 0
    engine.config.enforce_eager, engine.lora_slots = False, None
    assert engine._lora_graph_bytes() == 0
    engine.lora_slots, engine.device = object(), torch.device("cpu")
    assert engine._lora_graph_bytes() == 0
