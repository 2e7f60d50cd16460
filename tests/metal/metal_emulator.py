"""Runs an ``mx.fast.metal_kernel`` body on the CPU: the body is wrapped the way MLX wraps it
(``mlx/backend/common/metal_kernel.cpp``, ``write_signature``: the template arguments as a C++
template, one ``const device T*`` parameter per input, or ``const constant T*`` for inputs of fewer
than 8 elements, ``device T*`` per output, one parameter per thread attribute the body names, in
MLX's order; then the explicit instantiation under MLX's kernel name) and compiled with g++
against a small shim:

- the shim's state is private to each built library (``static``; g++'s ``-fno-gnu-unique``: no
  global shared with another emulator's library loaded in the same process);
- every thread of a threadgroup is a fiber (its own stack) of one OS thread, threadgroups one
  after the other; a barrier parks a fiber until every thread of its group has arrived (a barrier
  some thread never reaches is reported as divergent instead of hanging);
- ``threadgroup_barrier`` is a barrier over the threadgroup; ``simd_shuffle_xor``, ``simd_sum``
  and ``simd_max`` exchange values through a barrier over the 32 threads of a simdgroup
  (``simd_sum`` adds in lane order: the hardware's order is its own);
- a ``threadgroup T name[N];`` declaration of the body becomes a slice of one threadgroup buffer
  that is poisoned (all bits set: NaN floats) before every threadgroup, and a launch whose
  threadgroup memory passes 32 KB, or whose threadgroup has more than 1,024 threads, fails (the
  Apple GPU limits);
- ``half`` is ``_Float16``, ``bfloat`` a 16-bit struct rounding to nearest even, the address
  space qualifiers ``device`` / ``constant`` / ``thread`` / ``threadgroup`` are empty macros,
  ``metal::`` and ``metal::precise::`` math maps to the C library (correctly rounded ``/`` and
  ``sqrt``; glibc's ``expf`` / ``logf``), ``as_type<T>`` is a bit copy; g++ runs with
  ``-ffp-contract=off`` (no multiply-add contraction, as Metal's safe math mode is meant to give)
  unless a test asks for ``-mfma -ffp-contract=fast``.

What it cannot say: whether Apple's Metal compiler accepts the text (g++ accepts C++ that Metal
rejects, and the empty address-space macros hide address-space mismatches), speed, register
use and so ``maxTotalThreadsPerThreadgroup``, the real simdgroup scheduling and the hardware's
order inside ``simd_sum``, and Apple's own ``exp`` / ``log``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import numpy as np

MAX_THREADS = 1024
MAX_THREADGROUP_MEMORY = 32 * 1024
MAX_CONSTANT_ARRAY_SIZE = 8  # MLX: inputs with fewer elements go in the constant address space

# MLX's list (metal_kernel.cpp): an attribute is a parameter when the body names it
ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint", "(tx + 3) / 4"),
    ("dispatch_simdgroups_per_threadgroup", "uint", "(tx + 31) / 32"),
    ("dispatch_threads_per_threadgroup", "uint3", "uint3{(uint)tx, 1, 1}"),
    ("grid_origin", "uint3", "uint3{0, 0, 0}"),
    ("grid_size", "uint3", "uint3{(uint)(gx * tx), (uint)gy, (uint)gz}"),
    ("quadgroup_index_in_threadgroup", "uint", "t / 4"),
    ("quadgroups_per_threadgroup", "uint", "(tx + 3) / 4"),
    ("simdgroup_index_in_threadgroup", "uint", "t / 32"),
    ("simdgroups_per_threadgroup", "uint", "(tx + 31) / 32"),
    ("thread_execution_width", "uint", "32"),
    ("thread_index_in_quadgroup", "uint", "t % 4"),
    ("thread_index_in_simdgroup", "uint", "t % 32"),
    ("thread_index_in_threadgroup", "uint", "t"),
    ("thread_position_in_grid", "uint3", "uint3{(uint)(x * tx + t), (uint)y, (uint)z}"),
    ("thread_position_in_threadgroup", "uint3", "uint3{(uint)t, 0, 0}"),
    ("threadgroup_position_in_grid", "uint3", "uint3{(uint)x, (uint)y, (uint)z}"),
    ("threadgroups_per_grid", "uint3", "uint3{(uint)gx, (uint)gy, (uint)gz}"),
    ("threads_per_grid", "uint3", "uint3{(uint)(gx * tx), (uint)gy, (uint)gz}"),
    ("threads_per_simdgroup", "uint", "32"),
    ("threads_per_threadgroup", "uint3", "uint3{(uint)tx, 1, 1}"),
]

SHIM = r"""
#include <cstdint>
#include <cstddef>
#include <cmath>
#include <cstring>
#include <vector>
#include <csetjmp>
#include <cstdlib>
#include <ucontext.h>
// The threads of a threadgroup are fibers of one OS thread (ucontext stacks, switched by
// _setjmp / _longjmp): a barrier parks the fiber and the scheduler resumes the others; a fiber
// parked at a barrier runs again once every thread of its group has arrived there. A barrier that
// some thread never reaches (a divergent barrier) is reported, not hung on.
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
#define emu_tid emu_cur
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef half float16_t;
struct bfloat {
  uint16_t v;
  bfloat() = default;
  bfloat(float f) { uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); v = (uint16_t)(u >> 16); }
  operator float() const { uint32_t u = (uint32_t)v << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
typedef bfloat bfloat16_t;
struct uint3 { uint x, y, z; };
template <class T, class U> inline T as_type(U u) { static_assert(sizeof(T) == sizeof(U)); T t; std::memcpy(&t, &u, sizeof(T)); return t; }

static emu_barrier* emu_bar;
static emu_barrier* emu_sbar[32];
static uint64_t emu_x[2 * 1024];
alignas(16) static unsigned char emu_tg[2 * 32768 + 4096];
static size_t emu_tg_offs[1024];
#define emu_tg_off emu_tg_offs[emu_cur]
static size_t emu_tg_peak;
inline void* emu_tg_alloc(size_t bytes) {
  void* p = emu_tg + emu_tg_off;
  emu_tg_off += (bytes + 15) / 16 * 16;
  if (emu_tg_off > emu_tg_peak) emu_tg_peak = emu_tg_off;  // every thread writes the same value
  if (emu_tg_off > sizeof(emu_tg)) return emu_tg;  // reported by the launcher (past 32 KB)
  return p;
}

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
namespace precise {
inline float exp(float x) { return ::expf(x); }
inline float log(float x) { return ::logf(x); }
inline float sqrt(float x) { return ::sqrtf(x); }
inline float divide(float a, float b) { return a / b; }
}  // namespace precise
inline float exp2(float x) { return ::exp2f(x); }
inline float fmax(float a, float b) { return ::fmaxf(a, b); }
inline float fmin(float a, float b) { return ::fminf(a, b); }
inline float rint(float x) { return ::rintf(x); }
inline float abs(float x) { return ::fabsf(x); }
}  // namespace metal
using namespace metal;

