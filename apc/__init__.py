"""Automatic prefix cache: salted block-hash chain over KVarN records, memory, disk and checkpoint tiers.

Built so far: ``apc.hashing`` (the keys) and ``apc.memory_tier`` (LRU-leaf blocks within a byte
budget); KVarN rows give and take blocks (``KVarNKVCache.blocks`` / ``from_blocks``). The tiers and the engine wiring are not built yet (their
own issue); the engine runs without prefix reuse until then.
"""
