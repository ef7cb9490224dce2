"""Communication benchmark: ``python -m ninefold.bench.comm [--nproc N] [--device cpu|cuda] [--max-mib M]``.

Starts ``N`` ranks itself (through ``ninefold.comm.launch``; under ``mpiexec`` it uses the ranks MPI
started instead) and times, for message sizes from 4 KiB up, all_reduce, all_gather,
reduce_scatter, broadcast and a send/recv ping-pong between ranks 0 and 1:
- through ``ninefold.comm`` (the transport it chooses for the tensors' device),
- through ``torch.distributed`` called directly on the same process group (the peer: what the
  communicator's checks and reshaping cost on top of the transport),
- under ``mpiexec`` also through the MPI transport and through Gloo, for CPU tensors;
- for CPU tensors of ranks on one host, all_reduce also through ``ninefold.comm.shm`` (up to its 4 MiB).

Each figure is the slowest rank's median time of the call; bandwidths follow nccl-tests:
algorithm bandwidth = bytes / time, bus bandwidth = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for
all_gather and reduce_scatter, x 1 for broadcast and send/recv. The ceiling is the link the bytes
cross: a peer-to-peer copy between two GPUs (CUDA), or a memory copy (CPU, all ranks on one host).
Prints a table; writes ``$OUT/comm.json`` (and ``$OUT/comm.png``) when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from ninefold.bench.results import pyplot

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "send_recv": lambda n: 1.0}


def main(argv: list[str] | None = None) -> int:
    """Parse the options; start the ranks (or, inside a rank, run the benchmark)."""
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.comm", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to start (default: the visible GPUs with --device cuda, else 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the tensors live (default: cuda when available)")
    parser.add_argument("--max-mib", type=float, default=None,
                        help="largest message in MiB (default 256 on GPUs, 64 on CPUs)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        parser.error(f"--ops: unknown {bad}; accepted: {', '.join(OPS)}")
    max_mib = args.max_mib or (256.0 if device == "cuda" else 64.0)
    if "RANK" in os.environ or _under_mpi():
        return run_rank(device, ops, max_mib)
    nproc = args.nproc or (torch.cuda.device_count() if device == "cuda" else 2)
    if nproc < 2:
        parser.error(f"--nproc: a communication benchmark needs at least 2 ranks, got {nproc} "
                     "(on a machine with one GPU use --device cpu, or --nproc 2 to share it through host copies)")
    cmd = [sys.executable, "-m", "ninefold.comm.launch", "--nproc", str(nproc), "--no-tag-output",
           sys.executable, "-m", "ninefold.bench.comm", "--device", device, "--max-mib", str(max_mib), "--ops", ",".join(ops)]
    return subprocess.call(cmd)


def _under_mpi() -> bool:
    from ninefold.comm.backends.mpi import mpi_world_from_env
    return mpi_world_from_env() is not None


def run_rank(device: str, ops: list[str], max_mib: float) -> int:
    """One rank: time every op and size through each transport; rank 0 prints and saves."""
    import torch.distributed as dist

    import ninefold.comm as nc

    comm = nc.init(device=device if device == "cpu" else None)
    dev = comm.device if device == "cuda" else torch.device("cpu")
    sizes = []
    size = 4096
    while size <= max_mib * 2**20:
        sizes.append(size)
        size *= 4
    paths = [("ninefold", comm)]
    direct = comm.backends[comm.routes[dev.type].backend]
    if not comm.routes[dev.type].staged and hasattr(direct, "process_group"):
        paths.append((f"torch.distributed {direct.name}", _TorchDirect(direct.process_group, dist)))
    if dev.type == "cpu" and "mpi" in comm.backends and comm.routes["cpu"].backend == "mpi":
        paths.append(("mpi4py direct", _MpiDirect()))
        gloo_only = nc.Communicator({"gloo": comm.backends["gloo"]}, comm.topology, dev,
                                    {"cpu": nc.Route("gloo", False, "forced for the comparison")})
        paths.append(("ninefold over gloo", gloo_only))
    shm = None
    if dev.type == "cpu":
        from ninefold.comm import shm as shm_module

        if shm_module.available(comm):
            shm = shm_module.SharedMemoryAllReduce(comm)
            paths.append(("ninefold.comm.shm", _ShmPath(shm)))
    rows = []
    for op in ops:
        for nbytes in sizes:
            for name, path in paths:
                if isinstance(path, _ShmPath) and not path.takes(op, nbytes):
                    continue
                seconds = _time(comm, path, op, nbytes, dev)
                if seconds is None:
                    continue
                algbw = nbytes / seconds
                rows.append({"op": op, "bytes": nbytes, "path": name, "us": seconds * 1e6,
                             "algbw_gbps": algbw / 1e9, "busbw_gbps": algbw * BUS_FACTOR[op](comm.world_size) / 1e9})
            if comm.rank == 0:
                line = "  ".join(f"{r['path']}: {r['us']:.1f} us {r['busbw_gbps']:.2f} GB/s"
                                 for r in rows if r["op"] == op and r["bytes"] == nbytes)
                print(f"{op:<15} {_human(nbytes):>9}  {line}", flush=True)
    comm.barrier()
    if comm.rank == 0:  # alone, so no other rank competes for the link or the memory
        report(rows, _ceiling(dev), comm, dev)
    comm.barrier()
    if shm is not None:
        shm.close()
    comm.close()
    return 0


class _ShmPath:
    """``ninefold.comm.shm``'s all-reduce (the one op it has, up to its size limit)."""

    def __init__(self, shm):
        self.shm = shm

    def takes(self, op: str, nbytes: int) -> bool:
        return op == "all_reduce" and nbytes <= self.shm.max_bytes

    def all_reduce(self, t):
        self.shm.all_reduce(t)


