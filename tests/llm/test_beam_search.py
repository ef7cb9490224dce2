"""``LLM.beam_search``: against transformers' beam search, against a plain reference search on transformers'
logits (EOS, length penalty, an adapter), and its error cases."""

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from ninefold import LLM, BeamSearchParams, LoRARequest
from ninefold.llm.beam_search import BeamSearch, BeamSearchSequence, beam_score, rank_key

PROMPTS = ([5, 9, 14], [7, 30, 2, 41, 99, 12, 250, 3, 18, 77, 64, 11, 6, 200, 31, 8, 140])


def _hf(path, adapter=None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def reference_search(model, prompt, width, max_tokens, eos, length_penalty, finished=None, ignore_eos=False):
    """Beam search as documented in ``ninefold.llm.beam_search``, on full forwards of transformers' model
    (``finished``: a list that receives every beam ended by EOS, returned or not)."""
    beams, done = [(list(prompt), 0.0)], []

    def score(tokens, cum, _=None):
        return cum / ((len(tokens) - (1 if tokens[-1] in eos else 0)) ** length_penalty)

    for _ in range(max_tokens):
        grown = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].double()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                entry = (tokens + [token], cum + logprob)
                (done.append((*entry, "stop")) if token in eos and not ignore_eos else grown.append(entry))
        grown.sort(key=lambda e: score(e[0], e[1], False), reverse=True)
        beams = grown[:width]
        if not beams:
            break
    if finished is not None:
        finished += done
    done += [(t, c, "length") for t, c in beams]
    done.sort(key=lambda e: score(e[0], e[1], e[2] == "stop"), reverse=True)
    return done[:width]


def assert_same_beams(got, expected):
    assert [s.tokens for s in got.sequences] == [e[0] for e in expected]
    for seq, (_, cum, reason) in zip(got.sequences, expected):
        assert seq.finish_reason == reason
        assert seq.cum_logprob == pytest.approx(cum, abs=2e-4)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_matches_transformers_beam_search_batched_and_one_prompt_at_a_time(model_dirs, variant):
    path = model_dirs[variant]
    model = _hf(path)
    width, new = 3, 10
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                             max_new_tokens=new, do_sample=False, length_penalty=0.0, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        expected.append((out.sequences.tolist(), out.sequences_scores.tolist()))
    params = BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True, length_penalty=0.0)
    for caching in (True, False):  # a round's beams served by the prefix cache, and recomputed whole
        llm = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=256, enable_prefix_caching=caching)
        together = llm.beam_search([list(p) for p in PROMPTS], params)
        alone = [llm.beam_search([list(p)], params)[0] for p in PROMPTS]
        for result in (together, alone):
            for got, (sequences, scores) in zip(result, expected):
                assert [s.tokens for s in got.sequences] == sequences
                assert [s.cum_logprob for s in got.sequences] == pytest.approx(scores, abs=2e-4)
                assert all(s.finish_reason == "length" and len(s.logprobs) == new for s in got.sequences)


@pytest.fixture(scope="module")
def eos_model(model_dirs, tmp_path_factory):
    """The tiny Llama with a token its beams often consider as EOS (so beams finish early)."""
    source = model_dirs["llama"]
    model = _hf(source)
    first = reference_search(model, PROMPTS[0], 3, 2, eos=(), length_penalty=1.0)
    eos_token = first[1][0][len(PROMPTS[0]) + 1]  # the second beam's second token
    path = tmp_path_factory.mktemp("eos_llama")
    shutil.copytree(source, path, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.exists():
            data = json.loads(file.read_text())
            data["eos_token_id"] = eos_token
            file.write_text(json.dumps(data))
    return path, model, eos_token


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
def test_eos_finished_beams_rank_with_the_length_penalty_as_the_reference_does(eos_model, length_penalty):
    path, model, eos_token = eos_model
    llm = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=256)
    eos = set(llm.engine.eos_token_ids)
    assert eos == {eos_token, 1}  # config's and the tokenizer's "</s>"
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty)
    outputs = llm.beam_search([list(p) for p in PROMPTS], params)
    stopped, ended_by_eos = 0, []
    for prompt, got in zip(PROMPTS, outputs):
        expected = reference_search(model, prompt, 3, 8, eos, length_penalty, ended_by_eos)
        assert_same_beams(got, expected)
        for seq in got.sequences:
            if seq.finish_reason == "stop":
                stopped += 1
                assert seq.stop_reason == seq.tokens[-1] and seq.tokens[-1] in eos
                assert seq.text == llm.tokenizer.decode(seq.tokens[:-1])
    assert ended_by_eos, "no beam met EOS, so this test checked nothing about it"
    if length_penalty <= 1.0:  # (a penalty of 2.5 favours the long beams that go on)
        assert stopped


def test_include_stop_str_in_output_keeps_the_eos_text(eos_model):
    path, _, _ = eos_model
    llm = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=256)
    kept = llm.beam_search([list(PROMPTS[0])], BeamSearchParams(3, 8, length_penalty=0.0,
                                                                include_stop_str_in_output=True))[0]
    stopped = [s for s in kept.sequences if s.finish_reason == "stop"]
    assert stopped
    for seq in stopped:
        assert seq.text == llm.tokenizer.decode(seq.tokens) != llm.tokenizer.decode(seq.tokens[:-1])


