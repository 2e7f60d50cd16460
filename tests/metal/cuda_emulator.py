"""Runs an ``mx.fast.cuda_kernel`` body on the CPU: the body is wrapped the way MLX wraps it (one
``const T*`` parameter per input, ``T*`` per output, template arguments as constexprs), compiled
with g++ against a small shim and launched block after block:

- the shim's state is private to each built library (``static``; g++'s ``-fno-gnu-unique``: no
  global shared with another emulator's library loaded in the same process);
- every CUDA thread of a block is a fiber (its own stack, ``threadIdx`` its own) of one OS thread,
  blocks one after the other; a barrier parks a fiber until every thread of its group has arrived
  (a barrier some thread never reaches is reported as divergent instead of hanging); between two
  barriers the fibers run one after another in ``threadIdx`` order;
- ``__syncthreads`` is a barrier over the block; ``__syncwarp``, ``__shfl_xor_sync`` and
  ``__shfl_sync`` (each lane posts its value, a barrier, reads its source lane's, a barrier) and
  ``kv_mma`` are barriers over the 32 threads of a warp (the masks are not read: full warps);
- ``__half`` is ``_Float16``; blocks have at most 1,024 threads.

It checks the kernels' indexing, bit extraction and reductions where no GPU is present; it says
nothing about speed, and nothing about what the shim does not model (memory ordering beyond
barriers, races between threads that no barrier separates, warp-synchronous code without
shuffles: the kernels here have none).

The tensor-core body's device primitives (``KV_EMU`` replaces them) are modelled here: ``kv_mma``
is ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` as PTX's ISA lays out its fragments
(each lane posts its A, B and C registers to a per-warp buffer, a warp barrier, each lane computes
its four D elements in float32, a barrier); ``cp.async`` is a plain 16-byte copy (its waits are
no-ops: the copies are done when issued); ``__byte_perm`` selects bytes as PRMT does (the
selector's sign-replicate bit is not modelled: the kernels do not set it); half2 arithmetic
rounds once to _Float16. ``__ldg`` is a plain load, ``__uint_as_float`` a bit copy."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import numpy as np

SHIM = r"""
#include <cstdint>
#include <cstddef>
#include <cmath>
#include <cstring>
#include <csetjmp>
#include <ucontext.h>
#include <sys/mman.h>
// The threads of a block are fibers of one OS thread (ucontext stacks, switched by _setjmp /
// _longjmp): a barrier parks the fiber and the scheduler resumes the others; a fiber parked at a
// barrier runs again once every thread of its group has arrived there. A barrier that some thread
// never reaches (a divergent barrier) is reported, not hung on.
struct emu_fiber {
  jmp_buf ctx;
  ucontext_t uc;
  char* stack;
  int state;  // 0 not started, 1 ready, 2 parked, 3 done
  const int* wait;
  int wait_gen;
};
static emu_fiber* emu_f;
static int emu_cur;
static jmp_buf emu_main;
struct emu_barrier {
  explicit emu_barrier(int n) : n(n) {}
  __attribute__((noinline)) void arrive_and_wait() {
    if (++count == n) { count = 0; ++gen; return; }
    emu_fiber& f = emu_f[emu_cur];
    f.state = 2; f.wait = &gen; f.wait_gen = gen;
    if (!_setjmp(f.ctx)) _longjmp(emu_main, 1);
  }
  const int n;
  int count = 0, gen = 0;
};
#define __global__
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)
#define __shared__ static
struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 emu_tidx[1024];
#define threadIdx (emu_tidx[emu_cur])
static emu_dim3 blockIdx, gridDim, blockDim;
static emu_barrier* emu_bar;
static emu_barrier* emu_wbar[32];
static float emu_x[1024];
alignas(16) static unsigned char emu_smem[256 * 1024];
inline void __syncthreads() { emu_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int m) {
  const int t = threadIdx.x;
  emu_x[t] = v;
  emu_wbar[t >> 5]->arrive_and_wait();
  const float r = emu_x[t ^ m];
  emu_wbar[t >> 5]->arrive_and_wait();
  return r;
}
using __half = _Float16;
struct __half2 { _Float16 x, y; };
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half_rn(float f) { return (_Float16)f; }
inline float2 __half22float2(__half2 h) { return {(float)h.x, (float)h.y}; }
struct alignas(8) uint2 { unsigned x, y; };
struct __nv_bfloat16 { uint16_t v; };
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.v << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return {(uint16_t)(u >> 16)};
}
#define KV_EMU 1
inline void __syncwarp(unsigned = 0xffffffffu) { emu_wbar[threadIdx.x >> 5]->arrive_and_wait(); }
inline float __shfl_sync(unsigned, float v, int src) {
  const int t = threadIdx.x;
  emu_x[t] = v;
  emu_wbar[t >> 5]->arrive_and_wait();
  const float r = emu_x[(t & ~31) | (src & 31)];
  emu_wbar[t >> 5]->arrive_and_wait();
  return r;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline float emu_h(uint32_t u, int hi) { uint16_t v = hi ? (uint16_t)(u >> 16) : (uint16_t)(u & 0xffff); _Float16 f; std::memcpy(&f, &v, 2); return (float)f; }
inline uint32_t emu_hbits(float x) { _Float16 f = (_Float16)x; uint16_t v; std::memcpy(&v, &f, 2); return v; }
inline float kv_hf(unsigned short u) { return emu_h(u, 0); }
inline unsigned short kv_fh(float x) { return (unsigned short)emu_hbits(x); }
inline uint32_t kv_pack2(float lo, float hi) { return emu_hbits(lo) | (emu_hbits(hi) << 16); }
inline uint32_t kv_hfma2(uint32_t a, uint32_t b, uint32_t c) {
  return emu_hbits(emu_h(a, 0) * emu_h(b, 0) + emu_h(c, 0)) | (emu_hbits(emu_h(a, 1) * emu_h(b, 1) + emu_h(c, 1)) << 16);
}
inline uint32_t kv_hmul2(uint32_t a, uint32_t b) {
  return emu_hbits(emu_h(a, 0) * emu_h(b, 0)) | (emu_hbits(emu_h(a, 1) * emu_h(b, 1)) << 16);
}
inline void kv_cp16(void* dst, const void* src) { std::memcpy(dst, src, 16); }
template <class T> inline T __ldg(const T* p) { return *p; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline void kv_cp_commit() {}
template <int N> inline void kv_cp_wait() {}
static uint32_t emu_a[32][32][4], emu_b[32][32][2];
inline void kv_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
  emu_a[w][l][0] = a0; emu_a[w][l][1] = a1; emu_a[w][l][2] = a2; emu_a[w][l][3] = a3;
  emu_b[w][l][0] = b0; emu_b[w][l][1] = b1;
  emu_wbar[w]->arrive_and_wait();
  float d[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    float acc = c[e];
    for (int k = 0; k < 16; ++k) {
      // A (row-major 16x16): lane (row % 8) * 4 + (k % 8) / 2, register (row / 8) + 2 * (k / 8), half k % 2
      const float a = emu_h(emu_a[w][(row & 7) * 4 + ((k & 7) >> 1)][(row >> 3) + 2 * (k >> 3)], k & 1);
      // B (16x8, "col"): lane col * 4 + (k % 8) / 2, register k / 8, half k % 2
      const float bb = emu_h(emu_b[w][col * 4 + ((k & 7) >> 1)][k >> 3], k & 1);
      acc += a * bb;
    }
    d[e] = acc;
  }
  emu_wbar[w]->arrive_and_wait();
  for (int e = 0; e < 4; ++e) c[e] = d[e];
}
"""

CTYPES = {np.dtype(np.float16): "__half", np.dtype(np.float32): "float", np.dtype(np.int32): "int32_t",
          np.dtype(np.uint32): "uint32_t"}
BF16 = "bfloat16"
MAX_THREADS = 1024
STACK = 256 * 1024  # a fiber's stack: the kernels' frames take a few KB (g++ -fstack-usage)
# g++'s optimization: -O1 compiles faster than -O2 and runs about as fast (the compile is most of an
# emulated test's time now); -O2 would also need -fno-strict-aliasing (the kernels type-pun, e.g. a
# uint4 read as __half2, which -O2's strict aliasing miscompiles)
FLAGS = ("-O1",)


def available() -> bool:
    return shutil.which("g++") is not None


def _ctype(a) -> str:
    return "__nv_bfloat16" if isinstance(a, str) else CTYPES[np.dtype(a)]


def build(name: str, header: str, source: str, inputs: list[tuple[str, object]], outputs: list[tuple[str, object]],
          template: list[tuple[str, object]]) -> ctypes.CDLL:
    """Compile one specialization; ``inputs``/``outputs``: (name, numpy dtype or "bfloat16");
    ``template``: (name, int or numpy dtype or "bfloat16")."""
    params = []
    for n, t in inputs:  # as MLX: an input's shape and strides follow it where the body reads them
        params.append(f"const {_ctype(t)}* {n}")
        params += [f"const {c}* {n}_{what}" for what, c in (("shape", "int32_t"), ("strides", "int64_t"))
                   if f"{n}_{what}" in source]
    params += [f"{_ctype(t)}* {n}" for n, t in outputs]
    consts = "".join(f"  constexpr int {n} = {v};\n" if isinstance(v, int) else f"  using {n} = {_ctype(v)};\n"
                     for n, v in template)
    body = source.replace("extern __shared__ __align__(16) unsigned char smem_raw[];",
                          "unsigned char* smem_raw = emu_smem;")
    casts = ", ".join(f"({p.rsplit(' ', 1)[0]})args[{i}]" for i, p in enumerate(params))
    launcher = (
        "static void** emu_args;\n"
        "static void emu_entry(int t) {\n"
        "  void** args = emu_args;\n"
        f"  {name}({casts});\n"
        "  emu_f[t].state = 3;\n"
        "  _longjmp(emu_main, 1);\n"
        "}\n"
        'extern "C" int launch(void** args, int gx, int gy, int gz, int bx) {\n'
        f"  if (bx < 1 || bx > {MAX_THREADS}) return 2;\n"
        "  emu_args = args;\n"
        "  gridDim = {(unsigned)gx, (unsigned)gy, (unsigned)gz}; blockDim = {(unsigned)bx, 1, 1};\n"
        f"  const size_t stack = {STACK}, guard = 4096, span = stack + guard;\n"
        "  char* stacks = (char*)mmap(nullptr, span * bx, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);\n"
        "  if (stacks == (char*)MAP_FAILED) return 4;\n"
        "  emu_fiber* fibers = new emu_fiber[bx]; emu_f = fibers;\n"
        "  for (int t = 0; t < bx; ++t) {\n"
        "    mprotect(stacks + t * span, guard, PROT_NONE);  // a stack overflow faults, not corrupts\n"
        "    fibers[t].stack = stacks + t * span + guard; emu_tidx[t] = {(unsigned)t, 0, 0};\n"
        "  }\n"
        "  const int nw = (bx + 31) / 32;\n"
        "  int rc = 0;\n"
        "  for (int z = 0; z < gz && !rc; ++z) for (int y = 0; y < gy && !rc; ++y) for (int x = 0; x < gx && !rc; ++x) {\n"
        "    blockIdx = {(unsigned)x, (unsigned)y, (unsigned)z};\n"
        "    emu_barrier bar(bx); emu_bar = &bar;\n"
        "    emu_barrier* w[32];\n"
        "    for (int i = 0; i < nw; ++i) { w[i] = new emu_barrier(32); emu_wbar[i] = w[i]; }\n"
        "    for (int t = 0; t < bx; ++t) {\n"
        "      emu_fiber& f = fibers[t];\n"
        "      f.state = 0;\n"
        "      getcontext(&f.uc); f.uc.uc_stack.ss_sp = f.stack; f.uc.uc_stack.ss_size = stack; f.uc.uc_link = nullptr;\n"
        "      makecontext(&f.uc, (void (*)())emu_entry, 1, t);\n"
        "    }\n"
        "    int done = 0;\n"
        "    while (done < bx) {\n"
        "      bool progress = false;\n"
        "      for (int t = 0; t < bx; ++t) {\n"
        "        emu_fiber& f = fibers[t];\n"
        "        if (f.state == 3 || (f.state == 2 && *f.wait == f.wait_gen)) continue;\n"
        "        progress = true; emu_cur = t;\n"
        "        if (!_setjmp(emu_main)) {\n"
        "          if (f.state == 0) { f.state = 1; setcontext(&f.uc); }\n"
        "          f.state = 1; _longjmp(f.ctx, 1);\n"
        "        }\n"
        "        if (f.state == 3) ++done;\n"
        "      }\n"
        "      if (!progress) { rc = 3; break; }\n"
        "    }\n"
        "    for (int i = 0; i < nw; ++i) delete w[i];\n"
        "  }\n"
        "  delete[] fibers;\n"
        "  munmap(stacks, span * bx);\n"
        "  return rc;\n"
        "}\n")
    text = SHIM + header + f"\nvoid {name}(" + ", ".join(params) + ") {\n" + consts + body + "\n}\n" + launcher
    digest = hashlib.sha1((text + " ".join(FLAGS)).encode()).hexdigest()[:16]
    out_dir = Path(tempfile.gettempdir()) / "kvarn-cuda-emulator"
    out_dir.mkdir(exist_ok=True)
    lib = out_dir / f"{name}-{digest}.so"
    if not lib.exists():
        unique = f"{os.getpid()}-{uuid.uuid4().hex}"  # test workers may build the same text at once
        src = out_dir / f"{name}-{digest}.{unique}.cpp"
        src.write_text(text)
        tmp = out_dir / f"{name}-{digest}.{unique}.tmp.so"
        done = subprocess.run(["g++", "-std=c++20", *FLAGS, "-fno-gnu-unique", "-shared", "-fPIC", "-o", str(tmp), str(src)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"g++ failed on {src}:\n{done.stderr[-4000:]}")
        tmp.rename(lib)
    return ctypes.CDLL(str(lib))


def launch(lib: ctypes.CDLL, arrays: list[np.ndarray], grid_blocks: tuple[int, int, int], threads: int) -> None:
    """Run the kernel over ``arrays`` (inputs then outputs, C-contiguous; outputs are written);
    a divergent barrier or a block of more than 1,024 threads raises."""
    ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    rc = lib.launch(ptrs, *grid_blocks, threads)
    if rc == 2:
        raise RuntimeError(f"a block of {threads} threads: at most {MAX_THREADS}")
    if rc == 3:
        raise RuntimeError("a barrier that not every thread of its group reached (divergent barrier)")
    if rc == 4:
        raise RuntimeError("no memory for the fibers' stacks")


def _np(a) -> np.ndarray:
    import mlx.core as mx
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def _dt(a):
    import mlx.core as mx
    return BF16 if a == mx.bfloat16 else np.dtype({mx.float16: np.float16, mx.float32: np.float32,
                                                 mx.int32: np.int32, mx.uint32: np.uint32}[a])


def shape_arrays(source: str, name: str, a: np.ndarray, strides: tuple[int, ...] | None = None) -> list[np.ndarray]:
    """The ``<name>_shape`` (int32) and ``<name>_strides`` (int64, elements) arguments MLX passes
    after input ``name`` where the body reads them: ``a``'s own, or ``strides`` given (a view)."""
    out = []
    if f"{name}_shape" in source:
        out.append(np.array(a.shape, np.int32))
    if f"{name}_strides" in source:
        out.append(np.array(strides if strides is not None else [s // a.itemsize for s in a.strides], np.int64))
    return out


def run_launch(call) -> list:
    """Run a ``metal.cuda.paged_decode.Launch`` through the emulator; returns the outputs as numpy arrays."""
    import mlx.core as mx
    ins = [x for n, a in zip(call.input_names, call.inputs) for x in [_np(a), *shape_arrays(call.source, n, _np(a))]]
    outs = [np.full(s, 0xFFFF, np.uint16) if d == mx.bfloat16 else np.full(s, np.nan, _dt(d))
            for s, d in zip(call.output_shapes, call.output_dtypes)]  # poisoned: every element must be written
    template = [(n, v if isinstance(v, int) else _dt(v)) for n, v in call.template]
    lib = build(call.name, call.header, call.source, [(n, _dt(a.dtype)) for n, a in zip(call.input_names, call.inputs)],
                [(n, _dt(d)) for n, d in zip(call.output_names, call.output_dtypes)], template)
    blocks = tuple((g + t - 1) // t for g, t in zip(call.grid, call.threadgroup))
    launch(lib, ins + outs, blocks, call.threadgroup[0])
    return outs


def emulated_paged_decode_attention(variant=None, **kw) -> np.ndarray:
    """``metal.cuda.paged_decode.paged_decode_attention`` with both kernels run by the emulator."""
    import mlx.core as mx
    from metal.cuda import paged_decode as pd
    from metal.paged_plan import make_plan
    q = kw["queries"]
    H = kw["win_k"].shape[1]
    L = kw["lengths"]
    plan = kw.get("plan") or make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, H)
    call = pd.attention_launch(q, kw["records"], kw["win_k"], kw["win_v"], kw["table"], plan, kw["scale"],
                               (kw["key_bits"], kw["value_bits"]), variant or pd.DEFAULT_VARIANT)
    part_o, part_ml = run_launch(call)
    if call.final:
        out = part_o
        assert not (out == 0xFFFF).any() if q.dtype == mx.bfloat16 else not np.isnan(out).any(), "unwritten output"
    else:
        assert not np.isnan(part_o).any() and not np.isnan(part_ml).any(), "the attention kernel left outputs unwritten"
        call = pd.combine_launch(mx.array(part_o), mx.array(part_ml), plan, q)
        (out,) = run_launch(call)
    if q.dtype == mx.bfloat16:
        out = np.array(mx.array(out).view(mx.bfloat16).astype(mx.float32))
    return out.astype(np.float64).reshape(q.shape)


def _assert_written(out: np.ndarray, dtype, what: str) -> None:
    import mlx.core as mx
    assert not ((out == 0xFFFF).any() if dtype == mx.bfloat16 else np.isnan(out).any()), f"{what} left unwritten"


def emulated_ragged_decode_attention(**kw) -> np.ndarray:
    """``metal.cuda.ragged_decode.ragged_decode_attention`` with both kernels run by the emulator
    (asserting every output element of each launch was written)."""
    import mlx.core as mx
    from metal.cuda import ragged_decode as rd
    q, keys = kw["queries"], kw["keys"]
    rd.check_arguments(q, keys, kw["values"], kw["slots"], kw["lengths"], kw.get("plan"))
    plan = kw.get("plan") or rd.make_plan(kw["slots"], kw["lengths"], keys.shape[1])
    call = rd.attention_launch(q, keys, kw["values"], plan, kw["scale"])
    part_o, part_ml = run_launch(call)
    _assert_written(part_o, call.output_dtypes[0], "the attention kernel")
    _assert_written(part_ml, mx.float32, "the attention kernel")
    out = part_o
    if not call.final:
        (out,) = run_launch(rd.combine_launch(mx.array(part_o), mx.array(part_ml), plan, q))
        _assert_written(out, q.dtype, "the combine kernel")
    if q.dtype == mx.bfloat16:
        out = np.array(mx.array(out).view(mx.bfloat16).astype(mx.float32))
    return out.astype(np.float64).reshape(q.shape)
