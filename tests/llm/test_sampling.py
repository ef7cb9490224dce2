"""SamplingParams validation and sampling behaviour: seeds, n, stops, penalties, logprobs."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from ninefold import LLM, SamplingParams
from ninefold.llm.sampler import Sampler
from ninefold.llm.sequence import Sequence


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float64).eval()


PROMPT = [5, 40, 77, 12, 150, 33, 9]


@pytest.mark.parametrize(
    "field, value",
    [("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
     ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("seed", 1.5),
     ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1), ("stop", 5), ("stop", [""]),
     ("stop_token_ids", [-1]), ("logit_bias", {"a": 1.0}), ("temperature", float("nan")), ("stop", "\ud800"),
     ("stop", ["ok", "x\udc00"]), ("bad_words", ["\ud800"])],
)
def test_invalid_sampling_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_temperature_too_small_to_divide_by_is_raised_to_the_minimum(caplog):
    from ninefold.llm.sampling import MIN_TEMPERATURE

    assert SamplingParams(temperature=1e-40).temperature == MIN_TEMPERATURE
    assert "raised" in caplog.text
    assert SamplingParams(temperature=0).temperature == 0 and SamplingParams(temperature=0.5).temperature == 0.5
    # (divided by 1e-40, every positive logit overflowed to +inf and the draw was uniform among them)
    sampler = Sampler(torch.device("cpu"), 8, (7,))
    seq = Sequence("r", 0, [1], 1, SamplingParams(temperature=1e-40, min_tokens=4, max_tokens=8))
    assert sampler(torch.tensor([[0.5, 2.0, 1.0, 0.0, -1.0, 0.3, 0.2, 3.0]]), [seq]).token_ids == [1]


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def _ids(outs):
    return [[c.token_ids for c in out.outputs] for out in outs]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _ids(llm.generate(prompt_token_ids=[PROMPT], sampling_params=params))
    again = _ids(llm.generate(prompt_token_ids=[PROMPT], sampling_params=params))
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    batched = llm.generate(prompt_token_ids=[[3, 4, 5], PROMPT], sampling_params=[other, params])
    assert alone == again == [[c.token_ids for c in batched[1].outputs]]
    changed = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1235, max_tokens=16, ignore_eos=True)
    assert _ids(llm.generate(prompt_token_ids=[PROMPT], sampling_params=changed)) != alone


@pytest.mark.parametrize("filters", [dict(min_p=0.01), dict(top_p=0.9), dict(top_k=20, top_p=0.8)],
                         ids=["min_p", "top_p", "top_k"])
def test_a_seeded_request_samples_alike_beside_requests_of_every_other_route(llm, filters):
    """Each row's own top_k picks how it is drawn (among the largest logits, or the whole row, with or without a
    sort), so batching a seeded request beside requests that take the other routes must not change its tokens."""
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=12, ignore_eos=True, **filters)
    alone = _ids(llm.generate(prompt_token_ids=[PROMPT], sampling_params=params))
    others = [SamplingParams(temperature=0.8, top_p=0.5, seed=1, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=5, seed=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=llm.engine.vocab_size - 1, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    batched = llm.generate(prompt_token_ids=[[3, 4, 5], [8, 9], PROMPT, [6], [7, 7]],
                           sampling_params=[others[0], others[1], params, others[2], others[3]])
    assert alone == [[c.token_ids for c in batched[2].outputs]]


@pytest.mark.parametrize("top_k", [20, 280], ids=["candidates", "sorted_row"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_top_k_among_tied_logits_keeps_every_tied_token_and_seeded_rows_ignore_their_neighbours(device, top_k):
    """bfloat16 logits tie often. ``topk`` (the engine's candidates) and an unstable sort leave the order of ties
    unspecified, so which tied tokens a top-k cut keeps (all of them), and which noise each draws, must not depend
    on it."""
    vocab, tied = 300, list(range(0, 300, 7))  # 43 tokens tie for the largest logit, the rest for a lower one
    logits = torch.zeros(64, vocab, dtype=torch.bfloat16)
    logits[:, tied] = 1.0
    logits = logits.to(device)
    sampler = Sampler(torch.device(device), vocab, ())

    def seqs(seeds, **params):
        out = [Sequence("r", i, [1], 1, SamplingParams(temperature=1.0, top_k=top_k, seed=seed, **params))
               for i, seed in enumerate(seeds)]
        for s in out:
            s.seed, s.generator = s.params.seed, torch.Generator(device=device)
        return out

    drawn = sampler(logits, seqs(range(64))).token_ids
    kept = set(tied) if top_k < len(tied) else set(range(vocab))  # the k-th's ties are kept with it
    assert set(drawn) <= kept and len(set(drawn)) > 5
    alone = [sampler(logits[:1], seqs([seed])).token_ids[0] for seed in (3, 4, 5)]
    beside = sampler(logits[:4], seqs([0], top_p=0.9) + seqs([3, 4, 5])).token_ids[1:]
    assert alone == beside


@pytest.mark.parametrize("top_k", [1, 20, 256])
def test_ties_with_the_kth_logit_beyond_the_candidates_are_drawn_too(top_k):
    """Off CUDA, top-k rows draw among the 256 largest logits; where the k-th ties with tokens past those (bfloat16
    logits tie often), the row draws over its whole row instead (review finding: 144 of 400 tied tokens were never
    drawn)."""
    vocab, rows = 1000, 2000
    logits = torch.zeros(rows, vocab, dtype=torch.bfloat16)
    logits[:, 200:600] = 1.0  # 400 tokens tie for the largest logit; top-k keeps them all for k <= 400
    seqs = [Sequence("r", i, [1], 1, SamplingParams(temperature=1.0, top_k=top_k)) for i in range(rows)]
    drawn = set(Sampler(torch.device("cpu"), vocab, ())(logits, seqs).token_ids)
    assert drawn <= set(range(200, 600)) and len(drawn) > 380  # (2000 draws over 400: ~394 distinct expected)


def test_n_returns_n_distinct_seeded_completions(llm):
    params = SamplingParams(n=3, temperature=1.5, seed=7, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert _ids(llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)) == [[c.token_ids for c in out.outputs]]


def test_greedy_n_gives_identical_completions(llm):
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(n=2, temperature=0, max_tokens=8))
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def test_stop_string_across_token_boundaries_is_not_emitted(llm):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (full,) = llm.generate(["The quick brown fox"], base)
    text = full.outputs[0].text
    ids = full.outputs[0].token_ids
    pieces = [llm.tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    # a stop string starting inside one token's text and ending inside a later one
    i = next(i for i in range(3, len(ids) - 2) if len(pieces[i]) - len(pieces[i - 1]) >= 2
             and len(pieces[i + 2]) > len(pieces[i]) + 1)
    start = len(pieces[i - 1]) + 1
    stop = text[start : len(pieces[i]) + 2]
    assert text.find(stop) == start, "pick a stop string whose first occurrence is here"
    (out,) = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                                  stop=["zzz-not-there", stop]))
    c = out.outputs[0]
    assert c.text == text[:start]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    (kept,) = llm.generate(["The quick brown fox"], SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=stop, include_stop_str_in_output=True))
    assert kept.outputs[0].text == text[: start + len(stop)]


def test_stop_token_ids_and_eos_with_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy)[0].outputs[0].token_ids
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[ids[4]], ignore_eos=True))
    first = ids.index(ids[4])
    assert out.outputs[0].token_ids == ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == ids[4]
    eos = llm.engine.eos_token_ids[0]
    forced = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100.0})
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=forced)
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].token_ids[-1] == eos
    assert out.outputs[0].finish_reason == "stop"


def test_a_stop_token_is_kept_in_the_ids_but_not_rendered_unless_asked(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy)[0].outputs[0].token_ids
    decode = llm.engine.tokenizer.decode
    # the first new token whose text is visible after a clean (complete-character) text
    first = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j] and not decode(ids[:j], True).endswith("\ufffd")
                 and not decode(ids[: j + 1], True).endswith("\ufffd") and decode(ids[: j + 1], True) != decode(ids[:j], True))
    stop = ids[first]
    for include, want in ((False, decode(ids[:first], True)), (True, decode(ids[: first + 1], True))):
        (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=include))
        assert out.outputs[0].token_ids == ids[: first + 1] and out.outputs[0].text == want


def test_penalties_match_a_float64_reference(llm, hf):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.7)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0].token_ids
    plain = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids
    assert out != plain
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + out])).logits[0]
    for t, token in enumerate(out):
        row = logits[len(PROMPT) - 1 + t].clone()
        seen = torch.tensor(sorted(set(PROMPT + out[:t])))
        row[seen] = torch.where(row[seen] > 0, row[seen] / 1.3, row[seen] * 1.3)
        counts = torch.bincount(torch.tensor(out[:t], dtype=torch.long), minlength=row.numel()).double()
        row -= 0.7 * counts + 0.5 * (counts > 0).double()
        top2 = row.topk(2).values
        assert token == row.argmax().item() or top2[0] - top2[1] < 1e-5


def test_logprobs_are_the_models_log_softmax(llm, hf):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    c = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0]
    assert len(c.logprobs) == 5
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([PROMPT + c.token_ids])).logits[0], dim=-1)
    total = 0.0
    for t, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        ref = logp[len(PROMPT) - 1 + t]
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the top one
        assert set(entry) == set(ref.topk(3).indices.tolist())
        for tid, value in entry.items():
            assert abs(value - ref[tid].item()) < 1e-4
        total += entry[token]
    assert abs(c.cumulative_logprob - total) < 1e-6


def test_top_k_1_is_greedy_and_min_p_1_keeps_only_the_top_token(llm):
    greedy = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    for params in (SamplingParams(temperature=2.0, top_k=1, max_tokens=10, ignore_eos=True, seed=5),
                   SamplingParams(temperature=2.0, min_p=1.0, max_tokens=10, ignore_eos=True, seed=5)):
        assert llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0].token_ids == greedy


def test_generation_config_gives_the_default_sampling_params(tmp_path, llama_dir):
    import json
    import shutil

    path = shutil.copytree(llama_dir, tmp_path / "m")
    config = json.loads((path / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)
    (path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(path), device="cpu", num_kv_blocks=16)
    p = llm.engine.default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    config["do_sample"] = False
    (path / "generation_config.json").write_text(json.dumps(config))
    greedy = LLM(str(path), device="cpu", num_kv_blocks=16)
    assert greedy.engine.default_sampling_params().temperature == 0
    (out,) = greedy.generate(prompt_token_ids=[PROMPT])  # defaults: greedy, 16 tokens
    want = greedy.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        temperature=0, top_p=0.9, top_k=20, repetition_penalty=1.1))[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_an_invalid_generation_config_value_is_left_out_with_a_warning_and_the_rest_kept(tmp_path, llama_dir):
    import json
    import shutil

    path = shutil.copytree(llama_dir, tmp_path / "m")
    config = json.loads((path / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.6, top_p=1.5, top_k=20, min_p=0.05, repetition_penalty="1.1")
    (path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(path), device="cpu", num_kv_blocks=16)
    with pytest.warns(UserWarning) as caught:
        p = llm.engine.default_sampling_params()
    messages = " ".join(str(w.message) for w in caught)
    assert "top_p=1.5 ignored" in messages and "repetition_penalty='1.1' ignored" in messages
    # before: one bad value dropped every default (temperature 1.0, top_k off)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 1.0, 20, 0.05, 1.0)


def test_structured_outputs_is_guided_decoding_under_vllms_newer_name():
    from ninefold import StructuredOutputsParams
    from ninefold.llm.guided import GuidedDecodingParams

    fmt = StructuredOutputsParams(regex="a+")
    assert StructuredOutputsParams is GuidedDecodingParams
    params = SamplingParams(structured_outputs=fmt)
    assert params.guided_decoding is fmt and params.structured_outputs is None  # stored under one name
    assert dataclasses.replace(params, guided_decoding=None).guided_decoding is None
    other = StructuredOutputsParams(choice=["x"])
    assert dataclasses.replace(params, guided_decoding=other).guided_decoding is other
    assert SamplingParams(guided_decoding=fmt, structured_outputs=StructuredOutputsParams(regex="a+")).guided_decoding
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(guided_decoding=fmt, structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(structured_outputs={"regex": "a"})