class _TorchDirect:
    """torch.distributed called directly, with the communicator's method names (the benchmark's peer)."""

    def __init__(self, group, dist):
        self.group, self.dist = group, dist

    def all_reduce(self, t):
        self.dist.all_reduce(t, group=self.group)

    def all_gather(self, t, out):
        self.dist.all_gather_into_tensor(out, t, group=self.group)

    def reduce_scatter(self, t, out):
        self.dist.reduce_scatter_tensor(out, t, group=self.group)

    def broadcast(self, t):
        self.dist.broadcast(t, group_src=0, group=self.group)

    def send(self, t, dst):
        self.dist.send(t, group_dst=dst, group=self.group)

    def recv(self, t, src):
        self.dist.recv(t, group_src=src, group=self.group)


class _MpiDirect:
    """mpi4py's buffer calls on the tensors' memory (the MPI path's peer)."""

    def __init__(self):
        from mpi4py import MPI
        self.comm, self.mpi = MPI.COMM_WORLD, MPI

    def all_reduce(self, t):
        self.comm.Allreduce(self.mpi.IN_PLACE, t.numpy())

    def all_gather(self, t, out):
        self.comm.Allgather(t.numpy(), out.numpy())

    def reduce_scatter(self, t, out):
        self.comm.Reduce_scatter_block(t.numpy(), out.numpy())

    def broadcast(self, t):
        self.comm.Bcast(t.numpy(), root=0)

    def send(self, t, dst):
        self.comm.Send(t.numpy(), dest=dst)

    def recv(self, t, src):
        self.comm.Recv(t.numpy(), source=src)


