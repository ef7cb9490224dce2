"""Checks every MpiBackend operation under a real ``mpiexec``; run as ``mpiexec -n N python check_backend.py DIR``.

Every rank builds its inputs from a seed of (case, rank), so it can rebuild every other rank's
inputs and check its own results against a float64 reference computed locally. Each rank writes
``PASS <case>`` / ``FAIL <case>: <why>`` lines to ``DIR/rank<r>.txt``, prints its failures, and exits
1 if any case failed on it.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
import zlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

from ninefold.comm.backends.base import CommError, ReduceOp
from ninefold.comm.backends.mpi import MpiBackend, mpi_world_from_env, rendezvous_from_mpi

REDUCED = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)
SMALL_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32)
MOVED = REDUCED + SMALL_INTS + (torch.bool,)
TOLERANCE = {  # (rtol, atol) against the exact float64 reduction of the inputs
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
MODES = ("sync", "async")


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make(case: str, rank: int, shape: tuple[int, ...], dtype: torch.dtype, integral: bool = False) -> torch.Tensor:
    """Rank ``rank``'s input for ``case``: the same on every process that asks."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{case}|{rank}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 6, shape, generator=generator, dtype=torch.uint8)
    if integral or not dtype.is_floating_point:
        return torch.randint(-3, 4, shape, generator=generator).to(dtype)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def reference(inputs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    stacked = torch.stack([x.double() for x in inputs])
    if op == ReduceOp.SUM:
        return stacked.sum(0)
    if op == ReduceOp.PRODUCT:
        return stacked.prod(0)
    if op == ReduceOp.MIN:
        return stacked.amin(0)
    if op == ReduceOp.MAX:
        return stacked.amax(0)
    return stacked.mean(0)


def expect_reduced(got: torch.Tensor, ref: torch.Tensor, op: ReduceOp) -> None:
    if not got.dtype.is_floating_point or op in (ReduceOp.MIN, ReduceOp.MAX):
        assert torch.equal(got.double(), ref), f"expected exactly {ref.tolist()}, got {got.tolist()}"
    else:
        rtol, atol = TOLERANCE[got.dtype]
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol)


def expect_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    assert torch.equal(got, want), f"expected {want.tolist()}, got {got.tolist()}"


def finish(work, mode: str) -> None:
    """Complete a returned Work the way ``mode`` says and check what it reports."""
    if mode == "async":
        work.wait()
    assert work.is_completed(), "is_completed() is False after the operation finished"


class Runner:
    def __init__(self, backend: MpiBackend, report_dir: Path):
        self.backend = backend
        self.rank, self.size = backend.rank, backend.world_size
        self.lines: list[str] = []
        self.failures = 0
        # Written line by line, so that a run cut short by a timeout still shows how far it got.
        self.report = open(report_dir / f"rank{self.rank}.txt", "w")

    def case(self, name: str, check) -> None:
        try:
            check()
        except Exception as exc:  # a failed case is reported, and the next one runs
            self.failures += 1
            where = traceback.extract_tb(exc.__traceback__)[-1]
            why = f"{type(exc).__name__}: {exc} (line {where.lineno})".replace("\n", " ")
            self.record(f"FAIL {name}: {why}")
            print(f"rank {self.rank} FAIL {name}: {why}", flush=True)
        else:
            self.record(f"PASS {name}")

    def record(self, line: str) -> None:
        self.lines.append(line)
        self.report.write(line + "\n")
        self.report.flush()


