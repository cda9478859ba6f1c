"""Caches: per-layer specs, the plan and allocator, the block pool, a manager per spec kind, the coordinator."""
