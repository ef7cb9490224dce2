"""Decode steps with the heads split in two halves (``NINEFOLD_OVERLAP_ATTENTION=ROWS``): half A's attention and its
share of the o projection on a second stream beside half B's attention. The logits match the unsplit step's, on the
CPU (the halves one after the other) and on CUDA (two streams, eagerly and replayed from CUDA graphs)."""

import pytest
import torch

from ninefold import SamplingParams
from ninefold.llm.engine import LLMEngine
from ninefold.llm.models import llama


def _decode_steps(engine, batch: int, steps: int, modes: dict) -> dict[str, list[torch.Tensor]]:
    """Logits of ``steps`` decode steps of ``batch`` sequences (prefilled first), each step computed under every
    mode (name -> (graphs, overlap rows)); the sequences go on with the first mode's greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(engine.build_request([7, 200, 13, 99] * (3 + i), params, str(i)))
    engine.step()
    engine.sync()
    model, graphs = engine.runner.model, engine.runner.graphs
    out = {name: [] for name in modes}
    for _ in range(steps):
        step = engine.scheduler.schedule()
        assert len(step) == batch and all(s.num_new_tokens == 1 for s in step)
        for name, (use_graphs, rows) in modes.items():
            engine.runner.graphs, model.overlap_min_rows = graphs if use_graphs else None, rows
            out[name].append(engine.runner.forward_logits(step).float().clone())
        engine.runner.graphs = graphs
        first = out[next(iter(modes))][-1]
        for row, scheduled in enumerate(step):
            scheduled.seq.num_computed_tokens += 1
            scheduled.seq.append(int(first[row].argmax(-1)))
    return out


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_split_heads_give_the_unsplit_logits_on_the_cpu(model_dirs, variant, monkeypatch):
    monkeypatch.setenv("NINEFOLD_OVERLAP_ATTENTION", "2")
    engine = LLMEngine(str(model_dirs[variant]), dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=64)
    model = engine.runner.model
    assert model.overlap_min_rows == 2
    model.cpu_fast_decode = False  # the generic step (the native CPU step has its own attention)
    calls = []
    split = model._overlapped_attention
    model._overlapped_attention = lambda *a: calls.append(1) or split(*a)
    runs = _decode_steps(engine, batch=3, steps=4, modes={"split": (False, 2), "unsplit": (False, 0)})
    assert len(calls) == 4 * model.config.num_layers  # every layer of every step, in the split mode only
    for got, want in zip(runs["split"], runs["unsplit"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("NINEFOLD_OVERLAP_ATTENTION", "yes")
    with pytest.raises(ValueError, match="NINEFOLD_OVERLAP_ATTENTION must be a number of rows .* got 'yes'"):
        llama.overlap_min_rows()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_streams_in_cuda_graphs_give_the_unsplit_logits_cuda(model_dirs, monkeypatch):
    monkeypatch.setenv("NINEFOLD_OVERLAP_ATTENTION", "4")  # the graphs of 4 sequences and more are captured split
    engine = LLMEngine(str(model_dirs["llama"]), dtype=torch.bfloat16, device="cuda", block_size=16,
                       num_kv_blocks=256, cuda_graph_max_batch=16)
    assert engine.runner.graphs is not None
    runs = _decode_steps(engine, batch=12, steps=6, modes={"graph": (True, 4), "split": (False, 4),
                                                           "unsplit": (False, 0)})
    assert engine.runner.model._side_stream is not None
    for name in ("graph", "split"):
        for got, want in zip(runs[name], runs["unsplit"]):
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
