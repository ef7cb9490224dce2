"""The runner launches a step's rows longest context first, and tokens still reach their sequences."""

from ninefold.llm.runner import longest_context_first
from ninefold.llm.sampling import SamplingParams
from ninefold.llm.scheduler import ScheduledSeq
from ninefold.llm.sequence import Sequence


def scheduled(rid, prompt_len, computed, new):
    seq = Sequence(rid, 0, list(range(prompt_len)), prompt_len, SamplingParams())
    seq.num_computed_tokens = computed
    return ScheduledSeq(seq, new)


def test_rows_sorted_by_context_after_the_step_and_ties_keep_their_order():
    step = [scheduled("short", 10, 9, 1), scheduled("chunk", 40, 0, 30), scheduled("long", 50, 49, 1),
            scheduled("tie", 30, 29, 1)]
    order = [s.seq.request_id for s in longest_context_first(step)]
    assert order == ["long", "chunk", "tie", "short"]  # contexts 50, 30 (first of the tie), 30, 10
    assert [s.seq.request_id for s in step] == ["short", "chunk", "long", "tie"]  # the caller's list is untouched


def test_engine_tokens_reach_their_own_sequences_when_rows_are_reordered(model_dirs):
    from ninefold.llm.engine import LLMEngine

    engine = LLMEngine(str(model_dirs["llama"]), device="cpu", block_size=4, num_kv_blocks=128)
    vocab = engine.model_config.vocab_size
    prompts = [[(7 * i + j) % vocab for j in range(n)] for i, n in enumerate((3, 17, 9, 30))]  # arrival != length order
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = []
    for i, p in enumerate(prompts):
        engine.add_request(engine.build_request(p, greedy, f"alone{i}"))
        alone.append(_run(engine)[f"alone{i}"])
    for i, p in enumerate(prompts):
        engine.add_request(engine.build_request(p, greedy, f"batch{i}"))
    together = _run(engine)
    assert [together[f"batch{i}"] for i in range(len(prompts))] == alone


def _run(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done
