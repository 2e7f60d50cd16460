"""Automatic prefix cache: salted block-hash chain over KVarN records, memory, disk and checkpoint tiers.

``apc.hashing`` (the keys), ``apc.memory_tier`` (least-recently-used leaf blocks within a byte
budget), ``apc.disk_tier`` (one verified file per block, written behind, re-indexed at start),
``apc.blocks`` (payloads to and from file parts), ``apc.checkpoint`` (whole-row snapshot keys and
their store) and ``apc.prefix_cache`` (the facade the engine uses). It sees token ids and opaque
payloads, never requests: the engine side (what a block holds, when it is cached, how a row is
rebuilt) is ``engine/prefix.py``. Design and contract: docs/apc.md.
"""
