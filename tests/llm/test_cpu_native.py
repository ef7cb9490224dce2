"""The native CPU decode step (``llama_cpu.NativeDecoder``, ``ops/cpu_native/nf_decode.c``) on tiny GGUF
models written here, and SmolLM2 on the native kernels.

What is asserted and why:
* with Q4_0/Q4_1/Q8_0 matrices and the kernels built, decode steps run natively (one call per step);
* the native step computes what the ops-by-ops forward computes on the same ``BlockWeight``s through
  ``ops.linear_blocks`` (same int8 activations, float32 sums): llama (GQA), qwen2 (q/k/v bias),
  qwen3 (q/k norms), float32 and bfloat16, three sequences of different lengths and one alone. The
  generic path rounds its intermediates to the model's dtype and sums in another order, so an int8
  code can land one step apart; the tolerance is a small fraction of the logits' scale;
* greedy continuations on the native path stay as close to the exact float32 model as a bfloat16
  model of the dequantized weights is (the quantization's own error);
* with the kernels off (``cpu_native.enabled(False)``) the same model runs on torch's int4 path.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from ninefold.llm.engine import LLMEngine
from ninefold.ops import cpu_native

from .test_gguf import hf_weights, write_gguf
from .test_gguf_packed import _greedy as greedy
from .test_parity import decode_step_both_ways

pytestmark = pytest.mark.skipif(not cpu_native.fast(), reason=cpu_native.slow_reason())

GREEDY_KW = dict(temperature=0, ignore_eos=True)


@pytest.fixture
def two_threads():
    """Two OpenMP threads (this package's conftest runs one): rows of one step then meet on two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _weights(arch, tied):
    """hf_weights with matrices scaled by 1/sqrt(fan-in): activations of order one, as in trained models
    (unit-variance matrices make attention one-hot and every rounding difference a different token)."""
    w = hf_weights(arch=arch, tied=tied)
    return {name: (t / t.shape[1] ** 0.5 if t.ndim == 2 and "embed" not in name else t) for name, t in w.items()}


def _engine(path, dtype, quantization="auto"):
    return LLMEngine(str(path), dtype=dtype, device="cpu", block_size=4, num_kv_blocks=64,
                     enable_prefix_caching=False, quantization=quantization)


def _prompts(vocab, lengths=(5, 23, 9), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch,qtype", [("llama", T.Q4_1), ("llama", T.Q8_0), ("qwen2", T.Q4_0), ("qwen3", T.Q4_1)])
def test_native_step_matches_the_generic_path(tmp_path, arch, qtype, dtype):
    _check_step(tmp_path, arch, qtype, dtype)


@pytest.mark.parametrize("tier", ["avx2", "avx512-vnni"])
def test_other_vector_tiers_run_the_step_as_the_generic_path(tmp_path, monkeypatch, tier):
    """The tiers this CPU runs besides the loaded one (an AVX-512 machine checks the AVX2 kernels here)."""
    if tier not in cpu_native.tiers_runnable_here():
        pytest.skip(f"this CPU cannot run the {tier} tier")
    if tier == cpu_native.isa():
        pytest.skip(f"{tier} is the loaded build: test_native_step_matches_the_generic_path checks it")
    try:
        lib = cpu_native.build_tier(tier, tmp_path)
    except cpu_native.TierUnsupported as error:
        pytest.skip(str(error))
    monkeypatch.setitem(cpu_native._state, "lib", lib)
    assert cpu_native.isa() == tier
    for qtype in (T.Q4_1, T.Q8_0):
        _check_step(tmp_path, "qwen3", qtype, "float32")


def _check_step(tmp_path, arch, qtype, dtype):
    from ninefold.llm.sampling import SamplingParams

    path = write_gguf(tmp_path / f"{arch}-{qtype.name}.gguf", _weights(arch, tied=qtype != T.Q8_0), qtype, arch=arch)
    engine = _engine(path, dtype)
    for layer in engine.model.layers:  # float32 models round prefill activations twice; the step rounds once
        for name in ("qkv", "o", "gate_up", "down"):
            getattr(layer, name).blocks.activation_terms = 1
    prompts = _prompts(engine.model_config.vocab_size)
    for generic, native in decode_step_both_ways(engine, prompts, SamplingParams(max_tokens=8, **GREEDY_KW)):
        assert engine.model._cpu_decoder.native is not None
        scale = generic.abs().max().item()
        tol = 0.01 if dtype == "float32" else 0.05
        torch.testing.assert_close(native, generic, rtol=0, atol=tol * scale)
        assert (native - generic).abs().mean() <= tol / 4 * scale

CHAT = ("What is the capital of France?", "Name three colors.", "Write a haiku about rain.")
NEW = 24


def _greedy(engine, prompts, new=NEW):
    from ninefold.llm.sampling import SamplingParams

    return greedy(engine, prompts, SamplingParams(max_tokens=new, **GREEDY_KW))


def _next_logits(engine, ids):
    from ninefold.llm.sampling import SamplingParams

    engine.add_request(engine.build_request(ids, SamplingParams(max_tokens=1, **GREEDY_KW), "probe"))
    logits = engine.runner.forward_logits(engine.scheduler.schedule())[0]
    engine.abort_request("probe")
    return logits


@pytest.mark.parametrize("dtype,tie", [("float32", 0.3), ("bfloat16", 0.6)])
def test_smollm2_native_decode_follows_the_float32_model(dtype, tie):
    """Greedy chat answers on the native path (int8 activations) are the float32 model's, token for token,
    up to a near tie of the float32 model: where they part, the float32 model's own logits for the two
    picks are within ``tie`` (the quantization's error: the bf16 dequantized model's mean logit error on
    these prompts is ~0.15, its largest ~1)."""
    from ninefold.llm import hub

    try:
        path = hub.resolve_model(None)
    except hub.ModelNotAvailable as error:
        pytest.skip(f"SmolLM2 GGUF not cached and not fetchable here: {error}")

    def engine(dt, q):
        return LLMEngine(str(path), dtype=dt, device="cpu", quantization=q, max_model_len=256,
                         enable_prefix_caching=False)

    exact = engine("float32", "none")
    tok = exact.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True) for text in CHAT]
    want = _greedy(exact, prompts)
    native = engine(dtype, "auto")
    got = _greedy(native, prompts)
    assert native.model._cpu_decoder.native is not None
    agree = []
    for prompt, w, g in zip(prompts, want, got):
        p = next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w))
        agree.append(p)
        if p < len(w):
            logits = _next_logits(exact, prompt + w[:p])
            assert logits.argmax().item() == w[p]
            assert logits[w[p]] - logits[g[p]] <= tie, (tok.decode(w), tok.decode(g), p)
    # sensible answers: at least one follows the float32 model for 8+ tokens (measured: float32 all 24 tokens
    # of all three, bfloat16 19, 22 and 12)
    assert max(agree) >= 8, agree


