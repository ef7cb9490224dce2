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
"""

from ninefold.comm.backends.base import CommError, ReduceOp, Work
from ninefold.comm.communicator import Communicator
from ninefold.comm.topology import RankInfo, Route, Topology
from ninefold.comm.world import init

__all__ = ["CommError", "Communicator", "RankInfo", "ReduceOp", "Route", "Topology", "Work", "init"]
