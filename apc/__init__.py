"""Automatic prefix cache: salted block-hash chain over KVarN records, memory, disk and checkpoint tiers.

Built so far: ``apc.hashing`` (the keys), ``apc.memory_tier`` (least-recently-used leaf blocks
within a byte budget), ``apc.disk_tier`` (one verified file per block, written behind, re-indexed at
start) and ``apc.blocks`` (block arrays to and from file parts); KVarN rows give and take blocks
(``KVarNKVCache.blocks`` / ``from_blocks``). The checkpoint tier and the engine wiring (lookup at
admission, inserts as tiles commit, ``cached_tokens``, endpoints, flags) are not built yet (their
own issue); the engine runs without prefix reuse until then.
"""