def reductions(run: Runner) -> None:
    b, rank, size = run.backend, run.rank, run.size
    index = 0
    for dtype in REDUCED:
        for op in ReduceOp:
            if op == ReduceOp.AVG and not dtype.is_floating_point:
                continue
            for mode in MODES:
                index += 1
                root = index % size
                name = f"all_reduce/{short(dtype)}/{op.value}/{mode}"

                def all_reduce(name=name, dtype=dtype, op=op, mode=mode):
                    inputs = [make(name, r, (4, 7), dtype) for r in range(size)]
                    tensor = inputs[rank].clone()
                    finish(b.all_reduce(tensor, op, mode == "async"), mode)
                    expect_reduced(tensor, reference(inputs, op), op)

                run.case(name, all_reduce)
                name = f"reduce_scatter/{short(dtype)}/{op.value}/{mode}"

                def reduce_scatter(name=name, dtype=dtype, op=op, mode=mode):
                    inputs = [make(name, r, (size, 7), dtype) for r in range(size)]
                    out = torch.full((7,), 99, dtype=dtype)
                    finish(b.reduce_scatter(out, inputs[rank].clone(), op, mode == "async"), mode)
                    expect_reduced(out, reference(inputs, op)[rank], op)

                run.case(name, reduce_scatter)
                name = f"reduce/{short(dtype)}/{op.value}/{mode}"

                def reduce(name=name, dtype=dtype, op=op, mode=mode, root=root):
                    inputs = [make(name, r, (9,), dtype) for r in range(size)]
                    tensor = inputs[rank].clone()
                    finish(b.reduce(tensor, root, op, mode == "async"), mode)
                    if rank == root:
                        expect_reduced(tensor, reference(inputs, op), op)

                run.case(name, reduce)

    for dtype in SMALL_INTS:
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
            name = f"all_reduce/{short(dtype)}/{op.value}/sync"

            def small_int(name=name, dtype=dtype, op=op):
                inputs = [make(name, r, (11,), dtype) for r in range(size)]
                tensor = inputs[rank].clone()
                finish(b.all_reduce(tensor, op, False), "sync")
                expect_reduced(tensor, reference(inputs, op), op)

            run.case(name, small_int)

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        name = f"all_reduce/exact/{short(dtype)}"

        def exact(name=name, dtype=dtype):
            inputs = [make(name, r, (5, 3), dtype, integral=True) for r in range(size)]
            tensor = inputs[rank].clone()
            b.all_reduce(tensor, ReduceOp.SUM, False)
            expect_equal(tensor, reference(inputs, ReduceOp.SUM).to(dtype))

        run.case(name, exact)

    def large():
        # 4 MiB per rank: past any eager-message limit, so the rendezvous protocol runs too.
        inputs = [make("large", r, (1 << 20,), torch.float32, integral=True) for r in range(size)]
        tensor = inputs[rank].clone()
        b.all_reduce(tensor, ReduceOp.SUM, False)
        expect_equal(tensor, reference(inputs, ReduceOp.SUM).float())

    run.case("all_reduce/large/float32", large)

    def empty():
        tensor = torch.empty(0, dtype=torch.float16)
        b.all_reduce(tensor, ReduceOp.AVG, False)
        finish(b.all_reduce(tensor, ReduceOp.SUM, True), "async")
        assert tensor.numel() == 0

    run.case("all_reduce/empty", empty)

    if size >= 3:
        for dtype, big in ((torch.float16, 2048.0), (torch.bfloat16, 256.0)):
            # At `big` the spacing of the dtype is 2: big + 1 rounds back to big in the dtype, so a
            # native accumulator would return big; a float32 one returns big + (size - 1).
            name = f"all_reduce/accumulates_in_float32/{short(dtype)}"

            def accumulate(dtype=dtype, big=big):
                tensor = torch.full((3,), big if rank == 0 else 1.0, dtype=dtype)
                b.all_reduce(tensor, ReduceOp.SUM, False)
                expect_equal(tensor, torch.full((3,), big + size - 1, dtype=torch.float32).to(dtype))

            run.case(name, accumulate)


