"""Automatic prefix cache: salted block-hash chain over KVarN records, memory, disk and checkpoint tiers.

Built so far: ``apc.hashing`` (the keys), ``apc.memory_tier`` (least-recently-used leaf blocks
within a byte budget), ``apc.disk_tier`` (one verified file per block, written behind, re-indexed at
start), ``apc.blocks`` (block arrays to and from file parts) and ``apc.checkpoint`` (whole-row
snapshot keys and their memory store); KVarN rows give and take blocks (``KVarNKVCache.blocks`` /
``from_blocks``). The engine wiring (lookup at admission, inserts as tiles commit, snapshots of
non-tileable caches, ``cached_tokens``, endpoints, flags) is not built yet (its own issue); the
engine runs without prefix reuse until then.
"""