inline void threadgroup_barrier(metal::mem_flags) { emu_bar->arrive_and_wait(); }
inline void simdgroup_barrier(metal::mem_flags) { emu_sbar[emu_tid >> 5]->arrive_and_wait(); }
// one barrier a simdgroup operation: values go to alternate halves of emu_x (a lane can write a
// half again only after the next barrier, which every lane reaches after reading it)
static int emu_phases[1024];
#define emu_phase emu_phases[emu_cur]
template <class T> inline T simd_shuffle_xor(T v, ushort mask) {
  static_assert(sizeof(T) <= 8);
  const int t = emu_tid;
  uint64_t* x = emu_x + 1024 * emu_phase;
  emu_phase ^= 1;
  std::memcpy(&x[t], &v, sizeof(T));
  emu_sbar[t >> 5]->arrive_and_wait();
  T r;
  std::memcpy(&r, &x[(t & ~31) | ((t & 31) ^ (mask & 31))], sizeof(T));
  return r;
}
template <class T, class F> inline T emu_simd_reduce(T v, F f) {
  const int t = emu_tid;
  uint64_t* x = emu_x + 1024 * emu_phase;
  emu_phase ^= 1;
  std::memcpy(&x[t], &v, sizeof(T));
  emu_sbar[t >> 5]->arrive_and_wait();
  T r;
  std::memcpy(&r, &x[t & ~31], sizeof(T));
  for (int i = 1; i < 32; ++i) { T o; std::memcpy(&o, &x[(t & ~31) | i], sizeof(T)); r = f(r, o); }
  return r;
}
inline float simd_sum(float v) { return emu_simd_reduce(v, [](float a, float b) { return a + b; }); }
inline float simd_max(float v) { return emu_simd_reduce(v, [](float a, float b) { return ::fmaxf(a, b); }); }
inline float simd_min(float v) { return emu_simd_reduce(v, [](float a, float b) { return ::fminf(a, b); }); }

