"""``ninefold.bench.gguf_fidelity``: its teacher-forced score on a tiny GGUF model.

The exact model's own greedy tokens must score agreement 1 and gap 0 (the bench's self-check), and a
continuation with one token swapped for a worse one must score below that: the score can fail.
"""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from ninefold import LLM
from ninefold.bench import gguf_fidelity

from .test_gguf import hf_weights, write_gguf


def test_exact_tokens_agree_fully_and_a_swapped_token_does_not(tmp_path):
    path = write_gguf(tmp_path / "q6k.gguf", hf_weights(arch="llama", tied=True), T.Q6_K)
    prompts = [[5, 77, 130], [42, 9]]
    exact = LLM(str(path), quantization="none", device="cpu")
    own = gguf_fidelity.greedy_ninefold(exact, prompts, 6)
    assert [len(g) for g in own] == [6, 6]
    assert gguf_fidelity.teacher_forced(exact, prompts, own) == {"tokens": 12, "argmax_agreement": 1.0,
                                                                 "mean_logprob_gap": 0.0}
    swapped = [list(g) for g in own]
    swapped[0][-1] = (swapped[0][-1] + 1) % 100  # the last token: another than the argmax, no later context
    score = gguf_fidelity.teacher_forced(exact, prompts, swapped)
    assert score["argmax_agreement"] == pytest.approx(11 / 12) and score["mean_logprob_gap"] > 0


def test_unknown_llama_cpp_type_is_named(tmp_path):
    pytest.importorskip("llama_cpp")
    with pytest.raises(ValueError, match="--llama-cpp-quantize: got 'Q9_X'"):
        gguf_fidelity.llama_cpp_quantize(tmp_path / "a.gguf", tmp_path / "b.gguf", "Q9_X", 1)
