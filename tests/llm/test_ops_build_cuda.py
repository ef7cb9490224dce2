"""A CUDA engine under a trimmed build (``NINEFOLD_OPS_BUILD``): the same greedy tokens as without one, served by
the build's binaries (on Hopper launched with PDL, also inside the decode steps' CUDA graphs)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ninefold.ops import build, registry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# What a decode engine's steps call; the rest comes from fallback = "vendor".
ENGINE_OPS = ("embedding", "rms_norm", "add_rms_norm", "silu_and_mul", "linear", "add_rms_norm_linear",
              "silu_and_mul_linear", "rope_and_cache", "rope_cache_attention_decode", "reshape_and_cache",
              "attention_decode", "attention_prefill", "argmax")
LEFT_OUT = ("cublaslt", "cutlass", "triton_gemm", "dsl")  # self-tuning or DSL: never the default choice

GREEDY = """
import json, sys
from ninefold import LLM, SamplingParams
from ninefold.ops.triton import prebuilt
llm = LLM(sys.argv[1], dtype="bfloat16", device="cuda", block_size=16, num_kv_blocks=64, cuda_graph_max_batch=8)
outs = llm.generate(prompt_token_ids=[[5, 9, 33], list(range(40, 57)), [7, 200, 13, 99] * 11],
                    sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "stats": prebuilt.STATS}))
"""


def _greedy(model_dir, env: dict) -> dict:
    run = subprocess.run([sys.executable, "-c", GREEDY, str(model_dir)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_an_engine_under_a_trimmed_build_generates_what_it_does_without_one_cuda(model_dirs, tmp_path):
    import ninefold.ops.triton  # noqa: F401  (registers the Triton implementations the manifest names)

    major, minor = torch.cuda.get_device_capability()
    lines = [f'target = "cuda:{major}{minor}"', 'shapes = "tiny"', 'fallback = "vendor"', 'uncovered = "jit"']
    for op in ENGINE_OPS:
        impls = [i.name for i in registry.all_implementations(op) if i.name not in LEFT_OUT]
        lines += [f"[ops.{op}]", 'dtypes = ["bfloat16"]', f"impls = {json.dumps(impls)}"]
    (tmp_path / "ops.toml").write_text("\n".join(lines) + "\n")
    build.build(tmp_path / "ops.toml", tmp_path / "b")
    plain = _greedy(model_dirs["llama"], {"TRITON_CACHE_DIR": str(tmp_path / "cache-plain")})
    built = _greedy(model_dirs["llama"], {"NINEFOLD_OPS_BUILD": str(tmp_path / "b"),
                                          "TRITON_CACHE_DIR": str(tmp_path / "cache-built")})
    assert built["tokens"] == plain["tokens"]
    assert plain["stats"]["prebuilt"] == 0 and built["stats"]["prebuilt"] > 0
    assert (built["stats"]["prebuilt_pdl"] > 0) == (major >= 9)
