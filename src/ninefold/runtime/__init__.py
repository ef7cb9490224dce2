"""ninefold.runtime: devices, hardware profiles, memory classes, streams, task graphs, CUDA graphs.

``Device`` is one interface over torch devices; ``KVCachePool`` holds the paged key/value cache.
"""

from ninefold.runtime.device import Device
from ninefold.runtime.kv_pool import KVCacheExhausted, KVCachePool

__all__ = ["Device", "KVCacheExhausted", "KVCachePool"]