def movements(run: Runner) -> None:
    b, rank, size = run.backend, run.rank, run.size
    index = 0
    for dtype in MOVED:
        for mode in MODES:
            index += 1
            name = f"all_gather/{short(dtype)}/{mode}"

            def all_gather(name=name, dtype=dtype, mode=mode):
                inputs = [make(name, r, (3, 5), dtype) for r in range(size)]
                out = torch.zeros((size * 3, 5), dtype=dtype)
                finish(b.all_gather(out, inputs[rank].clone(), mode == "async"), mode)
                expect_equal(out, torch.cat(inputs))

            run.case(name, all_gather)
            name = f"broadcast/{short(dtype)}/{mode}"

            def broadcast(name=name, dtype=dtype, mode=mode, src=index % size):
                tensor = make(name, rank, (2, 9), dtype)
                finish(b.broadcast(tensor, src, mode == "async"), mode)
                expect_equal(tensor, make(name, src, (2, 9), dtype))

            run.case(name, broadcast)
            name = f"all_to_all/{short(dtype)}/{mode}"

            def all_to_all(name=name, dtype=dtype, mode=mode):
                inputs = [make(name, r, (size, 5), dtype) for r in range(size)]
                out = torch.zeros(size * 5, dtype=dtype)
                finish(b.all_to_all(out, inputs[rank].clone(), mode == "async"), mode)
                expect_equal(out, torch.cat([inputs[r][rank] for r in range(size)]))

            run.case(name, all_to_all)
            name = f"send_recv_ring/{short(dtype)}/{mode}"

            def ring(name=name, dtype=dtype, mode=mode, tag=100 + index):
                after, before = (rank + 1) % size, (rank - 1) % size
                outgoing = make(name, rank, (13,), dtype)
                incoming = torch.zeros(13, dtype=dtype)
                if mode == "async":
                    works = [b.recv(incoming, before, tag, True), b.send(outgoing, after, tag, True)]
                    for work in works:
                        finish(work, mode)
                elif rank == 0:  # rank 0 starts the chain, the others pass it on: no cycle of waits
                    finish(b.send(outgoing, after, tag, False), mode)
                    finish(b.recv(incoming, before, tag, False), mode)
                else:
                    finish(b.recv(incoming, before, tag, False), mode)
                    finish(b.send(outgoing, after, tag, False), mode)
                expect_equal(incoming, make(name, before, (13,), dtype))

            run.case(name, ring)

    def scalar():
        tensor = torch.tensor(float(rank) + 0.5, dtype=torch.bfloat16)
        b.broadcast(tensor, size - 1, False)
        expect_equal(tensor, torch.tensor(size - 0.5, dtype=torch.bfloat16))

    run.case("broadcast/scalar", scalar)

    for dtype, bits in ((torch.float16, torch.int16), (torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        name = f"broadcast/special_values/{short(dtype)}"

        def special(dtype=dtype, bits=bits):
            values = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -3.5]
            tensor = torch.tensor(values, dtype=dtype) if rank == 0 else torch.zeros(len(values), dtype=dtype)
            b.broadcast(tensor, 0, False)
            expect_equal(tensor.view(bits), torch.tensor(values, dtype=dtype).view(bits))

        run.case(name, special)

    def tags_out_of_order():
        if rank == 0:
            first, second = torch.full((4,), 1.0), torch.full((4,), 2.0)
            works = [b.send(first, 1, 11, True), b.send(second, 1, 22, True)]
            for work in works:
                work.wait()
        elif rank == 1:
            got_second, got_first = torch.zeros(4), torch.zeros(4)
            b.recv(got_second, 0, 22, False)
            b.recv(got_first, 0, 11, False)
            expect_equal(got_first, torch.full((4,), 1.0))
            expect_equal(got_second, torch.full((4,), 2.0))

    run.case("send_recv/tags_out_of_order", tags_out_of_order)


def asynchrony(run: Runner) -> None:
    b, rank, size = run.backend, run.rank, run.size

    def not_completed_before_peer_sends():
        if rank == 0:
            incoming, go = torch.zeros(6), torch.ones(1)
            work = b.recv(incoming, 1, 31, True)
            early = work.is_completed()
            b.send(go, 1, 32, False)  # the peer sends only now; the exchange runs to its end in any case
            work.wait()
            assert not early, "is_completed() was True before the peer sent anything"
            assert work.is_completed()
            expect_equal(incoming, torch.arange(6.0))
        elif rank == 1:
            b.recv(torch.zeros(1), 0, 32, False)
            b.send(torch.arange(6.0), 0, 31, False)

    run.case("async/not_completed_before_peer_sends", not_completed_before_peer_sends)

    def polls_to_completion():
        inputs = [make("poll", r, (8,), torch.bfloat16) for r in range(size)]
        tensor = inputs[rank].clone()
        work = b.all_reduce(tensor, ReduceOp.AVG, True)
        deadline = time.monotonic() + 30
        while not work.is_completed():
            assert time.monotonic() < deadline, "is_completed() stayed False for 30 s"
        # is_completed() returning True means the cast back into the bfloat16 tensor has happened.
        expect_reduced(tensor, reference(inputs, ReduceOp.AVG), ReduceOp.AVG)
        work.wait()

    run.case("async/polls_to_completion", polls_to_completion)

    def many_in_flight():
        summed = make("flight-sum", rank, (10,), torch.float16)
        gathered = torch.zeros(size * 4, dtype=torch.int64)
        scattered = torch.zeros(3, dtype=torch.bfloat16)
        scatter_in = make("flight-rs", rank, (size * 3,), torch.bfloat16)
        broadcast = make("flight-bc", rank, (5,), torch.float64)
        works = [
            b.all_reduce(summed, ReduceOp.SUM, True),
            b.all_gather(gathered, make("flight-ag", rank, (4,), torch.int64), True),
            b.reduce_scatter(scattered, scatter_in, ReduceOp.MAX, True),
            b.broadcast(broadcast, size - 1, True),
        ]
        for work in reversed(works):
            work.wait()
        expect_reduced(summed, reference([make("flight-sum", r, (10,), torch.float16) for r in range(size)],
                                         ReduceOp.SUM), ReduceOp.SUM)
        expect_equal(gathered, torch.cat([make("flight-ag", r, (4,), torch.int64) for r in range(size)]))
        rs_ref = reference([make("flight-rs", r, (size * 3,), torch.bfloat16) for r in range(size)], ReduceOp.MAX)
        expect_reduced(scattered, rs_ref[rank * 3:(rank + 1) * 3], ReduceOp.MAX)
        expect_equal(broadcast, make("flight-bc", size - 1, (5,), torch.float64))

    run.case("async/many_in_flight", many_in_flight)

    def keeps_buffers_alive():
        # The float32 copies MPI reads are referenced by the Work alone (the caller keeps only the
        # float16 tensors); churn the allocator so that freed memory would be reused, then check.
        n = 1 << 18  # 1 MiB in float32: large enough for MPI to read it only while the Work is waited on
        inputs = [make("alive", r, (size * n,), torch.float16) for r in range(size)]
        out = torch.zeros(n, dtype=torch.float16)
        work = b.reduce_scatter(out, inputs[rank].clone(), ReduceOp.SUM, True)
        gc.collect()
        churn = [torch.full((size * n,), -7.0) for _ in range(8)]
        work.wait()
        del churn
        expect_reduced(out, reference(inputs, ReduceOp.SUM)[rank * n:(rank + 1) * n], ReduceOp.SUM)

    run.case("async/keeps_buffers_alive", keeps_buffers_alive)


def groups(run: Runner) -> None:
    b, rank, size = run.backend, run.rank, run.size
    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))

    def split_and_use():
        in_evens, in_odds = b.split(evens), b.split(odds)
        mine, members = (in_evens, evens) if rank % 2 == 0 else (in_odds, odds)
        other = in_odds if rank % 2 == 0 else in_evens
        assert other is None, f"split over {odds if rank % 2 == 0 else evens} gave rank {rank} a backend"
        assert (mine.rank, mine.world_size) == (members.index(rank), len(members)), \
            f"rank {rank} in {members}: got rank {mine.rank} of {mine.world_size}"
        inputs = {r: make("group-sum", r, (6,), torch.float32) for r in members}
        tensor = inputs[rank].clone()
        mine.all_reduce(tensor, ReduceOp.SUM, False)
        expect_reduced(tensor, reference(list(inputs.values()), ReduceOp.SUM), ReduceOp.SUM)
        gathered = torch.zeros(len(members) * 2, dtype=torch.bfloat16)
        mine.all_gather(gathered, make("group-ag", rank, (2,), torch.bfloat16), True).wait()
        expect_equal(gathered, torch.cat([make("group-ag", r, (2,), torch.bfloat16) for r in members]))
        last = members[-1]
        tensor = make("group-bc", rank, (3,), torch.int64)
        mine.broadcast(tensor, mine.world_size - 1, False)
        expect_equal(tensor, make("group-bc", last, (3,), torch.int64))

        nested = mine.split([0])
        assert (nested is None) == (mine.rank != 0), "nested split([0]) membership is wrong"
        if nested is not None:
            alone = torch.arange(4.0)
            nested.all_reduce(alone, ReduceOp.SUM, False)
            expect_equal(alone, torch.arange(4.0))
            nested.close()

        mine.close()
        mine.close()  # a second close does nothing
        try:
            mine.all_reduce(torch.ones(2), ReduceOp.SUM, False)
        except CommError as exc:
            assert "all_reduce" in str(exc), f"CommError does not name the operation: {exc}"
        else:
            raise AssertionError("all_reduce on a closed split backend did not raise CommError")
        b.barrier()

    run.case("split/evens_odds", split_and_use)


