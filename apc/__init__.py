"""Automatic prefix cache: salted block-hash chain over KVarN records, memory, disk and checkpoint tiers.

Built so far: ``apc.hashing`` (the keys) and ``apc.memory_tier`` (least-recently-used leaf blocks
within a byte budget); KVarN rows give and take blocks (``KVarNKVCache.blocks`` / ``from_blocks``).
The disk and checkpoint tiers and the engine wiring are not built yet (their own issue); the engine
runs without prefix reuse until then.
"""