#define device
#define constant
#define thread
#define threadgroup
"""

TYPE_STRINGS = {"float16": "float16_t", "bfloat16": "bfloat16_t", "float32": "float", "int32": "int32_t",
                "uint32": "uint32_t", "uint8": "uint8_t", "int64": "int64_t", "uint16": "uint16_t"}
BF16 = "bfloat16"
_TG_ARRAY = re.compile(r"threadgroup\s+([A-Za-z_][\w:]*)\s+([A-Za-z_]\w*)\s*\[([^\]\n]+)\]\s*;")


def available() -> bool:
    return shutil.which("g++") is not None


def type_string(dtype) -> str:
    """MLX's ``get_type_string`` of an mx dtype, a numpy dtype or "bfloat16"."""
    return TYPE_STRINGS[_dtype_name(dtype)]


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    try:
        import mlx.core as mx
        if isinstance(dtype, mx.Dtype):
            return str(dtype).split(".")[-1]
    except ImportError:
        pass
    return np.dtype(dtype).name


def _template_value(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return type_string(v)


def kernel_source(name: str, header: str, source: str, input_names: list[str], inputs: list[tuple[tuple, object]],
                  output_names: list[str], output_dtypes: list, template: list[tuple[str, object]]) -> tuple[str, str, list]:
    """The text MLX compiles for one call (``write_signature`` and the explicit instantiation):
    ``inputs`` as (shape, dtype); returns (text, the kernel's name, the attributes it takes)."""
    for n in input_names:
        if n + "_shape" in source or n + "_strides" in source or n + "_ndim" in source:
            raise NotImplementedError(f"{n}_shape / _strides / _ndim are not emulated")
    attributes = [(a, t, v) for a, t, v in ATTRIBUTES if a in source]
    kernel_name = "custom_kernel_" + name
    template_def = ""
    if template:
        template_def = "<" + ", ".join(_template_value(v) for _, v in template) + ">"
        h = template_def.replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]
        kernel_name += "_" + h
    for shape, dt in inputs:
        size = int(np.prod(shape)) if len(shape) else 1
        kernel_name += "_" + type_string(dt) + ("s" if len(shape) == 0 else "c" if size < MAX_CONSTANT_ARRAY_SIZE else "")
    for dt in output_dtypes:
        kernel_name += "_" + type_string(dt)
    text = header
    if template:
        kinds = ["bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename" for _, v in template]
        text += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template)) + ">\n"
    params = []
    for i, (n, (shape, dt)) in enumerate(zip(input_names, inputs)):
        size = int(np.prod(shape)) if len(shape) else 1
        if len(shape) == 0:
            raise NotImplementedError("0-d inputs are not emulated")
        where = "constant" if size < MAX_CONSTANT_ARRAY_SIZE else "device"
        params.append(f"  const {where} {type_string(dt)}* {n} [[buffer({i})]]")
    for j, (n, dt) in enumerate(zip(output_names, output_dtypes)):
        params.append(f"  device {type_string(dt)}* {n} [[buffer({len(inputs) + j})]]")
    params += [f"  {t} {a} [[{a}]]" for a, t, _ in attributes]
    text += f"[[kernel]] void {kernel_name}(\n" + ",\n".join(params) + ") {\n" + source + "\n}\n"
    if template:
        full = kernel_name + template_def
        text += f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] decltype({full}) {full};\n'
    return text, kernel_name + template_def, attributes


def _threadgroup_arrays(text: str) -> str:
    """``threadgroup T name[N];`` -> a slice of the emulator's threadgroup buffer."""
    return _TG_ARRAY.sub(lambda m: f"{m[1]}* {m[2]} = ({m[1]}*)emu_tg_alloc(sizeof({m[1]}) * ({m[3]}));", text)


