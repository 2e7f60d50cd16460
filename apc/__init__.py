"""Automatic prefix cache: salted block-hash chain over KVarN records, memory, disk and checkpoint tiers.

Built so far: ``apc.hashing`` (the keys). The tiers and the engine wiring are not built yet (their
own issue); the engine runs without prefix reuse until then.
"""
