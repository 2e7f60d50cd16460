"""Automatic prefix cache: salted block-hash chain over KVarN records, memory, disk and checkpoint tiers.

``apc.hashing`` (the keys), ``apc.memory_tier`` (least-recently-used leaf blocks within a byte
budget), ``apc.disk_tier`` (one verified file per block, written behind, re-indexed at start;
``apc.disk_usage``: its byte cap, shared by the processes of one directory),
``apc.blocks`` (payloads to and from file parts), ``apc.checkpoint`` (whole-row snapshot keys and
their store), ``apc.prefix_cache`` (keys, tiers and lookups over token ids and opaque payloads),
``apc.pool_tier`` (the KVarN block pool's own blocks as the memory tier) and ``apc.reuse``
(``PrefixReuse``, what the engine holds: admission hooks, rows rebuilt from hits, what a step
completed cached, snapshots; ``make_prefix_reuse`` builds it); ``apc.events`` and ``apc.publisher``
tell routers what the cache holds (vLLM's KV events over ZMQ). It reads requests and plans by
their attributes, never imports the engine. Design and contract: docs/apc.md.
"""
