"""KVarN's CPU kernels: MLX primitives written in C++ (``src/kvarn_cpu.cpp``), built as an MLX
extension at their first use on this machine (``metal.cpu.build``) and run inside MLX's graphs,
compiled ones too. Which of them runs is ``metal.selector``'s decision (a self-check against the
pure-MLX path first)."""
