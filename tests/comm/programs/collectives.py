"""One rank of a job that runs every operation of ninefold.comm and checks it against a local reference.

Every rank builds every rank's inputs from (rank, case) seeds, so it can compute the expected result
of each collective by itself. Prints ``PASS <case>`` or ``FAIL <case>: <why>`` per case, then
``DONE <n>``; exits 1 if any case failed. Environment: ``COMM_BACKEND`` (init's backend, default
auto), ``COMM_DEVICE`` (cpu or cuda; default cpu).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import zlib

import torch

import ninefold.comm as nc

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
results: list[str] = []


def data(case: str, rank: int, shape, dtype, *, positive: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()) * 1009 + rank)
    if dtype in FLOATS:
        x = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5 if positive else \
            torch.randn(shape, generator=g, dtype=torch.float64)
        return x.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-50, 50, shape, generator=g, dtype=torch.int64).to(dtype)


def expect(case: str, got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    got = got.cpu()
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if got.dtype != dtype:
        raise AssertionError(f"dtype {got.dtype}, expected {dtype}")
    if dtype in FLOATS:
        err = ((got.double() - want.double()).abs() / want.double().abs().clamp_min(1.0)).max().item()
        if not err <= TOL[dtype]:
            raise AssertionError(f"max relative error {err:.3g} > {TOL[dtype]}")
    elif not torch.equal(got, want.to(dtype)):
        raise AssertionError(f"values differ at {(got != want.to(dtype)).nonzero()[:3].tolist()}")


def reference(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    stack = torch.stack([x.double() if x.is_floating_point() else x.long() for x in xs])
    if op == "sum":
        return stack.sum(0)
    if op == "product":
        return stack.prod(0)
    if op == "min":
        return stack.min(0).values
    if op == "max":
        return stack.max(0).values
    return stack.mean(0)


def transport_threads(grace_s: float = 2.0) -> list[str]:
    """The names of this process's Gloo and TCPStore threads (Linux; torch names them; [] elsewhere) once
    none is left or ``grace_s`` has passed: a joined thread can stay listed until the kernel reaps it."""
    tasks, deadline = "/proc/self/task", time.monotonic() + grace_s
    while os.path.isdir(tasks):
        names = []
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # the thread ended meanwhile
                continue
        left = sorted(n for n in names if n.startswith(("pt_gloo", "gloo", "pt_tcpstore")))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)
    return []


def run(case: str, fn) -> None:
    try:
        fn()
        results.append(f"PASS {case}")
    except Exception as e:  # a failing case must not hide the others
        detail = "".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " | ")
        results.append(f"FAIL {case}: {detail}")


def main() -> int:
    comm = nc.init(os.environ.get("COMM_BACKEND", "auto"))
    dev = torch.device(os.environ.get("COMM_DEVICE", "cpu"))
    if dev.type == "cuda":
        dev = comm.device
    r, w = comm.rank, comm.world_size
    shape = (5, 7)

    for dtype in (*FLOATS, torch.int64):
        name = str(dtype).removeprefix("torch.")
        ops = ("sum", "product", "min", "max", "avg") if dtype in FLOATS else ("sum", "product", "min", "max")
        for op in ops:
            case = f"all_reduce/{name}/{op}"

            def all_reduce(case=case, op=op, dtype=dtype):
                xs = [data(case, k, shape, dtype, positive=op == "product") for k in range(w)]
                t = xs[r].clone().to(dev)
                assert comm.all_reduce(t, op) is t
                expect(case, t, reference(op, xs), dtype)
            run(case, all_reduce)

        case = f"all_reduce/{name}/non_contiguous_async"

        def all_reduce_view(case=case, dtype=dtype):
            xs = [data(case, k, (7, 5), dtype) for k in range(w)]
            base = xs[r].clone().to(dev)
            view = base.t()
            work = comm.all_reduce(view, "sum", async_op=True)
            work.wait()
            expect(case, base, reference("sum", xs), dtype)
        run(case, all_reduce_view)

        for dim in (0, 1, -1):
            case = f"all_gather/{name}/dim{dim}"

            def all_gather(case=case, dim=dim, dtype=dtype):
                xs = [data(case, k, shape, dtype) for k in range(w)]
                got = comm.all_gather(xs[r].to(dev).t().t(), dim=dim)
                expect(case, got, torch.cat(xs, dim=dim), dtype)
                out = torch.empty_like(got)
                assert comm.all_gather(xs[r].to(dev), dim=dim, out=out) is out
                expect(case, out, torch.cat(xs, dim=dim), dtype)
            run(case, all_gather)

            case = f"reduce_scatter/{name}/dim{dim}"

            def reduce_scatter(case=case, dim=dim, dtype=dtype):
                full = list(shape)
                full[dim] *= w
                xs = [data(case, k, tuple(full), dtype) for k in range(w)]
                got = comm.reduce_scatter(xs[r].to(dev), "sum", dim=dim)
                expect(case, got, reference("sum", xs).to(dtype).chunk(w, dim=dim)[r], dtype)
                out = torch.empty_like(got)
                assert comm.reduce_scatter(xs[r].to(dev), "sum", dim=dim, out=out) is out
                expect(case, out, reference("sum", xs).to(dtype).chunk(w, dim=dim)[r], dtype)
            run(case, reduce_scatter)

            case = f"all_to_all/{name}/dim{dim}"

            def all_to_all(case=case, dim=dim, dtype=dtype):
                full = list(shape)
                full[dim] *= w
                xs = [data(case, k, tuple(full), dtype) for k in range(w)]
                want = torch.cat([xs[k].chunk(w, dim=dim)[r] for k in range(w)], dim=dim)
                expect(case, comm.all_to_all(xs[r].to(dev), dim=dim), want, dtype)
                out = torch.empty_like(xs[r]).to(dev)
                work = comm.all_to_all(xs[r].to(dev), dim=dim, out=out, async_op=True)
                assert work.wait() is out
                expect(case, out, want, dtype)
            run(case, all_to_all)

        for root in sorted({0, w - 1}):
            case = f"broadcast/{name}/src{root}"

            def broadcast(case=case, root=root, dtype=dtype):
                xs = [data(case, k, shape, dtype) for k in range(w)]
                t = xs[r].clone().to(dev)
                comm.broadcast(t, src=root)
                expect(case, t, xs[root], dtype)
            run(case, broadcast)

            case = f"reduce/{name}/dst{root}"

            def reduce(case=case, root=root, dtype=dtype):
                xs = [data(case, k, shape, dtype) for k in range(w)]
                t = xs[r].clone().to(dev)
                comm.reduce(t, dst=root, op="max")
                expect(case, t, reference("max", xs) if r == root else xs[r], dtype)
            run(case, reduce)

    def ring(case="send_recv/ring_tags"):
        for tag in (0, 7):
            xs = [data(f"{case}{tag}", k, shape, torch.bfloat16) for k in range(w)]
            buf = torch.empty(shape, dtype=torch.bfloat16, device=dev)
            if w == 1:
                return
            nxt, prv = (r + 1) % w, (r - 1) % w
            if r % 2 == 0:
                comm.send(xs[r].to(dev), nxt, tag=tag)
                comm.recv(buf, prv, tag=tag)
            else:
                work = comm.recv(buf, prv, tag=tag, async_op=True)
                comm.send(xs[r].to(dev), nxt, tag=tag)
                work.wait()
            expect(case, buf, xs[prv], torch.bfloat16)
    run("send_recv/ring_tags", ring)

    def objects():
        got = comm.all_gather_object({"rank": r, "text": "x" * r})
        assert got == [{"rank": k, "text": "x" * k} for k in range(w)], got
        assert comm.broadcast_object(("root", r) if r == w - 1 else None, src=w - 1) == ("root", w - 1)
        if w > 1:
            nxt, prv = (r + 1) % w, (r - 1) % w
            if r % 2 == 0:
                comm.send_object({"from": r, "blob": b"\x00" * (1000 * r)}, nxt, tag=3)
                got = comm.recv_object(prv, tag=3)
            else:
                got = comm.recv_object(prv, tag=3)
                comm.send_object({"from": r, "blob": b"\x00" * (1000 * r)}, nxt, tag=3)
            assert got == {"from": prv, "blob": b"\x00" * (1000 * prv)}, got["from"]
    run("objects", objects)

    def split():
        sub = comm.split(r % 2)
        members = [k for k in range(w) if k % 2 == r % 2]
        assert sub.world_size == len(members) and sub.rank == members.index(r), (sub.rank, sub.world_size)
        t = torch.tensor([float(r)], device=dev)
        sub.all_reduce(t)
        assert t.item() == float(sum(members)), (t.item(), members)
        sub.close()
        none = comm.split(None if r == 0 else 1)
        assert (none is None) == (r == 0)
        if none is not None:
            none.barrier()
            none.close()
    run("split", split)

    def check_peers():
        comm.check_peers = True
        try:
            comm.all_reduce(torch.ones(r + 1, device=dev))
        except nc.CommError as e:
            assert "disagree" in str(e) and "rank 0" in str(e), e
        else:
            if w > 1:
                raise AssertionError("mismatched shapes were not detected")
        finally:
            comm.check_peers = False
    run("check_peers", check_peers)

    def argument_errors():
        t = torch.ones(4, device=dev)
        calls = [(lambda: comm.all_reduce(t, "median"), ValueError),
                 (lambda: comm.all_gather(t, out=torch.empty(3, device=dev)), ValueError),
                 (lambda: comm.all_gather(t, out=torch.empty(4 * w, dtype=torch.int64, device=dev)), TypeError),
                 (lambda: comm.broadcast(t, src=w), ValueError),
                 (lambda: comm.send(t, dst=r), ValueError),
                 (lambda: comm.all_gather(t, dim=2), ValueError),
                 (lambda: comm.all_reduce([1, 2]), TypeError),
                 (lambda: comm.all_reduce(t.bool(), "sum"), TypeError)]
        if w > 1:
            calls.append((lambda: comm.reduce_scatter(torch.ones(w + 1, 3, device=dev)), ValueError))
        for call, kind in calls:
            try:
                call()
            except kind:
                continue
            except Exception as e:
                raise AssertionError(f"expected {kind.__name__}, got {type(e).__name__}: {e}") from e
            raise AssertionError(f"expected {kind.__name__}, nothing raised")
    run("argument_errors", argument_errors)

    def async_polled():
        # is_completed() True means the result is in the caller's tensor: AVG divided, a view written back
        xs = [data("async_polled", k, (3, 4), torch.float32) for k in range(w)]
        base = xs[r].clone().to(dev)
        for t, op in ((base.t(), "sum"), (base, "avg")):
            work = comm.all_reduce(t, op, async_op=True)
            deadline = time.monotonic() + 60
            while not work.is_completed():
                assert time.monotonic() < deadline, "is_completed() never became True"
                time.sleep(0.001)
            expect("async_polled", base, reference(op, xs), torch.float32)
            work.wait()  # changes nothing
            expect("async_polled", base, reference(op, xs), torch.float32)
            base.copy_(xs[r])
        gathered = comm.all_gather(xs[r].to(dev), async_op=True)
        while not gathered.is_completed():
            time.sleep(0.001)
        expect("async_polled", gathered.result, torch.cat(xs), torch.float32)
    run("async_polled", async_polled)

    def bool_reductions():
        # max is or, min is and, over whichever transport the launcher led to (MPI refused them before)
        xs = [data("bool_reductions", k, (11,), torch.bool) for k in range(w)]
        for op, want in (("max", torch.stack(xs).any(0)), ("min", torch.stack(xs).all(0))):
            t = xs[r].clone().to(dev)
            expect("bool_reductions", comm.all_reduce(t, op), want, torch.bool)
            t = xs[r].clone().to(dev)
            expect("bool_reductions", comm.reduce(t, dst=w - 1, op=op), want if r == w - 1 else xs[r], torch.bool)
    run("bool_reductions", bool_reductions)

    def check_peers_refused():
        # with check_peers an argument error on one rank is an error on every rank, and the ranks stay in step
        if w == 1:
            return
        comm.check_peers = True
        try:
            bad = torch.ones(3, dtype=torch.bool if r == 0 else torch.float32, device=dev)
            try:
                comm.all_reduce(bad, "sum")
            except TypeError as e:
                assert r == 0 and "bool" in str(e), (r, e)
            except nc.CommError as e:
                assert r != 0 and "all_reduce: rank 0 refused its arguments (TypeError: tensor:" in str(e), e
            else:
                raise AssertionError("nothing raised")
            try:
                comm.all_gather(torch.ones(2, device=dev), out=torch.empty(2 * w + (r == w - 1), device=dev))
            except ValueError as e:
                assert r == w - 1 and "out: expected shape" in str(e), (r, e)
            except nc.CommError as e:
                assert r != w - 1 and f"rank {w - 1} refused its arguments (ValueError: out:" in str(e), e
            else:
                raise AssertionError("nothing raised")
            t = torch.ones(2, device=dev)
            assert comm.all_reduce(t).tolist() == [float(w)] * 2  # every rank pairs with the right call
        finally:
            comm.check_peers = False
    run("check_peers_refused", check_peers_refused)

    def unpicklable_objects():
        # an object that cannot be pickled is an error on every rank, not a wait for bytes that never come
        def refuses(call, failing: bool, words: str):
            try:
                call()
            except TypeError as e:
                assert failing and "obj: expected a picklable object, got function" in str(e), e
            except nc.CommError as e:
                assert not failing and words in str(e), e
            else:
                raise AssertionError("nothing raised")
        refuses(lambda: comm.broadcast_object((lambda: 0) if r == 0 else None, src=0), r == 0, "rank 0's obj")
        refuses(lambda: comm.all_gather_object((lambda: 0) if r == w - 1 else r), r == w - 1,
                f"the obj of rank(s) [{w - 1}]")
        if w > 1 and r == 0:
            refuses(lambda: comm.send_object(lambda: 0, 1, tag=9), True, "")
        elif w > 1 and r == 1:
            refuses(lambda: comm.recv_object(0, tag=9), False, "recv_object: rank 0's obj could not be pickled")
        assert comm.all_gather_object(r) == list(range(w))  # still in step
    run("unpicklable_objects", unpicklable_objects)

    def split_colors():
        # a bad color on one rank is a TypeError on every rank; an open child closes with its parent
        try:
            comm.split("left" if r == w - 1 else 0)
        except TypeError as e:
            assert f"color: expected an int or None on every rank, got str on rank {w - 1}" in str(e), e
        else:
            raise AssertionError("nothing raised")
        parent = comm.split(0)
        child = parent.split(r % 2)
        t = torch.ones(1, device=dev)
        assert child.all_reduce(t).item() == float(len(range(r % 2, w, 2)))
        parent.close()
        try:
            child.all_reduce(t)
        except nc.CommError:
            pass
        else:
            raise AssertionError("a child of a closed communicator still ran a collective")
    run("split_colors", split_colors)

    def shared_init():
        # init() while a communicator is open shares its job; closing the second leaves the first working
        second = nc.init(os.environ.get("COMM_BACKEND", "auto"), timeout_s=60)
        assert second.all_reduce(torch.ones(2, device=dev)).tolist() == [float(w)] * 2
        second.close()
        assert comm.all_reduce(torch.ones(1, device=dev)).item() == float(w)
    run("shared_init", shared_init)

    def into_their_own_input():
        # an out that is (or holds) the input: the transport must not write where it still reads
        for _ in range(10):
            buf = torch.arange(2.0 * w, device=dev) + 10 * r
            want = torch.tensor([10.0 * k + 2 * r + i for k in range(w) for i in range(2)], device=dev)
            expect("into_their_own_input", comm.all_to_all(buf, out=buf), want, torch.float32)
            gathered = torch.zeros(2 * w, device=dev)
            gathered[2 * r : 2 * r + 2] = r + 1
            comm.all_gather(gathered[2 * r : 2 * r + 2], out=gathered)
            expect("into_their_own_input", gathered, torch.arange(1.0, w + 1, device=dev).repeat_interleave(2),
                   torch.float32)
            summed = torch.full((2 * w,), r + 1.0, device=dev)
            comm.reduce_scatter(summed, out=summed[2 * r : 2 * r + 2])
            expect("into_their_own_input", summed[2 * r : 2 * r + 2], torch.full((2,), w * (w + 1) / 2, device=dev),
                   torch.float32)
    run("into_their_own_input", into_their_own_input)

    def average_of_a_parameter():
        # AVG's division is on the data: a leaf that requires grad is averaged, not refused half-way
        p = torch.nn.Parameter(torch.full((3,), float(r + 1), device=dev))
        comm.all_reduce(p, "avg")
        expect("average_of_a_parameter", p.detach(), torch.full((3,), (w + 1) / 2, device=dev), torch.float32)
    run("average_of_a_parameter", average_of_a_parameter)

    def tag_out_of_range():
        # a tag no transport here takes is a ValueError naming tag, before anything is sent
        for tag in (2**31, -1):
            try:
                comm.send(torch.ones(2, device=dev), (r + 1) % w, tag=tag) if w > 1 else comm.recv(
                    torch.ones(2, device=dev), 0, tag=tag)
            except ValueError as e:
                assert str(e).startswith("tag:"), e
                continue
            raise AssertionError(f"tag {tag} was taken")
    run("tag_out_of_range", tag_out_of_range)

    comm.barrier()
    print("\n".join(f"[{r}] {line}" for line in results), flush=True)
    print(f"[{r}] ROUTES {comm!r}", flush=True)
    print(f"[{r}] DONE {len(results)}", flush=True)
    comm.close()
    left = transport_threads()  # a transport thread alive at exit can abort the process (see TorchDistBackend.close)
    if left:
        print(f"[{r}] THREADS after close: {left}", flush=True)
    return 1 if left or any(line.startswith("FAIL") for line in results) else 0


if __name__ == "__main__":
    sys.exit(main())
