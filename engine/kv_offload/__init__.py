"""The KV offload tiers below the device's KV cache: which blocks they hold (tier.py, on the engine), the copies on
every rank (store.py), the disk tier's files (disk.py), and the eviction policies (policy.py)."""
from kvgate.engine.kv_offload.store import OffloadStore
from kvgate.engine.kv_offload.tier import AWAIT, CONFIRM, DELETE, FETCH, LOAD, MARK, SAVE, SPILL, OffloadStats, OffloadTier

__all__ = ["AWAIT", "CONFIRM", "DELETE", "FETCH", "LOAD", "MARK", "SAVE", "SPILL", "OffloadStats", "OffloadStore", "OffloadTier"]