def _time(comm, path, op: str, nbytes: int, dev: torch.device) -> float | None:
    """The slowest rank's median seconds per call of ``op`` on a message of ``nbytes``."""
    n = comm.world_size
    numel = max(nbytes // 4, n)
    numel -= numel % n
    x = torch.ones(numel, dtype=torch.float32, device=dev)
    direct = isinstance(path, (_TorchDirect, _MpiDirect))
    if op == "all_reduce":
        call = lambda: path.all_reduce(x)  # noqa: E731
    elif op == "all_gather":
        part = x[: numel // n].clone()
        out = torch.empty(numel, dtype=torch.float32, device=dev)
        call = (lambda: path.all_gather(part, out)) if direct else (lambda: path.all_gather(part, out=out))  # noqa: E731
    elif op == "reduce_scatter":
        out = torch.empty(numel // n, dtype=torch.float32, device=dev)
        call = (lambda: path.reduce_scatter(x, out)) if direct else (lambda: path.reduce_scatter(x, out=out))  # noqa: E731
    elif op == "broadcast":
        call = lambda: path.broadcast(x)  # noqa: E731
    else:
        if comm.rank > 1:
            call = None
        elif comm.rank == 0:
            def call():
                path.send(x, 1)
                path.recv(x, 1)
        else:
            def call():
                path.recv(x, 0)
                path.send(x, 0)
    times = []
    budget = 0.3 if nbytes < 2**24 else 1.0
    start = time.perf_counter()
    while True:
        comm.barrier()
        if call is not None:
            t0 = time.perf_counter()
            call()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        # every rank must agree on when to stop, or the barriers pair up wrongly
        more = torch.tensor([1.0 if (len(times) < 5 or time.perf_counter() - start < budget) and len(times) < 200
                             else 0.0])
        comm.all_reduce(more, "max")
        if more.item() == 0.0:
            break
    mine = statistics.median(times[2:]) if len(times) > 2 else (times[-1] if times else 0.0)
    slowest = max(comm.all_gather_object(mine))
    if op == "send_recv":
        return slowest / 2  # one direction of the ping-pong
    return slowest


def _ceiling(dev: torch.device) -> dict:
    """The link the bytes cross: GPU-to-GPU copy bandwidth, or the host's memory copy bandwidth."""
    if dev.type == "cuda" and torch.cuda.device_count() > 1:
        a = torch.empty(2**28, dtype=torch.uint8, device="cuda:0")
        b = torch.empty(2**28, dtype=torch.uint8, device="cuda:1")
        b.copy_(a)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize()
        return {"what": "cuda:0 -> cuda:1 copy", "gbps": 10 * a.numel() / (time.perf_counter() - t0) / 1e9}
    src = torch.ones(2**27, dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"what": f"{dev.type} memory copy, bytes read", "gbps": 10 * src.numel() / (time.perf_counter() - t0) / 1e9}


def report(rows: list[dict], ceiling: dict, comm, dev: torch.device) -> None:
    """Print the largest-message summary per op and path; save JSON and a plot under $OUT."""
    print(f"\nceiling: {ceiling['what']} {ceiling['gbps']:.1f} GB/s; {comm.world_size} ranks\n{comm.describe()}")
    largest = max(r["bytes"] for r in rows)
    print(f"\n{'op':<15} {'path':<28} {'small (4 KiB) us':>17} {'busbw GB/s at ' + _human(largest):>22} {'of ceiling':>10}")
    for op in dict.fromkeys(r["op"] for r in rows):
        for path in dict.fromkeys(r["path"] for r in rows):
            mine = [r for r in rows if r["op"] == op and r["path"] == path]
            if not mine:
                continue
            small, big = mine[0], mine[-1]
            print(f"{op:<15} {path:<28} {small['us']:>17.1f} {big['busbw_gbps']:>22.2f} "
                  f"{big['busbw_gbps'] / ceiling['gbps']:>10.0%}")
    out = os.environ.get("OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "world_size": comm.world_size, "device": str(dev), "torch": torch.__version__,
              "topology": comm.describe(), "ceiling": ceiling, "rows": rows}
    with open(os.path.join(out, "comm.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out, "comm.png"))


def plot(result: dict, path: str) -> None:
    """Bus bandwidth against message size, one panel per op, one line per path."""
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for name in dict.fromkeys(r["path"] for r in rows):
            mine = [r for r in rows if r["op"] == op and r["path"] == name]
            ax.plot([r["bytes"] for r in mine], [r["busbw_gbps"] for r in mine], marker="o", ms=3, label=name)
        ax.axhline(result["ceiling"]["gbps"], color="grey", ls="--", lw=1, label="ceiling")
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("message bytes")
        ax.set_ylabel("bus GB/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"ninefold.comm, {result['world_size']} ranks, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:g} {unit}"
        nbytes /= 1024
    return f"{nbytes:g} TiB"


if __name__ == "__main__":
    sys.exit(main())
