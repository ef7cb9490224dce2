"""ninefold.runtime: devices, hardware profiles, memory classes, streams, task graphs, CUDA graphs.

``Device`` is one interface over torch devices. The memory classes: ``WeightStore`` (weights, one
allocation at load), ``KVCachePool`` (the paged key/value cache) and ``Workspace`` (per-stream
scratch reused across steps).
"""

from ninefold.runtime.device import Device
from ninefold.runtime.kv_pool import KVCacheExhausted, KVCachePool
from ninefold.runtime.memory import WeightsDoNotFit, WeightStore, Workspace

__all__ = ["Device", "KVCacheExhausted", "KVCachePool", "WeightStore", "WeightsDoNotFit", "Workspace"]
