"""Which kernel runs: the one registry of verdicts (``Kernels``).

Each fused kernel is decided once (the commit once per layout) at its first use: the kernel of
this device's backend (CUDA: ``metal.cuda``; an Apple GPU: ``metal.msl``) where it has the shape
and passes a self-check against its pure-MLX reference on a small random case; else the
reference, with one logged warning per kind of kernel. A verdict never changes afterwards.

    kind of kernel   key                                          verdicts
    paged_decode     ()                                           cuda-fused | metal-fused | reference
    commit           (head_dim, tile_size, key_bits, value_bits, iters)   cuda-fused | metal-fused | cpu-native | reference
    ragged_decode    ()                                           cuda-fused | reference
    rotate           ()                                           cuda-fused | reference
    cpu              ()                                           cpu-native | reference

The CPU's kernels (``metal.cpu``: KVarN's decode attention, the softmax's exp) are one verdict:
built at first use on this machine (``metal.cpu.build``), then checked against the pure-MLX
references in float32 (the self-check's arrays are its own, so it runs inside an ``mx.compile``
trace too). The engine decides it when it is made. Where no GPU backend is found, a process's
backend is then the CPU's (``cpu_backend``): their quantizer is its commit, checked per layout
against the pure-MLX quantizer (``commit_self_check``) like a GPU's fused commit, verdict
"cpu-native".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal.cpu import build
from metal.cpu.kernels import CpuKernels
from metal.paged_plan import RowLengths
from metal.records import RECORD_FIELDS
from metal.reference import reference_paged_decode_attention, reference_ragged_decode_attention

log = logging.getLogger(__name__)
SELF_CHECK_TOLERANCE = 2e-2  # max |kernel - reference| / max |reference|: float16 noise is ~1e-3
COMMIT_SELF_CHECK_CODES = 0.99  # fraction of code words equal to the reference's
COMMIT_SELF_CHECK_FACTORS = 1e-2  # max |kernel - reference| / max |reference| per factor field (float16 ~1e-3)
CPU_SELF_CHECK_TOLERANCE = 1e-4  # float32 against float32: summation order only (~1e-7 measured)
FUSED = ("cuda-fused", "metal-fused")
CPU_NATIVE = "cpu-native"
KERNEL_COMMITS = (*FUSED, CPU_NATIVE)  # commit verdicts that run one kernel, not the pure-MLX quantizer
REFERENCE = "reference"


class RotateKernel(NamedTuple):
    """The rotation kernel's entry points, with ``metal.cuda.rotate``'s signatures: ``cast(x, dtype)``
    and ``pair(x, y, dtype)``."""

    cast: Callable[..., mx.array]
    pair: Callable[..., mx.array]


class CommitKernel(NamedTuple):
    """The fused commit's two entry points, with ``metal.cuda.commit``'s signatures."""

    tiles: Callable[..., dict[str, mx.array]]
    window_tails: Callable[..., dict[str, mx.array]]


@dataclass(frozen=True)
class Backend:
    """One GPU backend's kernels (``metal.cuda``'s signatures) and which shapes each has
    (``*_supported``: keyword arguments as ``metal.cuda``'s ``is_supported``); None: no such kernel.
    ``ragged_plan`` is the ragged kernel's ``make_plan`` (its self-check runs both kinds of plan)."""

    name: str  # in warnings: "CUDA" | "Metal"
    verdict: str  # what its kernels' verdicts read: "cuda-fused" | "metal-fused"
    paged_decode: Callable[..., mx.array] | None = None
    paged_decode_supported: Callable[..., bool] | None = None
    commit: CommitKernel | None = None
    commit_supported: Callable[..., bool] | None = None
    ragged_decode: Callable[..., mx.array] | None = None
    ragged_decode_supported: Callable[..., bool] | None = None
    ragged_plan: Callable | None = None
    rotate: RotateKernel | None = None


def cpu_backend(kernels: CpuKernels) -> Backend:
    """The CPU's kernels as a backend: their quantizer is the commit, checked as a GPU's fused one
    (their decode attention is planned as arrays, asked for through ``Kernels.cpu``)."""
    return Backend("CPU", CPU_NATIVE, commit=CommitKernel(kernels.quantize_tiles, kernels.quantize_window_tails),
                   commit_supported=kernels.quantizes)


def cuda_backend() -> Backend:
    from metal.cuda import commit, paged_decode, ragged_decode, rotate
    return Backend("CUDA", "cuda-fused", paged_decode.paged_decode_attention, paged_decode.is_supported,
                   CommitKernel(commit.quantize_tiles, commit.quantize_window_tails), commit.is_supported,
                   ragged_decode.ragged_decode_attention, ragged_decode.is_supported, ragged_decode.make_plan,
                   RotateKernel(rotate.rotate_cast, rotate.rotate_pair))


def metal_backend() -> Backend:
    from metal.msl import commit, paged_decode
    return Backend("Metal", "metal-fused", paged_decode.paged_decode_attention, paged_decode.is_supported,
                   CommitKernel(commit.quantize_tiles, commit.quantize_window_tails), commit.is_supported)


def detect_backend() -> Backend | None:
    """The backend of the device MLX runs on: CUDA, else an Apple GPU, else None (no fused kernels)."""
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return cuda_backend()
    if hasattr(mx, "metal") and mx.metal.is_available():
        return metal_backend()
    return None


@dataclass(frozen=True)
class Decision:
    path: str  # "cuda-fused" | "metal-fused" | "reference"
    warned: bool  # this decision logged its kind's one warning


class Kernels:
    """The verdicts of one process (or of one test): one dict from (kind of kernel, *key) to its
    ``Decision``, each made once, at first use, on the thread that runs the kernels. ``backend``:
    "auto" (detected at the first decision; on the CPU, its kernels), a ``Backend``, or None (every
    verdict the reference).
    The ``decided_*`` readers never decide, so other threads may ask them."""

    def __init__(self, backend: Backend | None | str = "auto"):
        self._backend_arg = backend
        self._decisions: dict[tuple, Decision] = {}
        self._cpu: CpuKernels | None = None
        self._pinned_rotate: str | None = None

    @cached_property
    def backend(self) -> Backend | None:
        if self._backend_arg != "auto":
            return self._backend_arg
        gpu = detect_backend()
        if gpu is not None:
            return gpu
        kernels = self.cpu()  # on the CPU: its kernels, once built and checked
        return cpu_backend(kernels) if kernels is not None else None

    def _settle(self, key: tuple, path: str, warning: tuple | None) -> str:
        """Record ``path`` for ``key``; log ``warning`` (a logging format and its arguments) only if
        no decision of the same kind warned before."""
        warned = warning is not None and not any(d.warned for k, d in self._decisions.items() if k[0] == key[0])
        if warned:
            log.warning(*warning)
        self._decisions[key] = Decision(path, warned)
        return path

    def _decided(self, kind: str) -> str | None:
        return next((d.path for k, d in self._decisions.items() if k[0] == kind), None)

    # ---- the paged KVarN decode attention ----
    def attention_path(self) -> str:
        """The KVarN decode attention in force: "cuda-fused" | "metal-fused" | "reference"."""
        key = ("paged_decode",)
        if key not in self._decisions:
            self._settle(key, *self._decide_attention())
        return self._decisions[key].path

    def _decide_attention(self) -> tuple[str, tuple | None]:
        b = self.backend
        if b is not None and b.verdict == CPU_NATIVE:  # the CPU: its C++ decode kernel is ``cpu``'s to decide
            return REFERENCE, None
        if b is None or b.paged_decode is None:
            return REFERENCE, ("kvarn: no GPU backend with a fused decode kernel; KVarN decode runs the pure-MLX "
                               "reference path",)
        try:
            err = paged_decode_self_check(b.paged_decode)
        except Exception as exc:  # a compile or launch failure: the reference still works
            return REFERENCE, ("kvarn: the fused %s decode kernel failed its self-check (%s); running the reference "
                               "path", b.name, exc)
        if not err <= SELF_CHECK_TOLERANCE:
            return REFERENCE, ("kvarn: the fused %s decode kernel is off its reference by %.3g (max relative); "
                               "running the reference path", b.name, err)
        return b.verdict, None

    def paged_decode(self, *, head_dim: int, tile_size: int, key_bits: int, value_bits: int,
                     n_rep: int) -> Callable[..., mx.array] | None:
        """The fused paged decode attention (``metal.cuda.paged_decode.paged_decode_attention``'s
        signature) where the verdict is fused and the kernel has this shape; else None: the
        caller runs its reference path. Decides the verdict at the first call."""
        if self.attention_path() not in FUSED:
            return None
        b = self.backend
        shape = dict(head_dim=head_dim, tile_size=tile_size, key_bits=key_bits, value_bits=value_bits, n_rep=n_rep)
        return b.paged_decode if b.paged_decode_supported(**shape) else None

    def decided_attention_path(self) -> str | None:
        return self._decided("paged_decode")

    def pin_attention_path(self, path: str) -> None:
        """Fix the decode attention's verdict without a self-check: "reference", or this backend's
        fused verdict (to compare both paths through the engine in one process). ValueError for a
        verdict this backend cannot give."""
        b = self.backend
        allowed = {REFERENCE} | ({b.verdict} if b is not None and b.paged_decode is not None else set())
        if path not in allowed:
            raise ValueError(f"attention path {path!r}: this backend gives one of {sorted(allowed)}")
        self._decisions[("paged_decode",)] = Decision(path, False)

    # ---- the tile commit ----
    def commit_path(self, *, reference: Callable[..., dict[str, mx.array]], head_dim: int = 128,
                    tile_size: int = 128, key_bits: int = 4, value_bits: int = 2, iters: int = 8) -> str:
        """The KVarN tile commit in force for this layout. ``reference``: the pure-MLX quantizer the
        kernel must match (``metal`` imports nothing of ``kvarn``), called as ``reference(keys=,
        values=, key_bits=, value_bits=, iters=)`` like ``metal.cuda.commit.quantize_tiles`` and
        returning the same record fields; not called where no backend has the kernel. One warning
        a process, whatever the number of layouts that fall back."""
        layout = (head_dim, tile_size, key_bits, value_bits, iters)
        key = ("commit", *layout)
        if key not in self._decisions:
            self._settle(key, *self._decide_commit(reference, *layout))
        return self._decisions[key].path

    def _decide_commit(self, reference, head_dim, tile_size, key_bits, value_bits, iters) -> tuple[str, tuple | None]:
        b = self.backend
        if b is None or b.commit is None:
            return REFERENCE, ("kvarn: no GPU backend with a fused commit kernel; KVarN commits run the pure-MLX "
                               "quantizer",)
        if not b.commit_supported(head_dim=head_dim, tile_size=tile_size, key_bits=key_bits, value_bits=value_bits):
            return REFERENCE, ("kvarn: no fused %s commit kernel for head_dim %d, tile %d, k%dv%d; commits run the "
                               "pure-MLX quantizer", b.name, head_dim, tile_size, key_bits, value_bits)
        try:
            same, worst = commit_self_check(reference, b.commit, head_dim=head_dim, tile_size=tile_size,
                                            key_bits=key_bits, value_bits=value_bits, iters=iters)
        except Exception as exc:  # a compile or launch failure: the reference still works
            return REFERENCE, ("kvarn: the fused %s commit kernel failed its self-check (%s); commits run the "
                               "pure-MLX quantizer", b.name, exc)
        if not (same >= COMMIT_SELF_CHECK_CODES and worst <= COMMIT_SELF_CHECK_FACTORS):
            return REFERENCE, ("kvarn: the fused %s commit kernel is off its reference (%.4f of code words equal, "
                               "factors off by %.3g); commits run the pure-MLX quantizer", b.name, same, worst)
        return b.verdict, None

    def commit(self, *, reference: Callable[..., dict[str, mx.array]], head_dim: int, tile_size: int,
               key_bits: int, value_bits: int, iters: int) -> CommitKernel | None:
        """The fused commit for this layout where its verdict (``commit_path``) is fused, else None:
        the caller runs ``reference``'s quantizer."""
        path = self.commit_path(reference=reference, head_dim=head_dim, tile_size=tile_size, key_bits=key_bits,
                                value_bits=value_bits, iters=iters)
        return self.backend.commit if path in KERNEL_COMMITS else None

    def decided_commit_path(self) -> str | None:
        """The first verdict ``commit_path`` reached, else None."""
        return self._decided("commit")

    # ---- the fp16 baseline's ragged decode attention ----
    def ragged_decode_path(self) -> str:
        """The fp16 baseline's ragged decode attention in force: "cuda-fused" | "reference"; never
        raises (a verdict must come back whatever happened)."""
        key = ("ragged_decode",)
        if key not in self._decisions:
            try:
                decision = self._decide_ragged()
            except Exception as exc:  # noqa: BLE001
                decision = REFERENCE, ("kvarn: deciding the ragged decode path failed (%s); running the reference "
                                       "path", exc)
            self._settle(key, *decision)
        return self._decisions[key].path

    def _decide_ragged(self) -> tuple[str, tuple | None]:
        b = self.backend
        if b is None or b.ragged_decode is None:
            return REFERENCE, ("kvarn: no CUDA backend with the fused ragged decode kernel; the fp16 baseline's "
                               "batched decode runs the pure-MLX reference path",)
        try:
            err = ragged_decode_self_check(b.ragged_decode, b.ragged_plan)
        except Exception as exc:  # a compile or launch failure: the reference still works
            return REFERENCE, ("kvarn: the fused %s ragged decode kernel failed its self-check (%s); running the "
                               "reference path", b.name, exc)
        if not err <= SELF_CHECK_TOLERANCE:
            return REFERENCE, ("kvarn: the fused %s ragged decode kernel is off its reference by %.3g (max "
                               "relative); running the reference path", b.name, err)
        return b.verdict, None

    def ragged_decode(self, *, head_dim: int, n_rep: int, dtype: mx.Dtype,
                      kv_dtype: mx.Dtype) -> Callable[..., mx.array] | None:
        """The fused ragged decode attention (``metal.cuda.ragged_decode.ragged_decode_attention``'s
        signature) where this backend has it for the shape and its verdict is fused, else None.
        Where the backend has no such kernel nothing is decided (an fp16 server off CUDA reports
        no verdict)."""
        b = self.backend
        if b is None or b.ragged_decode is None or not b.ragged_decode_supported(
                head_dim=head_dim, n_rep=n_rep, dtype=dtype, kv_dtype=kv_dtype):
            return None
        return b.ragged_decode if self.ragged_decode_path() in FUSED else None

    def decided_ragged_decode_path(self) -> str | None:
        return self._decided("ragged_decode")

    # ---- KVarN's rotation (GPU) ----
    def rotate(self, x_dtype: mx.Dtype, dtype: mx.Dtype, width: int) -> RotateKernel | None:
        """The rotation kernel (``metal.cuda.rotate``: one launch for a cast, the transform and a
        cast, MLX's bits) for inputs of ``x_dtype`` rotated in slices of ``width`` and rounded to
        ``dtype``, where this backend has it and it gives MLX's bits here for that combination
        (``rotate_mismatch_cuda``, checked at its first use: each combination is its own compiled
        kernel); else None: the caller runs MLX's operations."""
        key = ("rotate", x_dtype, dtype, width)
        if key not in self._decisions and self._pinned_rotate is not None:
            self._decisions[key] = Decision(self._pinned_rotate, False)
        if key not in self._decisions:
            b = self.backend
            if b is None or b.rotate is None:
                decision = REFERENCE, None  # nothing to warn about: MLX's operations are the rotation
            else:
                try:
                    ok = rotate_mismatch_cuda(b.rotate, x_dtype, dtype, width) == 0.0
                    decision = (b.verdict, None) if ok else (REFERENCE, (
                        "kvarn: the %s rotation kernel is off MLX's bits; rotations run MLX's operations", b.name))
                except Exception as exc:  # noqa: BLE001 (a kernel that raises is not used)
                    decision = REFERENCE, ("kvarn: the %s rotation kernel failed its self-check (%s); rotations run "
                                           "MLX's operations", b.name, exc)
            self._settle(key, *decision)
        return self.backend.rotate if self._decisions[key].path in FUSED else None

    def decided_rotate_path(self) -> str | None:
        """The first verdict ``rotate`` reached (any combination), else None."""
        return self._decided("rotate")

    def pin_rotate_path(self, path: str) -> None:
        """Fix every rotation verdict without a self-check: "reference" (MLX's operations), or this
        backend's fused verdict where it has the kernel (benchmarks compare both). ValueError else."""
        b = self.backend
        allowed = {REFERENCE} | ({b.verdict} if b is not None and b.rotate is not None else set())
        if path not in allowed:
            raise ValueError(f"rotation path {path!r}: this backend gives one of {sorted(allowed)}")
        self._pinned_rotate = path

    # ---- the CPU's kernels ----
    def cpu(self) -> CpuKernels | None:
        """KVarN's CPU kernels (``metal.cpu.kernels.CpuKernels``) where MLX runs on the CPU and
        they built and passed their self-check; else None (the pure-MLX paths run; always with
        ``backend=None``: no kernels at all). Decides the verdict at the first call."""
        if mx.default_device() != mx.cpu or self._backend_arg is None:
            return None
        key = ("cpu",)
        if key not in self._decisions:
            kernels, decision = self._decide_cpu()
            self._settle(key, *decision)
            self._cpu = kernels
        return self._cpu if self._decisions[key].path == CPU_NATIVE else None

    def _decide_cpu(self) -> tuple[CpuKernels | None, tuple[str, tuple | None]]:
        try:
            kernels = CpuKernels(build.load())
        except build.Unavailable as exc:
            return None, (REFERENCE, ("kvarn: no CPU kernels (%s); the CPU runs the pure-MLX paths", exc))
        try:
            err = cpu_self_check(kernels)
        except Exception as exc:  # noqa: BLE001 (a kernel that raises is not used)
            return None, (REFERENCE, ("kvarn: the CPU kernels failed their self-check (%s); the CPU runs the "
                                      "pure-MLX paths", exc))
        if not err <= CPU_SELF_CHECK_TOLERANCE:
            return None, (REFERENCE, ("kvarn: the CPU kernels are off their references by %.3g (max relative); the "
                                      "CPU runs the pure-MLX paths", err))
        return kernels, (CPU_NATIVE, None)

    def decided_cpu_path(self) -> str | None:
        return self._decided("cpu")

    def cpu_rope(self) -> CpuKernels | None:
        """The CPU kernels where they run (``cpu``) and their rope gives ``mx.fast.rope``'s bits
        (``rope_mismatch``, checked once); else None (the model keeps MLX's rope)."""
        return self._cpu_exact("cpu_rope", rope_mismatch, "rope is off mx.fast.rope's bits; the model keeps MLX's rope")

    def cpu_swiglu(self) -> CpuKernels | None:
        """The CPU kernels where they run (``cpu``) and their SwiGLU gives MLX's bits for
        ``nn.silu(gate) * up`` (``swiglu_mismatch``, checked once); else None (the model keeps
        mlx-lm's ``swiglu``)."""
        return self._cpu_exact("cpu_swiglu", swiglu_mismatch,
                               "SwiGLU is off MLX's bits; the model keeps mlx-lm's swiglu")

    def _cpu_exact(self, name: str, mismatch: Callable[[CpuKernels], float], off: str) -> CpuKernels | None:
        """The CPU kernels where they run and ``mismatch`` finds one of their model operations on
        MLX's bits (checked once, decided under ``name``); else None, with one warning."""
        kernels = self.cpu()
        if kernels is None:
            return None
        key = (name,)
        if key not in self._decisions:
            ok = mismatch(kernels) == 0.0
            self._settle(key, CPU_NATIVE if ok else REFERENCE, None if ok else ("kvarn: the CPU kernels' %s", off))
        return kernels if self._decisions[key].path == CPU_NATIVE else None


# ---- the self-checks: each kernel against its reference on a small random case ----
def _max_rel_error(out: mx.array, ref: mx.array) -> float:
    out, ref = out.astype(mx.float32), ref.astype(mx.float32)
    return (mx.max(mx.abs(out - ref)) / mx.max(mx.abs(ref))).item()


def paged_decode_self_check(kernel: Callable[..., mx.array], dtype: mx.Dtype = mx.float16) -> float:
    """``kernel`` (``paged_decode_attention``'s signature) vs the reference on a small random pool
    (records at scattered ids, ragged rows), queries and windows in ``dtype``: the max relative error."""
    H, NR, D, G, N = 2, 4, 128, 128, 6
    ks = mx.random.split(mx.random.key(11), 12)
    records = {
        "k_codes": mx.random.randint(0, 2**31, (N, H, 1, D, G * 4 // 32), key=ks[0]).astype(mx.uint32),
        "v_codes": mx.random.randint(0, 2**31, (N, H, G, D * 2 // 32), key=ks[1]).astype(mx.uint32)}
    for i, (name, shape) in enumerate([("k_alpha", (N, H, 1, D)), ("k_beta", (N, H, 1, D)), ("k_r", (N, H, 1, G)),
                                       ("v_alpha", (N, H, G, 1)), ("v_beta", (N, H, G, 1)), ("v_c", (N, H, D))]):
        records[name] = (mx.random.uniform(0.05, 0.3, shape, key=ks[2 + i])).astype(mx.float16)
    win_k = mx.random.normal((4, H, 2 * G, D), key=ks[8]).astype(dtype)
    win_v = mx.random.normal((4, H, 2 * G, D), key=ks[9]).astype(dtype)
    queries = mx.random.normal((3, H * NR, 1, D), key=ks[10]).astype(dtype)
    table = mx.array([[3, 1, 5], [0, 0, 0], [2, 0, 0]], dtype=mx.int32)
    lengths = RowLengths(slots=(2, 1, 3), sink_len=(G, 7, G), tail_len=(5, 0, 0), num_tiles=(3, 0, 1))
    kw = dict(queries=queries, records={n: records[n] for n in RECORD_FIELDS}, win_k=win_k, win_v=win_v,
              table=table, lengths=lengths, scale=D ** -0.5, key_bits=4, value_bits=2)
    return _max_rel_error(kernel(**kw), reference_paged_decode_attention(**kw))


def cpu_self_check(kernels: CpuKernels) -> float:
    """The CPU kernels against their references in float32: the decode attention on
    ``paged_decode_self_check``'s pool (float32 queries), the rotation bit for bit
    (``rotate_mismatch``), the softmax's exp on random scores (masked ones too) against ``exp``:
    the larger max relative error."""
    err = paged_decode_self_check(lambda **kw: kernels.paged_decode_attention(**kw), dtype=mx.float32)
    err = max(err, rotate_mismatch(kernels))
    scores = mx.random.normal((3, 5, 300), key=mx.random.key(5)) * 6
    scores = mx.where(mx.arange(300) % 7 == 3, -mx.inf, scores)
    weights, sums, _ = kernels.exp_rows(scores)
    want = mx.exp(scores - mx.max(scores, axis=-1, keepdims=True))
    err = max(err, _max_rel_error(weights, want), _max_rel_error(sums, mx.sum(want, axis=-1, keepdims=True)))
    return max(err, masked_exp_mismatch(kernels))


def masked_exp_mismatch(kernels: CpuKernels) -> float:
    """0.0 where the kernels' softmax parts with the mask added in their pass (and a floor under
    each row's top) give the bits of the mask added by MLX first, else infinity."""
    k1, k2, k3 = mx.random.split(mx.random.key(17), 3)
    scores = mx.random.normal((2, 3, 5, 300), key=k1) * 6
    mask = mx.where(mx.random.uniform(shape=(5, 300), key=k2) < 0.3, -mx.inf, 0.0)
    floor = mx.where(mx.arange(30).reshape(2, 3, 5, 1) % 4 == 1, 9.0, -mx.inf) + mx.random.normal((2, 3, 5, 1), key=k3)
    x = scores + mask
    top = mx.maximum(mx.max(x, axis=-1, keepdims=True), floor)
    got = kernels.exp_rows(scores, mask=mask, floor=floor)
    want = kernels.exp_rows(x, top)
    same = all(mx.array_equal(a, b).item() for a, b in zip(got, (*want[:2], top)))
    return 0.0 if same else float("inf")


def rotate_mismatch(kernels: CpuKernels) -> float:
    """0.0 where the kernels' rotation gives ``mx.hadamard_transform``'s bits over each slice of
    random rows (widths 128 and 64, several slices a row; row-contiguous and a transposed view),
    and rounded to float16 those of MLX's conversions after it (values past float16's range
    too), else infinity: the windows and records must not depend on which of the two rotated them."""
    x = mx.random.normal((3, 5, 256), key=mx.random.key(11)) * mx.linspace(0.1, 30.0, 256)
    x = mx.concatenate([x, x[:1] * 3000.0])  # past float16's range once rotated
    for width in (128, 64):
        for view in (x, x.transpose(1, 0, 2)):  # row-contiguous, and read in place as a model's keys are
            want = mx.hadamard_transform(view.reshape(*view.shape[:2], 256 // width, width)).reshape(view.shape)
            if not mx.array_equal(kernels.rotate(view, width), want).item():
                return float("inf")
            if not mx.array_equal(kernels.rotate(view, width, half=True), want.astype(mx.float16).astype(mx.float32)).item():
                return float("inf")
    return 0.0


def rotate_mismatch_cuda(kernel: RotateKernel | None = None, x_dtype: mx.Dtype = mx.bfloat16,
                         dtype: mx.Dtype = mx.float16, width: int = 128) -> float:
    """0.0 where the rotation kernel (``metal.cuda.rotate``'s by default) gives the bits of MLX's
    ``hadamard_transform`` in float32 and its casts for inputs of ``x_dtype`` rotated in slices of
    ``width`` and rounded to ``dtype`` (a head of two slices where ``width`` is 128; a transposed
    view, as a model's keys are; a pair; values past float16's range), else infinity: windows and
    records must not depend on which one rotated."""
    if kernel is None:
        from metal.cuda import rotate
        kernel = RotateKernel(rotate.rotate_cast, rotate.rotate_pair)

    def want(x: mx.array) -> mx.array:
        f = x.astype(mx.float32)
        return mx.hadamard_transform(f.reshape(*f.shape[:-1], f.shape[-1] // width, width)).reshape(f.shape).astype(dtype)

    D = 2 * width if width == 128 else width
    k1, k2 = mx.random.split(mx.random.key(31))
    base = mx.random.normal((2, 5, 4, D), key=k1) * mx.linspace(0.1, 30.0, D)
    base = mx.concatenate([base, base[:1] * 3000.0])  # past float16's range once rotated
    x = base.transpose(0, 2, 1, 3).astype(x_dtype)  # a view, as a model's keys
    y = mx.random.normal((3, 4, 5, D), key=k2).astype(x_dtype)
    same = mx.array_equal(kernel.cast(x, dtype), want(x), equal_nan=True).item() and mx.array_equal(
        kernel.pair(x, y, dtype), want(mx.concatenate([x, y])), equal_nan=True).item()
    return 0.0 if same else float("inf")


def rope_mismatch(kernels: CpuKernels) -> float:
    """0.0 where the kernels' rope gives ``mx.fast.rope``'s bits (queries as the model passes them,
    a transposed view; one offset and one a row; a prompt chunk and a decode token; all channels
    and a part), else infinity: a model's logits must not depend on which of the two ran."""
    for B, T, N, D, dims, base in ((3, 1, 4, 128, 128, 10000.0), (2, 37, 3, 64, 32, 500000.0)):
        x = mx.random.normal((B, T, N, D), key=mx.random.key(13)) * 4
        x = x.transpose(0, 2, 1, 3)
        for offset in (mx.array(4093, dtype=mx.int32), mx.array([0, 130, 70001][:B], dtype=mx.int32)):
            want = mx.fast.rope(x, dims, traditional=False, base=base, scale=0.5 if T > 1 else 1.0, offset=offset)
            got = kernels.rope(x, offset, dims=dims, base=base, scale=0.5 if T > 1 else 1.0)
            if not mx.array_equal(got, want).item():
                return float("inf")
    return 0.0


def swiglu_mismatch(kernels: CpuKernels) -> float:
    """0.0 where the kernels' SwiGLU gives the bits of MLX's ``nn.silu(gate) * up`` (a decode
    row and a prompt chunk; gates over exp's whole range and past it both ways, NaN and infinities;
    a transposed view), else infinity: a model's logits must not depend on which of the two ran."""
    special = mx.array([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.0, -88.0, 88.5, -89.0, 1e-30])
    for shape, spread in (((3, 1536), 8.0), ((2, 37, 512), 120.0)):
        k1, k2 = mx.random.split(mx.random.key(29))
        gate = mx.random.normal(shape, key=k1) * spread
        gate = mx.concatenate([special, gate.reshape(-1)[special.size:]]).reshape(shape)
        up = mx.random.normal(shape, key=k2)
        for g, u in ((gate, up), (gate.swapaxes(-1, -2), up.swapaxes(-1, -2))):
            want = nn.silu(g) * u
            if not mx.array_equal(kernels.swiglu(g, u), want, equal_nan=True).item():
                return float("inf")
    return 0.0


def commit_self_check(reference: Callable[..., dict[str, mx.array]], kernel: CommitKernel, *, head_dim: int,
                      tile_size: int, key_bits: int, value_bits: int, iters: int) -> tuple[float, float]:
    """``kernel`` against ``reference`` on two random tiles of two heads (keys with uneven
    channels), given as tiles and as the tails of windows 2 and 0 of three-window buffers:
    (fraction of equal code words, worst relative factor difference; the worse of the two)."""
    k1, k2, k3 = mx.random.split(mx.random.key(17), 3)
    shape = (2, 2, tile_size, head_dim)
    keys = (mx.random.normal(shape, key=k1) * mx.linspace(0.2, 3.0, head_dim)).astype(mx.float16)
    values = mx.random.normal(shape, key=k2).astype(mx.float16)
    kw = dict(keys=keys, values=values, key_bits=key_bits, value_bits=value_bits, iters=iters)
    want = reference(**kw)
    noise = mx.random.normal((3, 2, 2 * tile_size, head_dim), key=k3).astype(mx.float16)
    win_k, win_v = mx.array(noise), mx.array(noise)
    slots = mx.array([2, 0], dtype=mx.int32)
    win_k[slots, :, tile_size:], win_v[slots, :, tile_size:] = keys, values
    same, worst = 1.0, 0.0
    for got in (kernel.tiles(**kw), kernel.window_tails(win_k=win_k, win_v=win_v, slots=slots, key_bits=key_bits,
                                                        value_bits=value_bits, iters=iters)):
        same, worst = _compare_records(got, want, same, worst)
    return same, worst


def _compare_records(got: dict, want: dict, same: float, worst: float) -> tuple[float, float]:
    for name, g in got.items():
        a, b = np.array(g), np.array(want[name])
        if a.shape != b.shape:
            return 0.0, float("inf")
        if name.endswith("codes"):
            same = min(same, float((a == b).mean()))
        else:
            a, b = a.astype(np.float32), b.astype(np.float32)
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    return same, worst


def ragged_decode_self_check(kernel: Callable[..., mx.array], make_plan: Callable) -> float:
    """``kernel`` (``ragged_decode_attention``'s signature) vs the reference on a small random
    ragged batch (scattered slots, garbage past the rows' lengths, bfloat16 queries over float16
    K/V), with rows split (the combine launch) and with one item a row (the FINAL launch), the
    plans made by ``make_plan``: the worse max relative error."""
    ks = mx.random.split(mx.random.key(23), 3)
    H, NR, D, N, T_cap = 2, 4, 128, 6, 1100
    lengths, slots = (1, 300, 1000, 77), (4, 0, 2, 5)
    keys = mx.random.normal((N, H, T_cap, D), key=ks[0]).astype(mx.float16)
    values = mx.random.normal((N, H, T_cap, D), key=ks[1]).astype(mx.float16)
    queries = mx.random.normal((len(lengths), H * NR, 1, D), key=ks[2]).astype(mx.bfloat16)
    kw = dict(queries=queries, keys=keys, values=values, slots=slots, lengths=lengths, scale=D ** -0.5)
    ref = reference_ragged_decode_attention(**kw)
    return max(_max_rel_error(kernel(**kw, plan=make_plan(slots, lengths, H, single=single)), ref)
               for single in (False, True))
