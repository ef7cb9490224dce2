"""ninefold.runtime: devices, hardware profiles, memory classes, streams, task graphs, CUDA graphs.

``Device`` is one interface over torch devices. The memory classes: ``WeightStore`` (weights, one
allocation at load), ``KVCachePool`` (the paged key/value cache) and ``Workspace`` (per-stream
scratch reused across steps). ``TaskGraph`` runs tasks with dependencies on streams;
``CudaGraphRunner`` captures a callable per batch size and replays it. Hardware profiles:
``ninefold.runtime.profile.profile_device``.
"""

from ninefold.runtime.cuda_graph import CudaGraphRunner
from ninefold.runtime.device import Device
from ninefold.runtime.graph import Task, TaskFailed, TaskGraph
from ninefold.runtime.kv_pool import KVCacheExhausted, KVCachePool
from ninefold.runtime.memory import WeightsDoNotFit, WeightStore, Workspace

__all__ = [
    "CudaGraphRunner", "Device", "KVCacheExhausted", "KVCachePool", "Task", "TaskFailed", "TaskGraph",
    "WeightStore", "WeightsDoNotFit", "Workspace",
]