def test_an_adapter_steers_the_search_as_peft_does(model_dirs, tmp_path):
    from tiny_models import write_lora_adapter

    base = model_dirs["llama"]
    adapter = write_lora_adapter(base, tmp_path / "adapter")
    llm = LLM(str(base), device="cpu", block_size=4, num_kv_blocks=256, enable_lora=True, max_lora_rank=8)
    request = LoRARequest("a", 1, str(adapter))
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    got = llm.beam_search([list(PROMPTS[0]), list(PROMPTS[1])], params, lora_request=[request, None])
    eos = set(llm.engine.eos_token_ids)  # (with ignore_eos, a final EOS token still does not count in the score)
    assert_same_beams(got[0], reference_search(_hf(base, adapter), PROMPTS[0], 2, 6, eos, 1.0, ignore_eos=True))
    assert_same_beams(got[1], reference_search(_hf(base), PROMPTS[1], 2, 6, eos, 1.0, ignore_eos=True))


def test_concurrency_limit_and_model_length_cap(model_dirs):
    path = model_dirs["llama"]
    llm = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=256, max_model_len=24)
    params = BeamSearchParams(beam_width=2, max_tokens=12, ignore_eos=True)
    prompts = [list(PROMPTS[0]), list(PROMPTS[1])]
    one_at_a_time, together = llm.beam_search(prompts, params, concurrency_limit=1), llm.beam_search(prompts, params)
    for a, b in zip(one_at_a_time, together):  # (batch shapes differ, so the last bits of a logprob may too)
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences], abs=1e-5)
    capped = llm.beam_search(prompts, params)[1]  # 17 prompt tokens: room for 7 more
    assert all(len(s.tokens) == 24 and s.finish_reason == "length" for s in capped.sequences)


@pytest.mark.parametrize("fields, name", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos"),
])
def test_bad_params_name_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**fields)


def test_bad_calls_are_refused_before_anything_runs(model_dirs):
    llm = LLM(str(model_dirs["llama"]), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=32)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(TypeError, match="params"):
        llm.beam_search([[1, 2]], {"beam_width": 2})
    with pytest.raises(ValueError, match="prompt: 40 tokens"):
        llm.beam_search([[3, 4], [5] * 40], params)
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([[3, 4]], params, concurrency_limit=0)
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([[3, 4]], params, lora_request=[None, None])
    assert not llm.engine.has_unfinished_requests()


def test_score_and_extension_rules():
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0)
    search = BeamSearch([4, 5], params, eos_token_ids={9}, max_model_len=100)
    search.extend([{9: -0.1, 7: -0.5, 8: -0.6, 6: -3.0}])
    assert [b.tokens for b in search.beams] == [[4, 5, 7], [4, 5, 8]]  # EOS takes no place among the live beams
    assert [(f.tokens, f.finish_reason, f.stop_reason) for f in search.finished] == [([4, 5, 9], "stop", 9)]
    finished = search.finished[0]
    assert beam_score(finished, {9}, 1.0) == pytest.approx(-0.1 / 2)  # the final EOS is not counted
    assert beam_score(BeamSearchSequence([4, 5, 7], cum_logprob=-0.5), {9}, 2.0) == pytest.approx(-0.5 / 9)
    with pytest.raises(ValueError, match="candidates: 1 given for 2 live beams"):
        search.extend([{1: -1.0}])
    search.extend([{1: -0.1}, {2: -0.1}])
    search.extend([{3: -0.1}, {3: -0.2}])  # the beams reach prompt + max_tokens: done
    assert search.done
    best = search.result(decode=lambda ids: ",".join(map(str, ids)))
    assert best.sequences[0].text == "4,5"  # -0.05 beats -0.7 / 5; the EOS left out of the text
    assert [s.finish_reason for s in best.sequences] == ["stop", "length"]


@pytest.mark.parametrize("length_penalty", [-1000.0, -2.0, 0.0, 0.7, 3.0, 400.0])
def test_ranking_follows_the_score_without_overflowing(length_penalty):
    beams = [BeamSearchSequence(list(range(n)), cum_logprob=c) for n, c in ((3, -0.5), (9, -2.0), (30, -6.0),
                                                                             (31, -6.1), (5, 0.0))]
    keys = [rank_key(b, {99}, length_penalty) for b in beams]
    if abs(length_penalty) < 10:  # the score itself is representable: the key orders beams as it does
        scores = [beam_score(b, {99}, length_penalty) for b in beams]
        assert sorted(range(5), key=keys.__getitem__) == sorted(range(5), key=scores.__getitem__)
    assert keys[4] == math.inf and all(math.isfinite(k) for k in keys[:4])
    assert (keys[3] > keys[2]) == (length_penalty * math.log(31 / 30) > math.log(6.1 / 6.0))
    assert beam_score(beams[2], {99}, length_penalty) <= 0  # no OverflowError or ZeroDivisionError either


def test_a_final_eos_is_not_counted_in_the_length_with_ignore_eos_too():
    beam = BeamSearchSequence([4, 5, 9], cum_logprob=-1.0)
    assert beam_score(beam, {9}, 1.0) == pytest.approx(-0.5) and beam_score(beam, {8}, 1.0) == pytest.approx(-1 / 3)