def refusals(run: Runner) -> None:
    b = run.backend

    def cuda():
        assert b.cuda_aware is False, "this MPICH wheel is not CUDA-aware, but cuda_aware is True"
        reason = b.unsupported("cuda", torch.float32)
        assert reason and "cuda" in reason and "not CUDA-aware" in reason, reason
        assert b.unsupported("cuda", torch.bfloat16, ReduceOp.SUM) is not None

    run.case("unsupported/cuda", cuda)

    def bool_reductions():
        # bool reduces with max (or) and min (and), as over Gloo: a program must not depend on its launcher.
        assert b.unsupported("cpu", torch.bool) is None, "bool must travel"
        for op in ReduceOp:
            reason = b.unsupported("cpu", torch.bool, op)
            if op in (ReduceOp.MAX, ReduceOp.MIN):
                assert reason is None, f"{op}: {reason}"
            else:
                assert reason and "bool" in reason and op.value in reason, f"{op}: {reason}"
        inputs = [make("bool_reductions", r, (9,), torch.bool) for r in range(b.world_size)]
        for op, want in ((ReduceOp.MAX, torch.stack(inputs).any(0)), (ReduceOp.MIN, torch.stack(inputs).all(0))):
            for mode in MODES:
                got = inputs[b.rank].clone()
                finish(b.all_reduce(got, op, mode == "async"), mode)
                expect_equal(got, want)
                got = inputs[b.rank].clone()
                finish(b.reduce(got, 0, op, mode == "async"), mode)
                if b.rank == 0:
                    expect_equal(got, want)
            out = torch.empty(3, dtype=torch.bool)
            full = [make("bool_scatter", r, (3 * b.world_size,), torch.bool) for r in range(b.world_size)]
            b.reduce_scatter(out, full[b.rank].clone(), op, False)
            whole = torch.stack(full).any(0) if op == ReduceOp.MAX else torch.stack(full).all(0)
            expect_equal(out, whole[3 * b.rank: 3 * b.rank + 3])
        try:
            b.all_reduce(torch.ones(3, dtype=torch.bool), ReduceOp.SUM, False)
        except ValueError as exc:
            assert "bool" in str(exc), exc
        else:
            raise AssertionError("sum of bool did not raise ValueError")

    run.case("unsupported/bool_reductions", bool_reductions)

    def integer_avg():
        for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
            reason = b.unsupported("cpu", dtype, ReduceOp.AVG)
            assert reason and "avg" in reason and str(dtype) in reason, f"{dtype}: {reason}"
            for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
                assert b.unsupported("cpu", dtype, op) is None, f"{dtype} {op} refused"

    run.case("unsupported/integer_avg", integer_avg)

    def accepted_and_others():
        for dtype in MOVED:
            assert b.unsupported("cpu", dtype) is None, f"{dtype} refused"
        for dtype in REDUCED:
            assert b.unsupported("cpu", dtype, ReduceOp.PRODUCT) is None, f"{dtype} product refused"
        assert "meta" in (b.unsupported("meta", torch.float32) or ""), "meta device accepted"
        assert "complex64" in (b.unsupported("cpu", torch.complex64) or ""), "complex64 accepted"

    run.case("unsupported/accepted_and_others", accepted_and_others)

    def mpi_error_is_comm_error():
        for async_op in (False, True):
            try:
                b.send(torch.ones(2), run.size + 3, 0, async_op)
            except CommError as exc:
                assert "send" in str(exc) and "rank" in str(exc).lower(), exc
            else:
                raise AssertionError(f"send to rank {run.size + 3} (async_op={async_op}) did not raise")

    run.case("error/mpi_error_is_comm_error", mpi_error_is_comm_error)


