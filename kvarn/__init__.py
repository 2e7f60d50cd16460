"""KVarN: the quantized KV cache (layout, quantizer, records, caches, attention) and its baselines."""
