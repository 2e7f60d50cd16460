"""The CUDA kernels (``mx.fast.cuda_kernel``), one wrapper module each: the paged KVarN decode
attention (``paged_decode``: a tensor-core body and a scalar one), the tile commit (``commit``) and
the fp16 baseline's ragged decode attention (``ragged_decode``). Their CUDA text is in ``src/``
(``.cuh`` headers, ``.cu`` bodies), read at import through ``metal.sources``. Which of them runs is
``metal.selector``'s decision."""
