"""The batch sizes the engine captures decode CUDA graphs for (pure arithmetic: runs on the CPU)."""

import pytest

from ninefold.llm.cuda_graphs import capture_sizes


def test_small_powers_then_every_sixteen_up_to_the_maximum():
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(100) == [1, 2, 4, 8, *range(16, 97, 16), 100]


@pytest.mark.parametrize("max_batch", [1, 2, 3, 5, 8, 9, 17, 64, 250])
def test_every_batch_has_a_graph_with_at_most_fifteen_padded_rows(max_batch):
    sizes = capture_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
    for batch in range(1, max_batch + 1):
        size = min(s for s in sizes if s >= batch)
        assert size - batch <= 15 and (batch > 8 or size - batch < batch), (batch, size)
