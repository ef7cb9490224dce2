"""All-reduce (rank + 1) over Gloo from the launcher's environment and print ``sum S rank R of W``."""

import datetime

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
value = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(value)
print(f"sum {int(value.item())} rank {dist.get_rank()} of {dist.get_world_size()}")
dist.destroy_process_group()
