"""The runtime benchmark's steps on the CPU with tiny sizes (the GPU run is the lead's)."""

from ninefold.bench.runtime import bench_cuda_graph, bench_swap_overlap, markdown, run_checks
from ninefold.runtime import Device
from ninefold.runtime.profile import measure


def test_checks_pass_on_cpu():
    assert set(run_checks(Device("cpu")).values()) == {"ok"}


def test_swap_bench_keeps_data_and_reports_times():
    swap = bench_swap_overlap(Device("cpu"), num_swap=4, num_layers=1)
    assert swap["data_intact"] and swap["bytes"] == 4 * swap["block_bytes"] == 4 * 2 * 16 * 8 * 128 * 2
    for direction in ("out", "in"):
        entry = swap[f"swap_{direction}"]
        assert entry["swap_alone_ms"] > 0 and entry["together_ms"] > 0
        assert entry["hidden_fraction"] is None  # swaps on the CPU are synchronous: nothing to hide


def test_graph_bench_rows():
    rows = bench_cuda_graph(Device("cpu"), hidden=16, batches=(1, 2))
    assert [r["batch"] for r in rows] == [1, 2] and all(r["eager_us"] > 0 and r["replay_us"] > 0 for r in rows)


def test_markdown_tables_hold_the_measurements():
    results = {"date": "2026-12-03", "name": "cpu", "device": "cpu", "torch": "x", "seconds": 1.0,
               "profile": measure(Device("cpu"), progress=False, min_time=0.01).to_dict(),
               "cuda_graph": bench_cuda_graph(Device("cpu"), hidden=16, batches=(1,)),
               "kv_swap": bench_swap_overlap(Device("cpu"), num_swap=2, num_layers=1)}
    text = markdown(results)
    assert sum(line.startswith("| --- |") for line in text.splitlines()) == 3 and "| matmul float32 n=512 |" in text and "| loopback tcp |" in text
    eager = results["cuda_graph"][0]["eager_us"]
    assert f"| 1 | {eager:.1f} |" in text
