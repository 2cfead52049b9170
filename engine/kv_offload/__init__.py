"""The KV offload tier below the device's KV cache: which blocks it holds (tier.py, on the engine), the copies on
every rank (store.py), and the eviction policies (policy.py)."""
from kvgate.engine.kv_offload.store import OffloadStore
from kvgate.engine.kv_offload.tier import LOAD, SAVE, OffloadStats, OffloadTier

__all__ = ["LOAD", "SAVE", "OffloadStats", "OffloadStore", "OffloadTier"]
