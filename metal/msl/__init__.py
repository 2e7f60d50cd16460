"""The Metal Shading Language twins of the CUDA kernels (``mx.fast.metal_kernel``, Apple GPUs), with
the CUDA wrappers' signatures: the paged KVarN decode attention (``paged_decode``) and the tile
commit (``commit``). Their Metal text is in ``src/`` (``.h`` headers, ``.metal`` bodies), read at
import through ``metal.sources``. Which of them runs is ``metal.selector``'s decision."""
