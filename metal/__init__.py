"""Hand-written kernels, by backend, each with a pure-MLX reference: through MLX's custom-kernel API
(GPUs), or as MLX primitives of an extension (the CPU).

    metal/cuda/     the CUDA kernels (mx.fast.cuda_kernel), one wrapper module each: paged_decode (a
                    tensor-core body and a scalar one), commit, ragged_decode; their CUDA text in src/
    metal/msl/      their Metal Shading Language twins (mx.fast.metal_kernel): paged_decode, commit;
                    their Metal text in src/
    metal/cpu/      the CPU's kernels: MLX primitives in C++ (src/kvarn_cpu.cpp: KVarN's decode
                    attention over the records' codes in place, the softmax's exp), built as an MLX
                    extension at first use on the machine (build.py); kernels.py: their Python faces
    sources.py      the loader of the kernels' source files (package data)
    paged_plan.py   the paged decode's split plan (RowLengths, DecodePlan), shared by both backends
    reference.py    the pure-MLX twins of the decode kernels
    records.py      the record fields and their block-major shapes; launch.py: minify, constant inputs
    device.py       the GPU's multiprocessor count, asked of the CUDA driver (the split plans' target)
    selector.py     which kernel runs: ``Kernels``, the one registry of verdicts
    self_checks.py  the checks it runs before it trusts a kernel (against each kernel's reference)

Which kernel runs is decided by ``KERNELS``, this process's ``metal.selector.Kernels``: each fused
kernel once (the commit once per layout), at first use, by a self-check against its reference on
a small random case; a failed or missing kernel gives the reference with one logged warning.
Callers ask it for what they run (``KERNELS.paged_decode(...)``, ``KERNELS.commit(...)``,
``KERNELS.ragged_decode(...)``: the kernel, or None for their reference path); ``/health`` reads
``KERNELS.decided_attention_path()`` and ``KERNELS.decided_ragged_decode_path()``, which never
decide. Tests make their own ``Kernels(backend=...)``.

The Metal twins were written and tested without an Apple GPU: their Metal text is run on Linux
CPUs by a g++ emulator (``tests/metal/metal_emulator.py``) and has never been compiled by Apple's
Metal compiler here. On an Apple GPU the self-checks are what compiles and checks them before
use (docs/kernels.md, "Metal twins").
"""

from __future__ import annotations

from metal.selector import Kernels

KERNELS = Kernels()

__all__ = ["KERNELS", "Kernels"]
