"""KV cache bookkeeping: slots, operation-aware radix tree, planner, usage. Pure Python, no torch.

Layers inside, bottom to top: `allocator` (slots) -> `radix` (tree of keys)
-> `planner` (reuse, work, usage) -> `kv_cache` (admit / release) ->
`simulator` (the same without a model). `ops` and `key` turn the API fields
into cache keys; `layout` expands a plan into per-token work for the engine.
"""
from akv_core.cache.key import CacheKey, build_key
from akv_core.cache.kv_cache import KVCache, KVCapacityError, Lease, PoolStats
from akv_core.cache.ops import OperationError, Operations, validate_operations
from akv_core.cache.planner import Plan
from akv_core.cache.usage import Usage

__all__ = ["CacheKey", "KVCache", "KVCapacityError", "Lease", "OperationError", "Operations", "Plan",
           "PoolStats", "Usage", "build_key", "validate_operations"]
