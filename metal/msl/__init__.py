"""The Metal Shading Language twins of the CUDA kernels (``mx.fast.metal_kernel``, Apple GPUs), with
the CUDA wrappers' signatures: the paged KVarN decode attention (``paged_decode``) and the tile
commit (``commit``), each with its Metal text in the module of its wrapper. Which of them runs is
``metal.selector``'s decision."""
