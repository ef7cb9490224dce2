"""The runner's block tables: rows refilled incrementally stay equal to a table built from scratch."""

import numpy as np

from ninefold.llm.engine import LLMEngine
from ninefold.llm.sampling import SamplingParams
from ninefold.llm.scheduler import ScheduledSeq
from ninefold.llm.sequence import Sequence


def _row(blocks):
    seq = Sequence("r", 0, [1, 2, 3], 3, SamplingParams())
    seq.block_table = blocks
    return ScheduledSeq(seq, 1)


def test_incremental_rows_match_a_fresh_fill(model_dirs):
    engine = LLMEngine(str(model_dirs["llama"]), device="cpu", block_size=4, num_kv_blocks=64)
    runner = engine.runner
    width = 6
    a, b, c = _row([1, 2]), _row([3]), _row([4, 5, 6])

    def table(step):
        got = runner._block_tables(step, width, pinned=True).numpy().copy()
        for row, s in enumerate(step):  # only a row's own blocks are defined
            n = len(s.seq.block_table)
            assert got[row, :n].tolist() == s.seq.block_table, (row, got[row])
        return got

    table([a, b, c])
    a.seq.block_table.append(7)  # grows in place: only block 7 is written
    b.seq.block_table = [8, 9]  # a new list (freed and readmitted): the whole row
    table([a, b, c])
    table([c, a, b])  # rows move: each row is rewritten
    c.seq.block_table.extend([10, 11])
    table([c, a, b])
    table([c, a])  # fewer rows
    table([c, a, b, _row([12, 13, 14, 15, 16, 17])])  # a new, full-width row
    assert runner._block_tables([a], 8, pinned=True).numpy()[0, :3].tolist() == [1, 2, 7]  # another width


def test_both_buffer_sets_keep_their_own_rows(model_dirs):
    engine = LLMEngine(str(model_dirs["llama"]), device="cpu", block_size=4, num_kv_blocks=64)
    runner = engine.runner
    seqs = [_row([i, i + 1]) for i in range(0, 20, 2)]
    for step in range(6):  # the runner alternates its two buffer sets step by step
        runner._switch_buffers()
        for s in seqs:
            s.seq.block_table.append(100 + step)
        got = runner._block_tables(seqs, 12, pinned=True).numpy()
        want = np.array([s.seq.block_table for s in seqs])
        assert np.array_equal(got[:, : want.shape[1]], want)