def launch_helpers(run: Runner) -> None:
    rank, size = run.rank, run.size
    endpoint: list[tuple[str, int]] = []

    def same_everywhere():
        endpoint.append(rendezvous_from_mpi())
        everyone = MPI.COMM_WORLD.allgather(endpoint[0])
        assert len(set(everyone)) == 1, f"ranks got different endpoints: {everyone}"
        address, port = endpoint[0]
        assert address == "127.0.0.1" and 0 < port < 65536, endpoint[0]

    run.case("rendezvous/same_everywhere", same_everywhere)

    def gloo_starts():
        address, port = endpoint[0]
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=60))
        try:
            tensor = torch.tensor([rank + 1.0])
            dist.all_reduce(tensor)
            expect_equal(tensor, torch.tensor([size * (size + 1) / 2]))
        finally:
            dist.destroy_process_group()

    run.case("rendezvous/gloo_all_reduce", gloo_starts)

    def environment():
        local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        expected = (rank, size, local.Get_rank())
        local.Free()
        assert mpi_world_from_env() == expected, f"{mpi_world_from_env()} != {expected}"

    run.case("env/matches_mpi", environment)


def closing(run: Runner) -> None:
    def world_close():
        run.backend.close()
        for use in (lambda: run.backend.barrier(), lambda: run.backend.split([0])):
            try:
                use()
            except CommError:
                pass
            else:
                raise AssertionError("a closed backend still works")
        MPI.COMM_WORLD.Barrier()  # COMM_WORLD itself stays usable

    run.case("close/world", world_close)


def main() -> int:
    run = Runner(MpiBackend(), Path(sys.argv[1]))
    for section in (refusals, reductions, movements, asynchrony, groups, launch_helpers, closing):
        section(run)
    run.report.close()
    print(f"rank {run.rank}: {len(run.lines) - run.failures} passed, {run.failures} failed", flush=True)
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
