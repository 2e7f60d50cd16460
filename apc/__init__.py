"""Automatic prefix cache: salted block-hash chain over KVarN records, memory, disk and checkpoint tiers.

Not built yet (its own issue); the engine runs without prefix reuse until then.
"""