def build(name: str, header: str, source: str, input_names: list[str], inputs: list[tuple[tuple, object]],
          output_names: list[str], output_dtypes: list, template: list[tuple[str, object]],
          flags: tuple[str, ...] = ("-ffp-contract=off",)) -> ctypes.CDLL:
    """Compile one call's text (``kernel_source``) with the shim and a launcher; ``flags``: g++'s
    floating-point flags (the default forbids contraction; the tests also build with
    ``-mfma -ffp-contract=fast`` to see that a body keeps its results where a compiler fuses)."""
    text, call, attributes = kernel_source(name, header, source, input_names, inputs, output_names, output_dtypes,
                                           template)
    n_args = len(inputs) + len(output_names)
    ptypes = [f"const {type_string(dt)}*" for _, dt in inputs] + [f"{type_string(dt)}*" for dt in output_dtypes]
    casts = ", ".join([f"({p})args[{i}]" for i, p in enumerate(ptypes)] + [v for _, _, v in attributes])
    launcher = (
        "static void** emu_args;\n"
        "static int emu_g[3], emu_b[3], emu_tx;\n"
        "static void emu_entry(int t) {\n"
        "  void** args = emu_args; const int gx = emu_g[0], gy = emu_g[1], gz = emu_g[2];\n"
        "  const int x = emu_b[0], y = emu_b[1], z = emu_b[2], tx = emu_tx;\n"
        "  (void)gx; (void)gy; (void)gz; (void)x; (void)y; (void)z; (void)tx;\n"
        f"  {call}({casts});\n"
        "  emu_f[t].state = 3;\n"
        "  _longjmp(emu_main, 1);\n"
        "}\n"
        'extern "C" int launch(void** args, int gx, int gy, int gz, int tx) {\n'
        f"  if (tx > {MAX_THREADS} || tx % 32) return 2;\n"
        "  emu_args = args; emu_g[0] = gx; emu_g[1] = gy; emu_g[2] = gz; emu_tx = tx;\n"
        "  const size_t stack = 256 * 1024;\n"
        "  std::vector<emu_fiber> fibers(tx); emu_f = fibers.data();\n"
        "  for (auto& f : fibers) f.stack = (char*)std::malloc(stack);\n"
        "  int rc = 0;\n"
        "  emu_tg_peak = 0;\n"
        "  for (int z = 0; z < gz && !rc; ++z) for (int y = 0; y < gy && !rc; ++y) for (int x = 0; x < gx && !rc; ++x) {\n"
        "    emu_b[0] = x; emu_b[1] = y; emu_b[2] = z;\n"
        "    std::memset(emu_tg, 0xff, sizeof(emu_tg));\n"
        "    emu_barrier bar(tx); emu_bar = &bar;\n"
        "    std::vector<emu_barrier*> sb;\n"
        "    for (int i = 0; i < tx / 32; ++i) { sb.push_back(new emu_barrier(32)); emu_sbar[i] = sb.back(); }\n"
        "    for (int t = 0; t < tx; ++t) {\n"
        "      emu_fiber& f = fibers[t];\n"
        "      f.state = 0; emu_phases[t] = 0; emu_tg_offs[t] = 0;\n"
        "      getcontext(&f.uc); f.uc.uc_stack.ss_sp = f.stack; f.uc.uc_stack.ss_size = stack; f.uc.uc_link = nullptr;\n"
        "      makecontext(&f.uc, (void (*)())emu_entry, 1, t);\n"
        "    }\n"
        "    int done = 0;\n"
        "    while (done < tx) {\n"
        "      bool progress = false;\n"
        "      for (int t = 0; t < tx; ++t) {\n"
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
        "    for (auto* b : sb) delete b;\n"
        f"    if (emu_tg_peak > {MAX_THREADGROUP_MEMORY}) rc = 1;\n"
        "  }\n"
        "  for (auto& f : fibers) std::free(f.stack);\n"
        "  return rc;\n"
        "}\n")
    assert n_args == len(ptypes)
    full = SHIM + _threadgroup_arrays(text) + launcher
    digest = hashlib.sha1((full + " ".join(flags)).encode()).hexdigest()[:16]
    out_dir = Path(tempfile.gettempdir()) / "kvarn-metal-emulator"
    out_dir.mkdir(exist_ok=True)
    lib = out_dir / f"{name}-{digest}.so"
    if not lib.exists():
        unique = f"{os.getpid()}-{uuid.uuid4().hex}"  # test workers may build the same text at once
        src = out_dir / f"{name}-{digest}.{unique}.cpp"
        src.write_text(full)
        tmp = out_dir / f"{name}-{digest}.{unique}.tmp.so"
        done = subprocess.run(["g++", "-std=c++20", "-O1", *flags, "-fno-gnu-unique", "-Wno-attributes", "-shared", "-fPIC", "-pthread",
                               "-o", str(tmp), str(src)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"g++ failed on {src}:\n{done.stderr[-4000:]}")
        tmp.rename(lib)
    return ctypes.CDLL(str(lib))


def launch(lib: ctypes.CDLL, arrays: list[np.ndarray], grid: tuple[int, int, int],
           threadgroup: tuple[int, int, int]) -> None:
    """Run over ``arrays`` (inputs then outputs, C-contiguous; outputs are written). ``grid``
    counts threads, as ``mx.fast.metal_kernel``'s does; it must be a multiple of ``threadgroup``
    (only x-extent threadgroups are emulated)."""
    tx, ty, tz = threadgroup
    if ty != 1 or tz != 1 or any(g % t for g, t in zip(grid, threadgroup)):
        raise NotImplementedError(f"grid {grid} / threadgroup {threadgroup}")
    ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    rc = lib.launch(ptrs, grid[0] // tx, grid[1], grid[2], tx)
    if rc == 1:
        raise RuntimeError(f"threadgroup memory past {MAX_THREADGROUP_MEMORY} bytes")
    if rc == 2:
        raise RuntimeError(f"a threadgroup of {tx} threads: at most {MAX_THREADS}, a multiple of 32")
    if rc == 3:
        raise RuntimeError("a barrier that not every thread of its group reached (divergent barrier)")


def to_numpy(a) -> np.ndarray:
    import mlx.core as mx
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def poisoned(shape, dtype) -> np.ndarray:
    """An output buffer whose every element reads as unwritten (NaN; 0xFFFF bfloat16; 0xDEADBEEF)."""
    name = _dtype_name(dtype)
    if name == "bfloat16":
        return np.full(shape, 0xFFFF, np.uint16)
    if name.startswith(("int", "uint")):
        return np.full(shape, 0xDEADBEEF, np.uint32).astype(np.dtype(name))
    return np.full(shape, np.nan, np.dtype(name))


def unwritten(out: np.ndarray, dtype) -> bool:
    name = _dtype_name(dtype)
    if name == "bfloat16":
        return bool((out == 0xFFFF).any())
    if name.startswith(("int", "uint")):
        return bool((out == np.array(0xDEADBEEF, np.uint32).astype(out.dtype)).any())
    return bool(np.isnan(out).any())


def run_launch(call, source: str | None = None, header: str | None = None,
               flags: tuple[str, ...] = ("-ffp-contract=off",)) -> list[np.ndarray]:
    """Run a ``MetalLaunch`` (``metal.msl.paged_decode`` / ``metal.msl.commit``) through the
    emulator; returns the outputs as numpy arrays (poisoned before the launch; bfloat16 as
    uint16 bits). ``source`` / ``header`` replace the launch's (the tests' broken variants)."""
    ins = [to_numpy(a) for a in call.inputs]
    outs = [poisoned(s, d) for s, d in zip(call.output_shapes, call.output_dtypes)]
    lib = build(call.name, call.header if header is None else header, call.source if source is None else source,
                call.input_names, [(tuple(a.shape), a.dtype) for a in call.inputs], call.output_names,
                call.output_dtypes, call.template, flags)
    launch(lib, ins + outs, call.grid, call.threadgroup)
    return outs


def emulated_paged_decode_attention(source: str | None = None, **kw) -> np.ndarray:
    """``metal.msl.paged_decode.paged_decode_attention`` with both launches run by the emulator
    (asserting every output element of each was written); float64 [B, n_q, 1, D]."""
    import mlx.core as mx
    from metal.msl import paged_decode as pm
    from metal.paged_plan import make_plan
    q, H = kw["queries"], kw["win_k"].shape[1]
    L = kw["lengths"]
    plan = kw.get("plan") or make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, H)
    call = pm.attention_launch(q, kw["records"], kw["win_k"], kw["win_v"], kw["table"], plan, kw["scale"],
                               (kw["key_bits"], kw["value_bits"]))
    part_o, part_ml = run_launch(call, source)
    assert not unwritten(part_o, mx.float32) and not unwritten(part_ml, mx.float32), "attention left outputs unwritten"
    (out,) = run_launch(pm.combine_launch(mx.array(part_o), mx.array(part_ml), plan, q))
    assert not unwritten(out, q.dtype), "the combine left outputs unwritten"
    if q.dtype == mx.bfloat16:
        out = np.array(mx.array(out).view(mx.bfloat16).astype(mx.float32))
    return out.astype(np.float64).reshape(q.shape)
