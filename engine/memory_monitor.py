"""MemoryMonitor(engine).get_stats(): KV-cache use, fragmentation and prefix-cache figures. Under tensor and pipeline
parallelism every rank holds the same blocks (each its slice of the KV heads, for its stage's layers): bytes are
summed over the ranks, blocks are counted once."""
from __future__ import annotations

from typing import Any

from kvgate.engine.sequence import SequenceStatus


class MemoryMonitor:
    def __init__(self, engine: Any) -> None:
        self.engine = engine  # an LLMEngine (or anything with .block_manager, .scheduler, .runner)

    def get_stats(self) -> dict[str, float | int]:
        bm = self.engine.block_manager
        ranks = self.engine.executor.world_size
        block_bytes = self.engine.runner.block_bytes_all_ranks
        in_use = [b for b in bm.blocks if b.ref_count > 0]
        filled: dict[int, int] = {}
        for seq in self.engine.scheduler.running:
            if seq.status != SequenceStatus.RUNNING:
                continue
            for i, bid in enumerate(seq.block_table):
                n = min(bm.block_size, max(0, seq.num_computed_tokens - i * bm.block_size))
                filled[bid] = max(filled.get(bid, 0), n)
        slots = len(in_use) * bm.block_size
        used_slots = sum(filled.get(b.block_id, 0) for b in in_use)
        cached_free = sum(1 for b in bm.blocks if b.ref_count == 0 and b.hash is not None
                          and bm.cached.get(b.hash) == b.block_id)
        return {
            "allocated": len(in_use) * block_bytes / 2**30,  # GiB held by live sequences
            "capacity": bm.num_blocks * block_bytes / 2**30,  # over all ranks
            "tensor_parallel_size": ranks,
            "fragmentation": 1.0 - used_slots / slots if slots else 0.0,
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_blocks,
            "used_blocks": len(in_use),
            "cached_free_blocks": cached_free,
            "block_size": bm.block_size,
            "usage": len(in_use) / bm.num_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "num_preemptions": self.engine.scheduler.num_preemptions,
            **_offload_stats(bm.offload),
        }


def _offload_stats(tier: Any) -> dict[str, float | int]:
    """The offload tiers (engine/kv_offload/), CPU and disk: each one's size and use in GiB (all ranks), blocks, and
    hit rate (prompt tokens found there, of those looked up there); zeros for a tier that is off."""
    out: dict[str, float | int] = {}
    for name in ("cpu", "disk"):
        out.update({f"offload_{name}_capacity": 0.0, f"offload_{name}_used": 0.0, f"offload_{name}_blocks": 0,
                    f"offload_{name}_hit_rate": 0.0})
    if tier is None:
        return out
    st, gib = tier.stats, tier.block_bytes / 2**30
    out.update(offload_cpu_capacity=tier.num_slots * gib, offload_cpu_used=len(tier) * gib,
               offload_cpu_blocks=len(tier), offload_cpu_hit_rate=st.hits / st.queries if st.queries else 0.0)
    if tier.disk is not None:
        out.update(offload_disk_capacity=tier.disk.capacity * gib, offload_disk_used=len(tier.disk) * gib,
                   offload_disk_blocks=len(tier.disk),
                   offload_disk_hit_rate=st.disk_hits / st.disk_queries if st.disk_queries else 0.0)
    return out
