"""ninefold.comm: one API for collectives and point-to-point transfers over NCCL, Gloo and MPI.

```python
import ninefold.comm as nc

comm = nc.init()                      # every process of the job; `ninefold launch -n 4 prog.py` starts them
comm.all_reduce(grad)                 # NCCL for CUDA tensors, Gloo or MPI for CPU tensors, from the topology
parts = comm.all_gather(x, dim=1)
comm.send(kv_blocks, dst=1); comm.recv(buf, src=0)
tp = comm.split(color=comm.rank // 2) # sub-communicators, as MPI_Comm_split
print(comm.describe())                # ranks, hosts, devices and the transport per device type
```

Processes: ``ninefold launch`` (or ``python -m ninefold.comm.launch``) from a shell,
``ninefold.comm.spawn.spawn(fn, nprocs)`` from Python. The names below load on first use, so the
launcher starts without importing torch.
"""

_LAZY = {
    "CommError": "ninefold.comm.backends.base",
    "ReduceOp": "ninefold.comm.backends.base",
    "Work": "ninefold.comm.backends.base",
    "Communicator": "ninefold.comm.communicator",
    "RankInfo": "ninefold.comm.topology",
    "Route": "ninefold.comm.topology",
    "Topology": "ninefold.comm.topology",
    "init": "ninefold.comm.world",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ninefold.comm' has no attribute {name!r}")


__all__ = list(_LAZY)
