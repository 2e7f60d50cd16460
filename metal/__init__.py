"""Hand-written kernels through MLX's custom-kernel API (Metal and CUDA), each with a pure-MLX reference.

Empty until the fused KVarN kernels land; ``kvarn.attention`` runs its MLX reference path meanwhile.
"""
