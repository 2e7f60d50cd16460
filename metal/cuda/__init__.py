"""The CUDA kernels (``mx.fast.cuda_kernel``), each one's CUDA text in the module of its wrapper:
the paged KVarN decode attention (``paged_decode``: a tensor-core body,
``paged_decode_mma``, and a scalar one), the tile commit (``commit``) and the fp16 baseline's
ragged decode attention (``ragged_decode``). Which of them runs is ``metal.selector``'s decision."""
