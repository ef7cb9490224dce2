"""gpt-fast's Llama decode as an in-process benchmark peer.

gpt-fast (github.com/pytorch-labs/gpt-fast, BSD-3) is not a ninefold dependency and none of its
code is in this repository: point ``--gpt-fast DIR`` of ``ninefold.bench.llm`` at a checkout (its
``model.py`` is all that is imported). The driver here follows gpt-fast's own recipe for batch-1
decode: its ``Transformer`` for the named shape with random bfloat16 weights, static KV caches,
inductor's coordinate-descent tuning, ``torch.compile(mode="reduce-overhead", fullgraph=True)`` of
one decode step with attention through SDPA's math backend (so inductor generates it), greedy
argmax on the device. The prompt is prefilled eagerly; compilation happens before timing.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch


def load_model_module(path: str | Path):
    """gpt-fast's ``model.py`` under ``path``, imported as a private module."""
    file = Path(path) / "model.py"
    if not file.is_file():
        raise ValueError(f"--gpt-fast: no model.py in {str(path)!r} (expected a gpt-fast checkout)")
    spec = importlib.util.spec_from_file_location("_gpt_fast_model", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # torch.compile looks modules up by name
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def decode_tok_per_s(path: str | Path, *, name: str = "llama-3.1-8b", prompt: int = 128, tokens: int = 256,
                     device: str = "cuda", seed: int = 0) -> dict:
    """Batch-1 greedy decode rate of gpt-fast's compiled model with random weights of ``name``'s shape."""
    import torch._inductor.config as inductor_config
    from torch.nn.attention import SDPBackend, sdpa_kernel

    module = load_model_module(path)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = module.Transformer.from_name(name)
    model = model.to_empty(device=device).to(torch.bfloat16).eval()
    for parameter in model.parameters():
        if parameter.dim() == 1:
            parameter.fill_(1.0)
        else:
            parameter.normal_(0.0, 0.02)
    with torch.device(device):
        model.setup_caches(max_batch_size=1, max_seq_length=prompt + tokens + 16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def decode_one(token, pos):
        logits = model(token, pos)
        return torch.argmax(logits[:, -1], dim=-1, keepdim=True)

    inductor_config.coordinate_descent_tuning = True
    inductor_config.triton.unique_kernel_names = True
    step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device=device)
    logits = model(ids, torch.arange(prompt, device=device))
    token = torch.argmax(logits[:, -1], dim=-1, keepdim=True)
    pos = torch.tensor([prompt], device=device)
    start = time.perf_counter()
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(3):  # compile and record the graph
            token = step(token, pos).clone()
            pos += 1
        _sync(device)
        compile_s = time.perf_counter() - start
        steps = tokens - 3
        start = time.perf_counter()
        for _ in range(steps):
            token = step(token, pos).clone()
            pos += 1
        _sync(device)
    elapsed = time.perf_counter() - start
    return {"tok_per_s": steps / elapsed, "compile_s": compile_s, "weight_bytes": weight_bytes, "steps": steps,
            "prompt_tokens": prompt, "source": str(path)}


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