def test_smollm2_speculation_on_the_native_step_keeps_the_plain_tokens(two_threads):
    """SmolLM2 copying a paragraph and telling a story: steps of up to five rows of one sequence (nine
    query heads each) spread over the threads, and the tokens stay the plain engine's."""
    from ninefold.bench.speculative import TASKS
    from ninefold.llm import hub

    try:
        path = hub.resolve_model(None)
    except hub.ModelNotAvailable as error:
        pytest.skip(f"SmolLM2 GGUF not cached and not fetchable here: {error}")

    def engine(**kw):
        return LLMEngine(str(path), dtype="float32", device="cpu", max_model_len=512, enable_prefix_caching=False, **kw)

    plain = engine()
    prompts = [plain.tokenizer.apply_chat_template([{"role": "user", "content": TASKS[task]}], tokenize=True)
               for task in ("repeat", "story")]
    spec = engine(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                      "prompt_lookup_min": 2})
    for prompt in prompts:  # one at a time, as the benchmark: the story's tokens parted when rows raced
        assert _greedy(spec, [prompt], 64) == _greedy(plain, [prompt], 64)
    assert spec.model._cpu_decoder.native is not None
    assert spec.stats()["num_accepted_tokens"] >= 16


def test_native_step_refuses_ids_and_positions_outside_its_tables(tmp_path):
    """The C step indexes the embedding and rotary tables directly: out-of-range values are refused
    before it runs (the engine validates prompts, this guards direct callers of the model)."""
    from ninefold.llm.models.llama import AttentionMetadata

    path = write_gguf(tmp_path / "llama-Q4_1.gguf", _weights("llama", tied=True), T.Q4_1, arch="llama")
    model = _engine(path, "float32").model
    vocab, positions = model.embed.shape[0], model.cos_sin.shape[0]

    def meta():
        return AttentionMetadata(slot_mapping=torch.tensor([0]), block_tables=torch.zeros((1, 1), dtype=torch.int32),
                                 context_lens=torch.tensor([1], dtype=torch.int32))

    model.forward(torch.tensor([1]), torch.tensor([0]), meta())
    assert model._cpu_decoder.native is not None
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {vocab}\)"):
        model.forward(torch.tensor([vocab]), torch.tensor([0]), meta())
    with pytest.raises(ValueError, match=rf"positions must lie in \[0, {positions}\)"):
        model.forward(torch.tensor([1]), torch.tensor([positions]), meta())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_drafts_on_the_native_step_give_the_plain_tokens(tmp_path, dtype, two_threads):
    """Draft rows of one sequence attend to each other's new keys inside one native step: every row's key
    and value reach the cache before any row attends, so speculation changes no greedy token."""
    from ninefold.llm.sampling import SamplingParams

    path = write_gguf(tmp_path / "llama-Q4_1.gguf", _weights("llama", tied=True), T.Q4_1, arch="llama")
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22, 23, 20, 21], [3] * 10]
    params = SamplingParams(max_tokens=24, **GREEDY_KW)
    plain = greedy(_engine(path, dtype), prompts, params)
    spec = LLMEngine(str(path), dtype=dtype, device="cpu", block_size=4, num_kv_blocks=64, enable_prefix_caching=False,
                     speculative_config=ngram)
    assert spec.model._cpu_decoder is None or spec.model._cpu_decoder.native is not None
    assert greedy(spec, prompts, params) == plain
    assert spec.model._cpu_decoder.native is not None
    assert spec.stats()["num_accepted_tokens"] > 0
