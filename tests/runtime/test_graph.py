"""TaskGraph ordering, data flow and error propagation; CudaGraphRunner (eager on the CPU, replay on CUDA)."""

import pytest
import torch

from ninefold.runtime.cuda_graph import CudaGraphRunner
from ninefold.runtime.graph import TaskFailed, TaskGraph

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_results_flow_along_dependencies_across_streams(device):
    g = TaskGraph(device)
    x = torch.arange(6.0, dtype=torch.float64).to(device)
    load = g.add(lambda: x * 2, stream="copy", name="load")
    square = g.add(torch.mul, load, load, name="square")
    shifted = g.add(torch.add, square, other=torch.ones((), dtype=torch.float64, device=device), stream="copy")
    total = g.add(lambda a, b: (a + b).sum(), square, shifted, name="total")
    out = g.run()
    ref = (x.cpu() * 2) ** 2
    assert torch.equal(out["square"].cpu(), ref)
    assert out["total"].item() == (ref + ref + 1).sum().item()
    assert [d.name for d in total.deps] == ["square", shifted.name]
    assert g.run()["total"].item() == out["total"].item()  # a graph runs again


def test_tasks_run_in_dependency_order():
    log = []
    g = TaskGraph("cpu")
    a = g.add(log.append, "a")
    b = g.add(log.append, "b", after=[a])
    c = g.add(log.append, "c", after=[a])
    g.add(log.append, "d", after=[c, b])
    g.run()
    assert log.index("a") < log.index("b") < log.index("d") and log.index("c") < log.index("d")
    assert sorted(log) == ["a", "b", "c", "d"]


def test_a_failure_skips_dependents_and_reports():
    log = []
    g = TaskGraph("cpu")

    def boom():
        raise ZeroDivisionError("bad step")

    a = g.add(boom, name="a")
    b = g.add(log.append, "b", after=[a], name="b")
    g.add(log.append, "c", after=[b], name="c")  # depends on a only through b
    g.add(lambda: log.append("free") or 7, name="independent")
    with pytest.raises(TaskFailed) as err:
        g.run()
    assert log == ["free"]
    assert list(err.value.failed) == ["a"] and isinstance(err.value.__cause__, ZeroDivisionError)
    assert err.value.skipped == ["b", "c"] and err.value.results == {"independent": 7}
    assert "bad step" in str(err.value)


def test_bad_arguments():
    g, other = TaskGraph("cpu"), TaskGraph("cpu")
    t = other.add(lambda: 1)
    with pytest.raises(ValueError, match="another graph"):
        g.add(print, t)
    with pytest.raises(TypeError, match="after"):
        g.add(print, after=[3])
    with pytest.raises(TypeError, match="fn"):
        g.add(42)
    g.add(print, name="p")
    with pytest.raises(ValueError, match="name"):
        g.add(print, name="p")


def mlp(x, scale):
    return torch.relu(x @ torch.ones(x.shape[1], 5, dtype=x.dtype, device=x.device)) * scale, x.sum(dim=1)


def test_runner_on_cpu_calls_eagerly_and_checks_inputs():
    x, s = torch.randn(8, 3, dtype=torch.float64), torch.rand(8, 1, dtype=torch.float64)
    runner = CudaGraphRunner(mlp, [1, 2, 4, 8], (x, s))
    assert not runner.enabled and runner.max_batch_size == 8
    out, sums = runner(x[:3], s[:3])
    ref = torch.relu(x[:3] @ torch.ones(3, 5, dtype=torch.float64)) * s[:3]
    assert torch.equal(out, ref) and torch.equal(sums, x[:3].sum(dim=1))
    with pytest.raises(ValueError, match="batch size 9"):
        runner(torch.randn(9, 3, dtype=torch.float64), torch.rand(9, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"inputs\[1\]"):
        runner(x[:2], s[:3])
    with pytest.raises(ValueError, match="largest batch size"):
        CudaGraphRunner(mlp, [1, 16], (x, s))
    with pytest.raises(ValueError, match="batch_sizes"):
        CudaGraphRunner(mlp, [0, 8], (x, s))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runner_on_cuda_replays_with_static_buffers():
    x = torch.randn(8, 64, device="cuda")
    s = torch.rand(8, 1, device="cuda")
    runner = CudaGraphRunner(mlp, [1, 2, 4, 8], (x, s), pad_values=(0.0, 0.0))
    static_ptr = runner._static[0].data_ptr()
    for batch in (1, 3, 8, 2):
        xb, sb = torch.randn(batch, 64, device="cuda"), torch.rand(batch, 1, device="cuda")
        out, sums = runner(xb, sb)
        ref_out, ref_sums = mlp(xb, sb)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)  # padded batches may pick other kernels
        torch.testing.assert_close(sums, ref_sums, rtol=1e-4, atol=1e-4)
        assert out.shape[0] == batch
    assert runner._static[0].data_ptr() == static_ptr and sorted(runner._graphs) == [1, 2, 4, 8]


def test_dict_subclasses_holding_tasks_arrive_as_their_own_type():
    import collections

    g = TaskGraph("cpu")
    a = g.add(lambda: 1, name="a")
    counts = collections.defaultdict(lambda: 10, x=a)
    g.add(lambda d: d["x"] + d["missing"], counts, name="defaultdict")  # the default_factory survives
    g.add(lambda m: (type(m), list(m.items())), collections.OrderedDict(z=2, x=a), name="ordered")
    out = g.run()
    assert out["defaultdict"] == 11
    assert out["ordered"] == (collections.OrderedDict, [("z", 2), ("x", 1)])
    assert counts["x"] is a  # the caller's dict is left as it was
