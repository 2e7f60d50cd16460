// KVarN's CPU kernels as MLX primitives (an MLX extension built at first use by metal/cpu/build.py).
//
// MLX's CPU backend runs attention unfused and its fused elementwise kernels are compiled without the
// host's vector instructions; a KVarN record's codes can only reach its OpenBLAS products unpacked to
// float32 first. These primitives read what the storage holds, in place, in loops the compiler
// vectorizes for this CPU (-O3 -march=native), and run inside MLX graphs (mx.compile too):
//
//   DecodeRecords  one decode step's attention of rows over their float windows and their KVarN
//                  records (2-, 4- or 8-bit codes, float16 factors): scores, softmax and the weighted
//                  values in one pass a (row, KV head), each code dequantized in registers; the pure-MLX twin is
//                  kvarn.attention._quantized_matmul_attention.
//   QuantizeTiles  the KVarN quantizer of rotated tiles (normalize, round, pack) into record fields;
//                  the pure-MLX twin is kvarn.pool.quantize_blocks_reference.
//   DequantizeRecords  rows' records read in place into float32 keys and values (a prompt chunk's
//                  history); the pure-MLX twin is kvarn.pool.dequantize_blocks.
//   ExpRows        exp(scores - top) a row, top the row's max or given, and the row sums: a softmax's
//                  numerator and denominator; the pure-MLX twin is kvarn.cpu_attention._exp_below
//                  (the same polynomial, the same bits: built without contraction into FMAs).
//   Rotate         the normalized Hadamard transform along the last axis, block-diagonal over slices of
//                  a power-of-two width: MLX's own butterflies (mx.hadamard_transform's CPU kernel, the
//                  same operations on every element, so the same bits) without its scalar loop.
//   Rope           rotary position embedding (mx.fast.rope, not traditional): the operations of MLX's
//                  CPU fallback on every element (its exp, sin and cos; the same bits) in one task
//                  instead of the fallback's ~20 graph nodes a call.
//   RowsMatmul     x @ w^T for a few rows of x (a decode step's rows: up to 4): each row of w read once,
//                  from memory, for all rows of x, split over the cores. MLX's CPU matmul is OpenBLAS's
//                  sgemm, which packs (copies) the whole weight matrix for every call: at one row 2-3x
//                  the bytes a matrix-vector product reads, and most of a one-user decode step.
//   SwiGLU         silu(gate) * up, a Llama MLP's activation (mlx-lm's compiled swiglu): MLX's own sigmoid
//                  and exp on every element (the same bits) in loops the compiler vectorizes. MLX's fused CPU
//                  kernel calls a scalar exp and a library fma an element (~20 ns): 12% of a 16-row decode
//                  step of the bundled model and more of a prompt's prefill.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <type_traits>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <thread>
#include <vector>

#include <unistd.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/math.h"
#include "mlx/backend/cpu/unary_ops.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
using namespace mlx::core;

namespace {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2_HI = 0.693359375f;
constexpr float LN2_LO = -2.12194440e-4f;
constexpr float EXP_FLOOR = -87.0f;
constexpr float ROUND = 12582912.0f;  // 1.5 * 2**23
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 as kvarn.cpu_attention._exp_below computes it (operation for operation).
inline float exp_below(float x) {
  x = x > EXP_FLOOR ? x : EXP_FLOOR;
  float shifted = x * LOG2E + ROUND;
  float n = shifted - ROUND;
  float r = (x - n * LN2_HI) - n * LN2_LO;
  float biased = shifted + 127.0f;
  uint32_t bits;
  std::memcpy(&bits, &biased, 4);
  bits <<= 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  float r2 = r * r;
  float high = (1.9875691500e-4f * r + 1.3981999507e-3f) * r2 + (8.3334519073e-3f * r + 4.1665795894e-2f);
  float low = (1.6666665459e-1f * r + 5.0000001201e-1f) * r2 + (r + 1.0f);
  return (high * (r2 * r2) + low) * scale;
}

// float16 -> float32, n values
inline void to_float(const float16_t* x, int n, float* out) {
#if defined(__F16C__)
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(x);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(bits[i]);
#else
  for (int i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]);
#endif
}

// a row of n window values as float32: in place, or converted into ``scratch``
inline const float* row_of(const float* x, int, float*) {
  return x;
}
inline const float* row_of(const float16_t* x, int n, float* scratch) {
  to_float(x, n, scratch);
  return scratch;
}

// codes [n] of BITS bits from MLX's little-endian packing (2, 4, 8: a code never straddles a word)
template <int BITS>
inline void unpack(const uint32_t* words, int n, float* out) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  for (int w = 0; w < n / PER_WORD; ++w) {
    const uint32_t x = words[w];
    for (int l = 0; l < PER_WORD; ++l) out[w * PER_WORD + l] = static_cast<float>((x >> (BITS * l)) & MASK);
  }
}

// ``unpack`` with the width known at run time
inline void unpack_bits(const uint32_t* words, int n, int bits, float* out) {
  switch (bits) {
    case 2: return unpack<2>(words, n, out);
    case 4: return unpack<4>(words, n, out);
    default: return unpack<8>(words, n, out);
  }
}

// a * b + c rounded once (the products' sums are built of these; only the exp polynomial, which
// must give the pure-MLX path's bits, is kept free of fused multiply-adds: -ffp-contract=off)
inline float fma(float a, float b, float c) {
  return __builtin_fmaf(a, b, c);
}

// acc[r][i] += a[r] * (codes[i] * alpha + beta) for i < n, r < R: each code dequantized once, in a
// register, for all R rows (R a template argument where it is a common head ratio)
template <int RT>
inline void dequantized_products_r(const float* codes, int n, float alpha, float beta, const float* a, float* acc) {
  float ar[RT];
  for (int r = 0; r < RT; ++r) ar[r] = a[r];
  for (int i = 0; i < n; ++i) {
    const float x = fma(codes[i], alpha, beta);
    for (int r = 0; r < RT; ++r) acc[r * n + i] = fma(ar[r], x, acc[r * n + i]);
  }
}

inline void dequantized_products(const float* codes, int n, float alpha, float beta, const float* a, int R,
                                 float* acc) {
  switch (R) {
    case 1: return dequantized_products_r<1>(codes, n, alpha, beta, a, acc);
    case 2: return dequantized_products_r<2>(codes, n, alpha, beta, a, acc);
    case 4: return dequantized_products_r<4>(codes, n, alpha, beta, a, acc);
    case 8: return dequantized_products_r<8>(codes, n, alpha, beta, a, acc);
    default:
      for (int i = 0; i < n; ++i) {
        const float x = fma(codes[i], alpha, beta);
        for (int r = 0; r < R; ++r) acc[r * n + i] = fma(a[r], x, acc[r * n + i]);
      }
  }
}

// Reductions in 8 independent lanes (the compiler vectorizes them; one float sum would be a chain)
constexpr int LANES = 8;

inline float dot(const float* a, const float* b, int n) {
  float acc[LANES] = {};
  int i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] = fma(a[i + l], b[i + l], acc[l]);
  float s = 0.0f;
  for (int l = 0; l < LANES; ++l) s += acc[l];
  for (; i < n; ++i) s = fma(a[i], b[i], s);
  return s;
}

inline float row_sum(const float* a, int n) {
  float acc[LANES] = {};
  int i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += a[i + l];
  float s = 0.0f;
  for (int l = 0; l < LANES; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i];
  return s;
}

inline float row_max(const float* a, int n) {
  float acc[LANES];
  for (int l = 0; l < LANES; ++l) acc[l] = NEG_INF;
  int i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] = a[i + l] > acc[l] ? a[i + l] : acc[l];
  float m = NEG_INF;
  for (int l = 0; l < LANES; ++l) m = acc[l] > m ? acc[l] : m;
  for (; i < n; ++i) m = a[i] > m ? a[i] : m;
  return m;
}


// Helper threads kept for the process (hardware_concurrency - 1 of them, started at the first
// parallel_for): a primitive's parts run on them and on the calling thread. Starting and joining
// threads for every call cost ~20-50 us each, and a decode step makes ~100 such calls (its few-row
// products, attention, RoPE, SwiGLU). One caller at a time uses them; another (a second MLX stream)
// runs its parts itself. A forked child starts its own helpers (the parent's are not in it).
class Helpers {
 public:
  static Helpers* get() {
    static std::mutex made;
    static Helpers* pool = nullptr;
    std::lock_guard<std::mutex> lock(made);
    if (pool == nullptr || pool->owner_ != getpid()) {
      const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      pool = new Helpers(cores - 1);  // never freed: a forked child's copy of the parent's is left as is
    }
    return pool;
  }

  // part(i) for i in [0, parts): 0 on the caller, the others on the helpers (or the caller, once
  // it is done with its own). False, having run nothing, where another caller holds the helpers.
  template <class F>
  bool run(int parts, F& part) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    const std::function<void(int)> job = [&part](int i) { part(i); };
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = &job;
      parts_ = parts;
      next_ = 1;
      ++generation_;
    }
    wake_.notify_all();
    part(0);
    std::unique_lock<std::mutex> lock(m_);
    take(lock);
    if (running_.load() != 0) {  // helpers still in their parts: spin briefly before sleeping
      lock.unlock();
      spin([&] { return running_.load(std::memory_order_acquire) == 0; });
      lock.lock();
    }
    done_.wait(lock, [&] { return next_ >= parts_ && running_ == 0; });
    job_ = nullptr;
    return true;
  }

 private:
  explicit Helpers(int n) : owner_(getpid()) {
    for (int i = 0; i < n; ++i) std::thread([this] { loop(); }).detach();
  }

  // run parts not yet taken (the lock held on entry and exit, released around each part)
  void take(std::unique_lock<std::mutex>& lock) {
    while (job_ != nullptr && next_ < parts_) {
      const int i = next_++;
      const std::function<void(int)>* job = job_;
      ++running_;
      lock.unlock();
      (*job)(i);
      lock.lock();
      --running_;
    }
    if (next_ >= parts_ && running_ == 0) done_.notify_all();
  }

  // A step's primitives run back to back, so the next parts usually come within microseconds: a
  // helper (and a caller waiting for one) spins that long before it sleeps on the condition.
  template <class Ready>
  static void spin(Ready ready) {
    for (int i = 0; i < SPIN && !ready(); ++i) relax();
  }

  static void relax() {  // the CPU's spin-wait hint (any architecture: the build is -march=native)
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      spin([&] { return generation_.load(std::memory_order_acquire) != seen; });
      std::unique_lock<std::mutex> lock(m_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      seen = generation_.load();
      take(lock);
    }
  }

  static constexpr int SPIN = 2000;  // pauses: ~20-100 us

  const pid_t owner_;
  std::mutex busy_;  // held by the caller whose parts the helpers run
  std::mutex m_;     // guards what follows
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  int parts_ = 0, next_ = 0;
  std::atomic<int> running_{0};  // parts being run (changed under m_, read outside it while spinning)
  std::atomic<uint64_t> generation_{0};
};

// fn(begin, end) over [0, n) split across up to hardware_concurrency threads (this one and the
// helpers) where the work is worth waking them: MLX runs a CPU primitive on its one stream thread,
// while its OpenBLAS products use every core. The split depends on n and the work only, so results
// do not depend on which thread ran a part.
constexpr int64_t MIN_WORK_PER_THREAD = 1 << 18;  // ~ multiply-adds: a few hundred microseconds

template <class F>
void parallel_for(int64_t n, int64_t work_per_item, F&& fn) {
  static const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t by_work = std::max<int64_t>(1, n * work_per_item / MIN_WORK_PER_THREAD);
  const int64_t threads = std::min({cores, n, by_work});
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t per = (n + threads - 1) / threads;
  auto part = [&](int t) {
    const int64_t lo = t * per, hi = std::min(n, lo + per);
    if (lo < hi) fn(lo, hi);
  };
  if (Helpers::get()->run(static_cast<int>(threads), part)) return;
  for (int t = 0; t < threads; ++t) part(t);  // another caller holds the helpers
}

// ---------------------------------------------------------------------------------------------
// The primitives read their inputs row-contiguous. An input that is not (a broadcast, a transposed
// view) is copied on the stream before the primitive's own task; the graph then needs no Contiguous
// node an input (~120 a decode step of 8 layers, each a task of its own; MLX's copy is not exported).
void strided_copy(const char* src, char* dst, const Shape& shape, const Strides& strides, size_t item, size_t size) {
  const int nd = static_cast<int>(shape.size());
  std::vector<int64_t> idx(nd, 0);
  int64_t at = 0;  // src offset (elements) of idx
  for (size_t i = 0; i < size; ++i) {
    std::memcpy(dst + i * item, src + at * item, item);
    for (int d = nd - 1; d >= 0; --d) {
      at += strides[d];
      if (++idx[d] < shape[d]) break;
      at -= strides[d] * shape[d];
      idx[d] = 0;
    }
  }
}

std::vector<array> row_contiguous(const std::vector<array>& given, Stream stream) {
  std::vector<array> in;
  in.reserve(given.size());
  for (const array& a : given) {
    if (a.flags().row_contiguous) {
      in.push_back(a);
      continue;
    }
    array c(a.shape(), a.dtype(), nullptr, {});
    c.set_data(allocator::malloc(c.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream);
    encoder.set_input_array(a);
    encoder.set_output_array(c);
    encoder.dispatch([src = a.data<char>(), dst = c.data<char>(), shape = a.shape(), strides = a.strides(),
                      item = a.itemsize(), size = a.size()]() { strided_copy(src, dst, shape, strides, item, size); });
    encoder.add_temporary(c);
    in.push_back(c);
  }
  return in;
}

// ---------------------------------------------------------------------------------------------
// Rope: x [B, N, T, D] float32 (any strides), offset int32 [] or [B] -> x with rotary embeddings on
// its first ``dims`` channels (halves rotated, not interleaved), row-contiguous. Operation for
// operation MLX's CPU fallback of mx.fast.rope: positions (t + offset) * scale, inverse frequencies
// exp(-i * (log(base) / half)), theta = position * inverse frequency, its cos and sin by MLX's own
// simd functions, then x1 cos - x2 sin and x1 sin + x2 cos, each product rounded on its own
// (-ffp-contract=off). metal/selector.py checks the bits against mx.fast.rope before it is used.
class Rope : public UnaryPrimitive {
 public:
  Rope(Stream s, int dims, float base, float scale) : UnaryPrimitive(s), dims_(dims), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<array>& given, array& out) override {
    const array& x = given[0];
    const std::vector<array> offs = row_contiguous({given[1]}, stream());
    const array& offset = offs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(offset);
    encoder.set_output_array(out);
    const int B = x.shape(0), N = x.shape(1), T = x.shape(2), D = x.shape(3), half = dims_ / 2;
    const Strides st = x.strides();
    encoder.dispatch([src = x.data<float>(), off = offset.data<int32_t>(), per_row = offset.size() > 1,
                      dst = out.data<float>(), B, N, T, D, half, st, base = base_, scale = scale_]() {
      using simd::Simd;
      std::vector<float> inv(half);
      const float step = std::log(base) / half;  // as the fallback: log of the float base, over half in float
      for (int i = 0; i < half; ++i) inv[i] = simd::exp(Simd<float, 1>(static_cast<float>(-i) * step)).value;
      parallel_for(int64_t(B) * T, int64_t(N) * D * 4 + half * 40, [&](int64_t lo, int64_t hi) {
        std::vector<float> c(half), s(half);
        for (int64_t bt = lo; bt < hi; ++bt) {
          const int b = static_cast<int>(bt / T), t = static_cast<int>(bt % T);
          const float pos = (static_cast<float>(t) + static_cast<float>(off[per_row ? b : 0])) * scale;
          for (int i = 0; i < half; ++i) {
            const float theta = pos * inv[i];
            c[i] = simd::cos(Simd<float, 1>(theta)).value;
            s[i] = simd::sin(Simd<float, 1>(theta)).value;
          }
          for (int n = 0; n < N; ++n) {
            const float* xr = src + b * st[0] + n * st[1] + t * st[2];
            float* o = dst + ((int64_t(b) * N + n) * T + t) * D;
            for (int i = 0; i < half; ++i) {
              const float x1 = xr[i * st[3]], x2 = xr[(half + i) * st[3]];
              const float a = x1 * c[i], bb = x2 * s[i];
              o[i] = a - bb;
              const float e = x1 * s[i], f = x2 * c[i];
              o[half + i] = e + f;
            }
            for (int d = 2 * half; d < D; ++d) o[d] = xr[d * st[3]];
          }
        }
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("Rope runs on the CPU only");
  }
  const char* name() const override { return "KvarnRope"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && base_ == o.base_ && scale_ == o.scale_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int dims_;
  float base_, scale_;
};

array rope(const array& x, const array& offset, int dims, float base, float scale) {
  auto s = to_stream(Device::cpu);
  if (x.dtype() != float32 || x.ndim() != 4) throw std::invalid_argument("rope takes float32 [B, N, T, D]");
  if (dims < 2 || dims % 2 || dims > x.shape(3)) throw std::invalid_argument("rope takes even dims <= D");
  if (offset.dtype() != int32 || offset.ndim() > 1 || (offset.size() != 1 && offset.size() != x.shape(0)))
    throw std::invalid_argument("rope takes an int32 offset, one or one a row");
  return array(x.shape(), float32, std::make_shared<Rope>(s, dims, base, scale), {x, offset});
}

// ---------------------------------------------------------------------------------------------
// RowsMatmul: x [..., K] float32 (M = x.size / K rows, M <= MAX_ROWS), w [N, K] float32 or bfloat16
// -> [..., N] float32, out[m, n] = sum_k x[m, k] w[n, k]: each row of w streamed once for every row of
// x, in 8-lane fused multiply-add chains (float32, another order than OpenBLAS's: ~1e-7 relative), NB
// rows of w at a time so that a single row of x still has independent chains. A bfloat16 w (the same
// values as a float32 copy whose every weight is a bfloat16, as a bfloat16 or 8-bit model's are) is
// widened in registers, exactly: half the bytes a step streams, the same result bits.
constexpr int MAX_ROWS = 4;

inline float widen(float w) {
  return w;
}
inline float widen(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float w;
  std::memcpy(&w, &bits, sizeof w);
  return w;
}

template <int M, int NB, class WT>
void rows_matmul(const float* x, const WT* w, float* out, int64_t K, int64_t N, int64_t lo, int64_t hi) {
  int64_t n = lo;
  for (; n + NB <= hi; n += NB) {
    float acc[NB][M][LANES] = {};
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES)
      for (int b = 0; b < NB; ++b) {
        const WT* wr = w + (n + b) * K + k;
        float wv[LANES];
        for (int l = 0; l < LANES; ++l) wv[l] = widen(wr[l]);
        for (int m = 0; m < M; ++m)
          for (int l = 0; l < LANES; ++l) acc[b][m][l] = fma(wv[l], x[m * K + k + l], acc[b][m][l]);
      }
    for (int b = 0; b < NB; ++b)
      for (int m = 0; m < M; ++m) {
        float s = 0.0f;
        for (int l = 0; l < LANES; ++l) s += acc[b][m][l];
        for (int64_t j = k; j < K; ++j) s = fma(widen(w[(n + b) * K + j]), x[m * K + j], s);
        out[m * N + n + b] = s;
      }
  }
  if (n < hi) rows_matmul<M, 1>(x, w, out, K, N, n, hi);
}

template <class WT>
void rows_matmul_all(const float* x, const WT* w, float* out, int64_t K, int64_t N, int64_t M) {
  constexpr int64_t BLOCK = 64;  // rows of w a task: chunks the threads split
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  parallel_for(blocks, BLOCK * K * 2, [&](int64_t lo, int64_t hi) {
    const int64_t a = lo * BLOCK, b = std::min(N, hi * BLOCK);
    switch (M) {
      case 1: return rows_matmul<1, 4>(x, w, out, K, N, a, b);
      case 2: return rows_matmul<2, 2>(x, w, out, K, N, a, b);
      case 3: return rows_matmul<3, 1>(x, w, out, K, N, a, b);
      default: return rows_matmul<4, 1>(x, w, out, K, N, a, b);
    }
  });
}

class RowsMatmul : public UnaryPrimitive {
 public:
  explicit RowsMatmul(Stream s) : UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<array>& given, array& out) override {
    const std::vector<array> inputs = row_contiguous(given, stream());
    const array& x = inputs[0];
    const array& w = inputs[1];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    const int64_t K = w.shape(1), N = w.shape(0), M = K ? x.size() / K : 0;
    if (w.dtype() == bfloat16) {
      encoder.dispatch([xp = x.data<float>(), wp = w.data<uint16_t>(), dst = out.data<float>(), K, N, M]() {
        rows_matmul_all(xp, wp, dst, K, N, M);
      });
    } else {
      encoder.dispatch([xp = x.data<float>(), wp = w.data<float>(), dst = out.data<float>(), K, N, M]() {
        rows_matmul_all(xp, wp, dst, K, N, M);
      });
    }
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("RowsMatmul runs on the CPU only");
  }
  const char* name() const override { return "KvarnRowsMatmul"; }
  bool is_equivalent(const Primitive&) const override { return true; }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
};

array rows_matmul_of(const array& x, const array& w) {
  auto s = to_stream(Device::cpu);
  if (x.dtype() != float32 || (w.dtype() != float32 && w.dtype() != bfloat16) || x.ndim() == 0 || w.ndim() != 2)
    throw std::invalid_argument("rows_matmul takes float32 x [..., K] and float32 or bfloat16 w [N, K]");
  if (x.shape(-1) != w.shape(1)) throw std::invalid_argument("rows_matmul takes x and w of one K");
  if (x.size() > MAX_ROWS * static_cast<size_t>(x.shape(-1)) || x.size() == 0)
    throw std::invalid_argument("rows_matmul takes 1 to 4 rows of x");
  Shape shape = x.shape();
  shape.back() = w.shape(0);
  return array(shape, float32, std::make_shared<RowsMatmul>(s), {x, w});
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: gate, up float32 of one shape (any strides) -> silu(gate) * up, row-contiguous. Operation for
// operation what MLX's CPU kernels compute for nn.silu(gate) * up (mlx-lm's swiglu): s = sigmoid(g) by
// MLX's Sigmoid (1 / (1 + exp(|g|)), mirrored for g >= 0) and its exp polynomial, then (g * s) * up,
// each product rounded on its own (-ffp-contract=off). MLX's exp rounds x * log2(e) + 0.5 in float64
// before its floor; so does this. metal/selector.py checks the bits against MLX before it is used.
inline float mlx_sigmoid(float x) {
  const float a = std::fabs(x);
  float t = a * 1.442695f;
  const float ipart = static_cast<float>(std::floor(static_cast<double>(t) + 0.5));
  const float fpart = t - ipart;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, fpart, 1.339887440266574e-3f);
  p = std::fma(p, fpart, 9.618437357674640e-3f);
  p = std::fma(p, fpart, 5.550332471162809e-2f);
  p = std::fma(p, fpart, 2.402264791363012e-1f);
  p = std::fma(p, fpart, 6.931472028550421e-1f);
  p = std::fma(p, fpart, 1.000000000000000f);
  const int32_t bits = (static_cast<int32_t>(ipart) + 127) << 23;
  float two;
  std::memcpy(&two, &bits, sizeof two);
  float e = two * p;
  e = a > 88.0f ? std::numeric_limits<float>::infinity() : e;  // |x| is never below -88, and a NaN stays NaN below
  e = a != a ? a : e;
  const float y = 1.0f / (1.0f + e);
  return x < 0.0f ? y : 1.0f - y;
}

class SwiGLU : public UnaryPrimitive {
 public:
  explicit SwiGLU(Stream s) : UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<array>& given, array& out) override {
    const std::vector<array> inputs = row_contiguous(given, stream());
    const array& g = inputs[0];
    const array& u = inputs[1];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(g);
    encoder.set_input_array(u);
    encoder.set_output_array(out);
    constexpr int64_t CHUNK = 4096;
    const int64_t n = out.size(), chunks = (n + CHUNK - 1) / CHUNK;
    encoder.dispatch([gp = g.data<float>(), up = u.data<float>(), dst = out.data<float>(), n, chunks]() {
      parallel_for(chunks, CHUNK * 16, [&](int64_t lo, int64_t hi) {
        const int64_t end = std::min(n, hi * CHUNK);
        for (int64_t i = lo * CHUNK; i < end; ++i) {
          const float x = gp[i];
          const float silu = x * mlx_sigmoid(x);
          dst[i] = silu * up[i];
        }
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("SwiGLU runs on the CPU only");
  }
  const char* name() const override { return "KvarnSwiGLU"; }
  bool is_equivalent(const Primitive&) const override { return true; }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }
};

array swiglu(const array& gate, const array& up) {
  auto s = to_stream(Device::cpu);
  if (gate.dtype() != float32 || up.dtype() != float32 || gate.shape() != up.shape())
    throw std::invalid_argument("swiglu takes float32 gate and up of one shape");
  return array(gate.shape(), float32, std::make_shared<SwiGLU>(s), {gate, up});
}

// ---------------------------------------------------------------------------------------------
// ExpRows: scores [rows, n], optionally plus an additive mask [m, n] (row i takes mask row i % m:
// a [L, T] mask under scores [..., L, T]) -> weights exp(x - top) [rows, n], their sums [rows, 1] and
// top [rows, 1]: the given top, or the row's max of x (raised to floor [rows, 1] where given). x is
// scores + mask, each sum rounded once as MLX's add: the mask's add, the max and the exp in one pass a
// row (MLX's add and max reduction are one thread each, over a prompt chunk's whole score matrix).
class ExpRows : public Primitive {
 public:
  ExpRows(Stream s, bool given_top, bool masked, bool floored)
      : Primitive(s), given_top_(given_top), masked_(masked), floored_(floored) {}

  void eval_cpu(const std::vector<array>& given, std::vector<array>& outputs) override {
    const std::vector<array> inputs = row_contiguous(given, stream());
    const array& scores = inputs[0];
    for (auto& o : outputs) o.set_data(allocator::malloc(o.nbytes()));
    const int64_t n = scores.shape(-1);
    const int64_t rows = n ? scores.size() / n : 0;
    size_t next = 1;
    const float* top = given_top_ ? inputs[next++].data<float>() : nullptr;
    const float* mask = masked_ ? inputs[next].data<float>() : nullptr;
    const int64_t mask_rows = masked_ ? inputs[next++].size() / std::max<int64_t>(n, 1) : 1;
    const float* floor = floored_ ? inputs[next++].data<float>() : nullptr;
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    for (auto& o : outputs) encoder.set_output_array(o);
    encoder.dispatch([x = scores.data<float>(), top, mask, mask_rows, floor, w = outputs[0].data<float>(),
                      s = outputs[1].data<float>(), t_out = outputs[2].data<float>(), rows, n]() {
      parallel_for(rows, 16 * n, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const float* xi = x + i * n;
          float* wi = w + i * n;
          if (mask) {
            const float* mi = mask + (i % mask_rows) * n;
            for (int64_t j = 0; j < n; ++j) wi[j] = xi[j] + mi[j];
            xi = wi;
          }
          float t;
          if (top) {
            t = top[i];
          } else {
            t = row_max(xi, static_cast<int>(n));
            if (floor && floor[i] > t) t = floor[i];
          }
          for (int64_t j = 0; j < n; ++j) wi[j] = exp_below(xi[j] - t);
          s[i] = row_sum(wi, static_cast<int>(n));
          t_out[i] = t;
        }
      });
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("ExpRows runs on the CPU only");
  }
  const char* name() const override { return "KvarnExpRows"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const ExpRows&>(other);
    return given_top_ == o.given_top_ && masked_ == o.masked_ && floored_ == o.floored_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape sums = inputs[0].shape();
    sums.back() = 1;
    return {inputs[0].shape(), sums, sums};
  }

 private:
  bool given_top_, masked_, floored_;
};

std::vector<array> exp_rows(const array& scores, std::optional<array> top, std::optional<array> mask,
                            std::optional<array> floor) {
  auto s = to_stream(Device::cpu);
  if (scores.dtype() != float32 || scores.ndim() == 0) throw std::invalid_argument("exp_rows takes float32 scores");
  std::vector<array> inputs = {scores};
  Shape sums = scores.shape();
  sums.back() = 1;
  const int64_t n = scores.shape(-1), rows = n ? scores.size() / n : 0;
  if (top && floor) throw std::invalid_argument("exp_rows takes a top or a floor, not both");
  for (const auto* one : {&top, &floor}) {
    if (*one && ((*one)->dtype() != float32 || (*one)->size() != static_cast<size_t>(rows)))
      throw std::invalid_argument("exp_rows takes float32 tops and floors, one a row of scores");
  }
  if (top) inputs.push_back(*top);
  if (mask) {
    if (mask->dtype() != float32 || mask->ndim() != 2 || mask->shape(1) != n || mask->shape(0) < 1 ||
        rows % mask->shape(0))
      throw std::invalid_argument("exp_rows takes a float32 mask [m, n] whose m divides the rows of scores");
    inputs.push_back(*mask);
  }
  if (floor) inputs.push_back(*floor);
  return array::make_arrays({scores.shape(), sums, sums}, {float32, float32, float32},
                            std::make_shared<ExpRows>(s, top.has_value(), mask.has_value(), floor.has_value()),
                            inputs);
}

// One slice's butterflies, stage by stage as MLX's hadamard_n (x + y, x - y; the last stage's times
// scale): stages 1, 2 and 4 within each group of 8 values, the wider ones over contiguous runs the
// compiler vectorizes, the last apart (no branch in the loops).
inline void butterflies(float* __restrict a, float* __restrict b, int64_t n) {
  for (int64_t t = 0; t < n; ++t) {
    const float x = a[t], y = b[t];
    a[t] = x + y;
    b[t] = x - y;
  }
}

inline void butterflies_scaled(float* __restrict a, float* __restrict b, int64_t n, float scale) {
  for (int64_t t = 0; t < n; ++t) {
    const float x = a[t], y = b[t];
    a[t] = (x + y) * scale;
    b[t] = (x - y) * scale;
  }
}

#if defined(__AVX2__)
// One in-register stage of 8 values: element i and its partner i ^ s (swapped), x + y where i is
// the pair's first (x = v[i], y its partner), x - y where it is the second (x the partner).
template <int BLEND>
inline __m256 stage8(__m256 v, __m256 swapped) {
  return _mm256_blend_ps(_mm256_add_ps(v, swapped), _mm256_sub_ps(swapped, v), BLEND);
}
#endif

inline void hadamard_slice(float* d, const float* src, int64_t w, float scale) {
  int64_t h = 1;
  if (w >= 16) {  // stages 1, 2, 4 inside each group of 8 (none of them the last)
    for (int64_t g = 0; g < w; g += 8) {
#if defined(__AVX2__)
      __m256 v = _mm256_loadu_ps(src + g);
      v = stage8<0b10101010>(v, _mm256_permute_ps(v, 0b10110001));
      v = stage8<0b11001100>(v, _mm256_permute_ps(v, 0b01001110));
      v = stage8<0b11110000>(v, _mm256_permute2f128_ps(v, v, 1));
      _mm256_storeu_ps(d + g, v);
#else
      float* v = d + g;
      std::memcpy(v, src + g, sizeof(float) * 8);
      for (int64_t s = 1; s < 8; s <<= 1)
        for (int64_t base = 0; base < 8; base += 2 * s)
          for (int64_t t = 0; t < s; ++t) {
            const float x = v[base + t], y = v[base + t + s];
            v[base + t] = x + y;
            v[base + t + s] = x - y;
          }
#endif
    }
    h = 8;
  } else {
    std::memcpy(d, src, sizeof(float) * w);
  }
  for (; 2 * h < w; h <<= 1)
    for (int64_t base = 0; base < w; base += 2 * h) butterflies(d + base, d + base + h, h);
  if (h < w) butterflies_scaled(d, d + h, h, scale);  // the last stage: h = w / 2, one run
}

// n values rounded to float16 and widened back, in place: MLX's astype(float16) then astype(float32)
// (MLX's conversion rounds to nearest even, overflows to infinity and makes every NaN its own NaN,
// 0x7D00 with the sign; F16C's rounding is the same for every other value, and a group of 8 holding
// a NaN takes MLX's conversion itself).
inline void round_to_half(float* d, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(d + i);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (!_mm256_testz_ps(nan, nan)) {
      for (int l = 0; l < 8; ++l) d[i + l] = static_cast<float>(static_cast<float16_t>(d[i + l]));
      continue;
    }
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  }
#endif
  for (; i < n; ++i) d[i] = static_cast<float>(static_cast<float16_t>(d[i]));
}

// ---------------------------------------------------------------------------------------------
// Rotate: x [..., D] float32 (any strides) -> x @ H along the last axis, H block-diagonal over slices
// of width w (a power of two dividing D), normalized by ``scale``; with ``half``, every result then
// rounded to float16 and widened back (a KVarN window's values: the contract's float16 rounding, the
// bits of astype(float16).astype(float32) without MLX's two one-thread conversions). Each slice takes
// MLX's radix-2 butterflies stage by stage (x + y, x - y; the last stage's results times scale), in
// an order whose inner loop is contiguous: every element sees the same operations as in MLX's kernel.
// A view whose last axis is contiguous (a model's keys, values and queries: [B, L, H, D] transposed)
// is read in place, row by row, on every core.
class Rotate : public UnaryPrimitive {
 public:
  Rotate(Stream s, int width, float scale, bool half) : UnaryPrimitive(s), width_(width), scale_(scale), half_(half) {}

  void eval_cpu(const std::vector<array>& given, array& out) override {
    const array& g = given[0];
    const bool in_place = g.flags().row_contiguous || g.strides().back() == 1;
    const array x = in_place ? g : row_contiguous(given, stream())[0];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    const int64_t D = x.ndim() ? x.shape(-1) : 1, rows = D ? x.size() / D : 0;
    // each row's offset: row-major over the leading axes with the view's strides
    Shape lead(x.shape().begin(), x.shape().end() - (x.ndim() ? 1 : 0));
    Strides lead_strides(x.strides().begin(), x.strides().end() - (x.ndim() ? 1 : 0));
    const bool contiguous = x.flags().row_contiguous;
    encoder.dispatch([src = x.data<float>(), dst = out.data<float>(), w = int64_t(width_), D, rows, lead,
                      lead_strides, contiguous, scale = scale_, half = half_]() {
      parallel_for(rows, 8 * D, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
          int64_t at = r * D;
          if (!contiguous) {
            at = 0;
            for (int64_t k = static_cast<int64_t>(lead.size()) - 1, rest = r; k >= 0; --k) {
              at += (rest % lead[k]) * lead_strides[k];
              rest /= lead[k];
            }
          }
          float* o = dst + r * D;
          for (int64_t c = 0; c < D; c += w) hadamard_slice(o + c, src + at + c, w, scale);
          if (half) round_to_half(o, D);
        }
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("Rotate runs on the CPU only");
  }
  const char* name() const override { return "KvarnRotate"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const Rotate&>(other);
    return width_ == o.width_ && scale_ == o.scale_ && half_ == o.half_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int width_;
  float scale_;
  bool half_;
};

array rotate(const array& x, int width, float scale, bool half) {
  auto s = to_stream(Device::cpu);
  if (x.dtype() != float32) throw std::invalid_argument("rotate takes float32");
  if (x.ndim() == 0 || width < 1 || (width & (width - 1)) || x.shape(-1) % width)
    throw std::invalid_argument("rotate takes a power-of-two width dividing the last axis");
  return array(x.shape(), float32, std::make_shared<Rotate>(s, width, scale, half), {x});
}

// ---------------------------------------------------------------------------------------------
// DecodeRecords: inputs (read row-contiguous)
//   0 q        [B, H, R, D] float32   queries, rotated and scaled; or, with rot_width > 0, as the model
//                                     gives them: rotated here (slices of rot_width, normalized by
//                                     rot_scale, as Rotate), then times scale, and the output rotated back
//   1 win_k    [Nw, H, 2G, D] float32 or float16: the layer's windows (sink, then tail)
//   2 win_v    [Nw, H, 2G, D] (as win_k)
//   3 win_ids  [B] int32              each row's window
//   4 table    [B, nb] int32          each row's record blocks (nb may be 0)
//   5 mask     [B, M, win_len + nb*G] bool, M = 1 or R (per query row)
//   6 k_codes  [N, H, D, G*bk/32] uint32   7 k_alpha [N, H, D] f16   8 k_beta [N, H, D] f16   9 k_r [N, H, G] f16
//  10 v_codes  [N, H, G, D*bv/32] uint32  11 v_alpha [N, H, G] f16   12 v_beta [N, H, G] f16  13 v_c [N, H, D] f16
// output [B, H, R, D] float32 (rotated space, normalized; with rot_width, rotated back)
struct DecodeShape {
  int B, H, R, D, G, win_len, nb, M, key_bits, value_bits, win_slots, rot_width;
  float rot_scale, scale;
};

class DecodeRecords : public UnaryPrimitive {
 public:
  DecodeRecords(Stream s, int win_len, int key_bits, int value_bits, int rot_width, float rot_scale, float scale)
      : UnaryPrimitive(s), win_len_(win_len), key_bits_(key_bits), value_bits_(value_bits), rot_width_(rot_width),
        rot_scale_(rot_scale), scale_(scale) {}

  void eval_cpu(const std::vector<array>& given, array& out) override {
    const std::vector<array> in = row_contiguous(given, stream());
    out.set_data(allocator::malloc(out.nbytes()));
    DecodeShape sh{static_cast<int>(in[0].shape(0)), static_cast<int>(in[0].shape(1)),
                   static_cast<int>(in[0].shape(2)), static_cast<int>(in[0].shape(3)),
                   static_cast<int>(in[1].shape(2) / 2), win_len_, static_cast<int>(in[4].shape(1)),
                   static_cast<int>(in[5].shape(1)), key_bits_, value_bits_, static_cast<int>(in[1].shape(2)),
                   rot_width_, rot_scale_, scale_};
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& a : in) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const bool f16_windows = in[1].dtype() == float16;
    encoder.dispatch([sh, f16_windows, q = in[0].data<float>(), win_k = in[1].data<void>(), win_v = in[2].data<void>(),
                      win_ids = in[3].data<int32_t>(), table = in[4].data<int32_t>(), mask = in[5].data<bool>(),
                      k_codes = in[6].data<uint32_t>(), k_alpha = in[7].data<float16_t>(),
                      k_beta = in[8].data<float16_t>(), k_r = in[9].data<float16_t>(),
                      v_codes = in[10].data<uint32_t>(), v_alpha = in[11].data<float16_t>(),
                      v_beta = in[12].data<float16_t>(), v_c = in[13].data<float16_t>(), o = out.data<float>()]() {
      if (f16_windows)
        run(sh, q, static_cast<const float16_t*>(win_k), static_cast<const float16_t*>(win_v), win_ids, table, mask,
            k_codes, k_alpha, k_beta, k_r, v_codes, v_alpha, v_beta, v_c, o);
      else
        run(sh, q, static_cast<const float*>(win_k), static_cast<const float*>(win_v), win_ids, table, mask, k_codes,
            k_alpha, k_beta, k_r, v_codes, v_alpha, v_beta, v_c, o);
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("DecodeRecords runs on the CPU only");
  }
  const char* name() const override { return "KvarnDecodeRecords"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const DecodeRecords&>(other);
    return win_len_ == o.win_len_ && key_bits_ == o.key_bits_ && value_bits_ == o.value_bits_ &&
           rot_width_ == o.rot_width_ && rot_scale_ == o.rot_scale_ && scale_ == o.scale_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int win_len_, key_bits_, value_bits_, rot_width_;
  float rot_scale_, scale_;

  template <class WT>
  static void run(const DecodeShape sh, const float* q, const WT* win_k, const WT* win_v, const int32_t* win_ids,
                  const int32_t* table, const bool* mask, const uint32_t* k_codes, const float16_t* k_alpha,
                  const float16_t* k_beta, const float16_t* k_r, const uint32_t* v_codes, const float16_t* v_alpha,
                  const float16_t* v_beta, const float16_t* v_c, float* o) {
    auto widths = [&](auto kb, auto vb) {
      run_bits<decltype(kb)::value, decltype(vb)::value, WT>(sh, q, win_k, win_v, win_ids, table, mask, k_codes, k_alpha,
                                                         k_beta, k_r, v_codes, v_alpha, v_beta, v_c, o);
    };
    auto by_value = [&](auto kb) {
      switch (sh.value_bits) {
        case 2: return widths(kb, std::integral_constant<int, 2>{});
        case 4: return widths(kb, std::integral_constant<int, 4>{});
        default: return widths(kb, std::integral_constant<int, 8>{});
      }
    };
    switch (sh.key_bits) {
      case 2: return by_value(std::integral_constant<int, 2>{});
      case 4: return by_value(std::integral_constant<int, 4>{});
      default: return by_value(std::integral_constant<int, 8>{});
    }
  }

  template <int KB, int VB, class WT>
  static void run_bits(const DecodeShape sh, const float* q, const WT* win_k, const WT* win_v,
                       const int32_t* win_ids, const int32_t* table, const bool* mask, const uint32_t* k_codes,
                       const float16_t* k_alpha, const float16_t* k_beta, const float16_t* k_r,
                       const uint32_t* v_codes, const float16_t* v_alpha, const float16_t* v_beta,
                       const float16_t* v_c, float* o) {
    const int B = sh.B, H = sh.H, R = sh.R, D = sh.D, G = sh.G, n = sh.win_len, nb = sh.nb;
    const int T = n + nb * G;
    const int kw = G * KB / 32;  // words a key channel
    const int vw = D * VB / 32;  // words a value token
    // one (row, KV head) an item; each thread its own scratch
    parallel_for(static_cast<int64_t>(B) * H, static_cast<int64_t>(R + 1) * T * D, [&](int64_t lo, int64_t hi) {
    std::vector<float> s(static_cast<size_t>(R) * T), codes(std::max(G, D)), acc(static_cast<size_t>(R) * std::max(G, D)),
        total(R), fa(std::max(G, D)), fb(std::max(G, D)), qa(R), qr(sh.rot_width ? static_cast<size_t>(R) * D : 0);
    const int rw = sh.rot_width;
    for (int64_t item = lo; item < hi; ++item) {
      const int b = static_cast<int>(item / H), h = static_cast<int>(item % H);
      const int w = win_ids[b];
      {
        const float* qh = q + (static_cast<size_t>(b) * H + h) * R * D;
        if (rw) {  // Rotate's butterflies on each slice, then the scale: what the caller would have done
          for (int64_t at = 0; at < static_cast<int64_t>(R) * D; at += rw) hadamard_slice(qr.data() + at, qh + at, rw, sh.rot_scale);
          for (float& x : qr) x *= sh.scale;
          qh = qr.data();
        }
        const WT* wk = win_k + ((static_cast<size_t>(w) * H + h) * sh.win_slots) * D;
        const WT* wv = win_v + ((static_cast<size_t>(w) * H + h) * sh.win_slots) * D;
        // one mask for every query row (M = 1, a decode step): what it hides is neither scored nor
        // weighted (the window's unfilled positions, a padded table's blocks); its softmax terms,
        // exp of the floor (~1.6e-38 of the largest), vanish in any sum they join
        const bool* live = sh.M == 1 ? mask + static_cast<size_t>(b) * T : nullptr;
        // scores over the window
        for (int t = 0; t < n; ++t) {
          if (live && !live[t]) {
            for (int r = 0; r < R; ++r) s[static_cast<size_t>(r) * T + t] = NEG_INF;
            continue;
          }
          const float* k = row_of(wk + static_cast<size_t>(t) * D, D, fa.data());
          for (int r = 0; r < R; ++r) s[static_cast<size_t>(r) * T + t] = dot(qh + r * D, k, D);
        }
        // scores over the records: r_g * sum_d q_d (code_dg alpha_d + beta_d), each key element
        // dequantized before its product (factored as (q * alpha) . codes + q . beta, the two terms
        // cancel where beta is large: twice the error against a float64 reference)
        for (int j = 0; j < nb; ++j) {
          if (live && std::none_of(live + n + j * G, live + n + (j + 1) * G, [](bool x) { return x; })) {
            for (int r = 0; r < R; ++r) std::fill_n(s.data() + static_cast<size_t>(r) * T + n + j * G, G, NEG_INF);
            continue;
          }
          const size_t blk = static_cast<size_t>(table[b * nb + j]) * H + h;
          to_float(k_alpha + blk * D, D, fa.data());
          to_float(k_beta + blk * D, D, fb.data());
          std::fill(acc.begin(), acc.begin() + static_cast<size_t>(R) * G, 0.0f);
          const uint32_t* kc = k_codes + blk * D * kw;
          for (int d = 0; d < D; ++d) {
            unpack<KB>(kc + static_cast<size_t>(d) * kw, G, codes.data());
            for (int r = 0; r < R; ++r) qa[r] = qh[r * D + d];
            dequantized_products(codes.data(), G, fa[d], fb[d], qa.data(), R, acc.data());
          }
          to_float(k_r + blk * G, G, fa.data());
          for (int r = 0; r < R; ++r) {
            float* sr = s.data() + static_cast<size_t>(r) * T + n + j * G;
            const float* ar = acc.data() + static_cast<size_t>(r) * G;
            for (int g = 0; g < G; ++g) sr[g] = fa[g] * ar[g];
          }
        }
        // the validity mask, the softmax's numerator and denominator
        for (int r = 0; r < R; ++r) {
          const bool* m = mask + (static_cast<size_t>(b) * sh.M + (sh.M == 1 ? 0 : r)) * T;
          float* sr = s.data() + static_cast<size_t>(r) * T;
          for (int t = 0; t < T; ++t) sr[t] = m[t] ? sr[t] : NEG_INF;
          const float top = row_max(sr, T);
          for (int t = 0; t < T; ++t) sr[t] = exp_below(sr[t] - top);
          total[r] = row_sum(sr, T);
        }
        // the weighted values: window, then records c_d * ((p * alpha) . codes[:, d] + p . beta)
        float* oh = o + (static_cast<size_t>(b) * H + h) * R * D;
        std::fill(oh, oh + static_cast<size_t>(R) * D, 0.0f);
        for (int t = 0; t < n; ++t) {
          if (live && !live[t]) continue;
          const float* v = row_of(wv + static_cast<size_t>(t) * D, D, fa.data());
          for (int r = 0; r < R; ++r) {
            const float p = s[static_cast<size_t>(r) * T + t];
            float* orow = oh + r * D;
            for (int d = 0; d < D; ++d) orow[d] = fma(p, v[d], orow[d]);
          }
        }
        for (int j = 0; j < nb; ++j) {  // records: c_d * sum_g p_g (code_gd alpha_g + beta_g)
          if (live && std::none_of(live + n + j * G, live + n + (j + 1) * G, [](bool x) { return x; })) continue;
          const size_t blk = static_cast<size_t>(table[b * nb + j]) * H + h;
          to_float(v_alpha + blk * G, G, fa.data());
          to_float(v_beta + blk * G, G, fb.data());
          std::fill(acc.begin(), acc.begin() + static_cast<size_t>(R) * D, 0.0f);
          const uint32_t* vc = v_codes + blk * G * vw;
          for (int g = 0; g < G; ++g) {
            unpack<VB>(vc + static_cast<size_t>(g) * vw, D, codes.data());
            for (int r = 0; r < R; ++r) qa[r] = s[static_cast<size_t>(r) * T + n + j * G + g];
            dequantized_products(codes.data(), D, fa[g], fb[g], qa.data(), R, acc.data());
          }
          to_float(v_c + blk * D, D, fa.data());
          for (int r = 0; r < R; ++r) {
            float* orow = oh + r * D;
            const float* ar = acc.data() + static_cast<size_t>(r) * D;
            for (int d = 0; d < D; ++d) orow[d] = fma(fa[d], ar[d], orow[d]);
          }
        }
        for (int r = 0; r < R; ++r) {
          const float inv = 1.0f / total[r];
          for (int d = 0; d < D; ++d) oh[r * D + d] *= inv;
        }
        if (rw)  // back out of the rotated space, slice by slice (Rotate's operations)
          for (int64_t at = 0; at < static_cast<int64_t>(R) * D; at += rw) {
            std::copy_n(oh + at, rw, fa.data());
            hadamard_slice(oh + at, fa.data(), rw, sh.rot_scale);
          }
      }
    }
    });
  }
};

array decode_records(const array& q, const array& win_k, const array& win_v, const array& win_ids,
                     const array& table, const array& mask, const array& k_codes, const array& k_alpha,
                     const array& k_beta, const array& k_r, const array& v_codes, const array& v_alpha,
                     const array& v_beta, const array& v_c, int win_len, int key_bits, int value_bits,
                     int rot_width, float rot_scale, float scale) {
  auto s = to_stream(Device::cpu);
  auto need = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("decode_records: ") + what);
  };
  need(q.ndim() == 4 && q.dtype() == float32, "q must be float32 [B, H, R, D]");
  const int B = q.shape(0), H = q.shape(1), R = q.shape(2), D = q.shape(3);
  need(win_k.ndim() == 4 && (win_k.dtype() == float32 || win_k.dtype() == float16) &&
           win_v.dtype() == win_k.dtype() && win_k.shape(1) == H && win_k.shape(3) == D &&
           win_v.shape() == win_k.shape(), "windows must be float32 or float16 [Nw, H, 2G, D]");
  const int G = win_k.shape(2) / 2;
  need(win_len >= 0 && win_len <= win_k.shape(2), "win_len out of range");
  need(win_ids.dtype() == int32 && win_ids.size() == static_cast<size_t>(B), "win_ids must be int32 [B]");
  need(table.dtype() == int32 && table.ndim() == 2 && table.shape(0) == B, "table must be int32 [B, nb]");
  const int nb = table.shape(1);
  need(mask.dtype() == bool_ && mask.ndim() == 3 && mask.shape(0) == B && (mask.shape(1) == 1 || mask.shape(1) == R) &&
           mask.shape(2) == win_len + nb * G, "mask must be bool [B, 1 | R, win_len + nb * G]");
  need((key_bits == 2 || key_bits == 4 || key_bits == 8) && (value_bits == 2 || value_bits == 4 || value_bits == 8),
       "code widths must be 2, 4 or 8 bits");
  need(k_codes.dtype() == uint32 && k_codes.ndim() == 4 && k_codes.shape(1) == H && k_codes.shape(2) == D &&
           k_codes.shape(3) == G * key_bits / 32, "k_codes must be uint32 [N, H, D, G * key_bits / 32]");
  need(v_codes.dtype() == uint32 && v_codes.ndim() == 4 && v_codes.shape(1) == H && v_codes.shape(2) == G &&
           v_codes.shape(3) == D * value_bits / 32, "v_codes must be uint32 [N, H, G, D * value_bits / 32]");
  const size_t N = k_codes.shape(0);
  for (const array* f : {&k_alpha, &k_beta, &v_c})
    need(f->dtype() == float16 && f->size() == N * H * D, "key factors and v_c must be float16 [N, H, D]");
  for (const array* f : {&k_r, &v_alpha, &v_beta})
    need(f->dtype() == float16 && f->size() == N * H * G, "k_r and value factors must be float16 [N, H, G]");
  need(v_codes.shape(0) == static_cast<int>(N), "key and value records disagree on their count");
  need(rot_width == 0 || (rot_width <= D && D % rot_width == 0 && (rot_width & (rot_width - 1)) == 0),
       "rot_width must be 0 or a power of two dividing D");
  std::vector<array> inputs;
  for (const array* a : {&q, &win_k, &win_v, &win_ids, &table, &mask, &k_codes, &k_alpha, &k_beta, &k_r, &v_codes,
                         &v_alpha, &v_beta, &v_c})
    inputs.push_back(*a);
  return array(q.shape(), float32,
               std::make_shared<DecodeRecords>(s, win_len, key_bits, value_bits, rot_width, rot_scale, scale), inputs);
}


// ---------------------------------------------------------------------------------------------
// QuantizeTiles: rotated tiles keys, values [n, H, G, D] (float16 or float32; D <= 128: one slice)
// -> the 8 record fields, block-major (kvarn.pool._quantize_blocks):
//   k_codes [n, H, 1, D, G*kb/32] u32   k_alpha, k_beta [n, H, 1, D] f16   k_r [n, H, 1, G] f16
//   v_codes [n, H, G, D*vb/32] u32      v_alpha, v_beta [n, H, G, 1] f16   v_c [n, H, D] f16
// Each K tile (x^T: rows channels, columns tokens) and V tile (x: rows tokens, columns channels)
// is normalized, rounded and packed as kvarn.quantize does it, operation for operation: float32
// where it is float32, its stds from float64 moments, MLX's own exp and log (so the same bits
// but for the order of the float64 sums, which the pure-MLX path leaves to OpenBLAS).
constexpr float STD_MIN = 1e-3f, STD_MAX = 1e3f, LOG_MIN = -0.3f, LOG_MAX = 10.0f;
constexpr float IMBALANCE_FLOOR = 1e-8f, STEP_MIN = 1e-10f;

inline float mlx_exp(float x) {
  return mlx::core::detail::Exp{}(x);
}
inline double mlx_exp(double x) {  // MLX's CPU exp of a float64: computed in float32
  return mlx::core::detail::Exp{}(x);
}
inline float mlx_log(float x) {
  return mlx::core::detail::Log{}(x);
}
inline float clip(float x, float lo, float hi) {
  return std::min(std::max(x, lo), hi);
}

// Sample std (float64) along rows (by_rows: of row i over its columns, column scales w) or
// along columns, of m_ij * w, from the moments of x = m and x^2 (each widened to float64 and
// squared here, in registers: the tile is read as float32, a quarter of the bytes of keeping both
// moments in float64, and the same float64 operations).
void moment_std(const float* m, int R, int C, const float* log_scale, bool by_rows, double* out, double* w,
                double* w2, double* s1, double* s2) {
  const int n = by_rows ? C : R;
  for (int k = 0; k < n; ++k) {
    w[k] = mlx_exp(-static_cast<double>(log_scale[k]));
    w2[k] = w[k] * w[k];
  }
  if (by_rows) {  // sums along a row in 8 independent lanes (one chain would be latency-bound)
    constexpr int L = 8;
    for (int i = 0; i < R; ++i) {
      double a1[L] = {}, a2[L] = {};
      const float* mi = m + static_cast<size_t>(i) * C;
      int j = 0;
      for (; j + L <= C; j += L)
        for (int l = 0; l < L; ++l) {
          const double x = mi[j + l];
          a1[l] += x * w[j + l];
          a2[l] += (x * x) * w2[j + l];
        }
      double t1 = 0.0, t2 = 0.0;
      for (int l = 0; l < L; ++l) {
        t1 += a1[l];
        t2 += a2[l];
      }
      for (; j < C; ++j) {
        const double x = mi[j];
        t1 += x * w[j];
        t2 += (x * x) * w2[j];
      }
      const double var = (t2 - t1 * t1 / n) / (n - 1);
      out[i] = std::sqrt(std::max(var, 0.0));
    }
  } else {
    std::fill(s1, s1 + C, 0.0);
    std::fill(s2, s2 + C, 0.0);
    for (int i = 0; i < R; ++i) {
      const float* mi = m + static_cast<size_t>(i) * C;
      const double wi = w[i], w2i = w2[i];
      for (int j = 0; j < C; ++j) {
        const double x = mi[j];
        s1[j] += wi * x;
        s2[j] += w2i * (x * x);
      }
    }
    for (int j = 0; j < C; ++j) {
      const double var = (s2[j] - s1[j] * s1[j] / n) / (n - 1);
      out[j] = std::sqrt(std::max(var, 0.0));
    }
  }
}

float imbalance(const float* col_std, int C, const float* row_std, int R) {
  auto ratio = [](const float* v, int n) {
    float hi = v[0], lo = v[0];
    for (int k = 1; k < n; ++k) {
      hi = std::max(hi, v[k]);
      lo = std::min(lo, v[k]);
    }
    return hi / std::max(lo, IMBALANCE_FLOOR);
  };
  return ratio(col_std, C) + ratio(row_std, R);
}

// kvarn.quantize.normalize (the moments form): the best (log_row [R], log_col [C]) of iters steps
void normalize(const float* m, int R, int C, int iters, float* best_row, float* best_col) {
  std::vector<double> w(std::max(R, C)), w2(w.size()), col64(C), row64(R), unscaled(R), s1(C), s2(C);
  std::vector<float> log_row(R, 0.0f), log_col(C, 0.0f), col_std(C), row_std(R);
  moment_std(m, R, C, log_row.data(), false, col64.data(), w.data(), w2.data(), s1.data(), s2.data());
  moment_std(m, R, C, log_col.data(), true, row64.data(), w.data(), w2.data(), s1.data(), s2.data());
  for (int j = 0; j < C; ++j) col_std[j] = static_cast<float>(col64[j]);
  for (int i = 0; i < R; ++i) row_std[i] = static_cast<float>(row64[i]);
  float best = imbalance(col_std.data(), C, row_std.data(), R);
  std::copy(log_row.begin(), log_row.end(), best_row);
  std::copy(log_col.begin(), log_col.end(), best_col);
  for (int it = 0; it < iters; ++it) {
    for (int j = 0; j < C; ++j) log_col[j] = clip(log_col[j] + mlx_log(clip(col_std[j], STD_MIN, STD_MAX)), LOG_MIN, LOG_MAX);
    moment_std(m, R, C, log_col.data(), true, unscaled.data(), w.data(), w2.data(), s1.data(), s2.data());
    for (int i = 0; i < R; ++i) {
      const float std = static_cast<float>(unscaled[i] / mlx_exp(static_cast<double>(log_row[i])));
      log_row[i] = clip(log_row[i] + mlx_log(clip(std, STD_MIN, STD_MAX)), LOG_MIN, LOG_MAX);
    }
    moment_std(m, R, C, log_row.data(), false, col64.data(), w.data(), w2.data(), s1.data(), s2.data());
    for (int j = 0; j < C; ++j) col_std[j] = static_cast<float>(col64[j] / mlx_exp(static_cast<double>(log_col[j])));
    for (int i = 0; i < R; ++i) row_std[i] = static_cast<float>(unscaled[i] / mlx_exp(static_cast<double>(log_row[i])));
    const float imb = imbalance(col_std.data(), C, row_std.data(), R);
    if (imb <= best) {  // ties go to the later iterate
      best = imb;
      std::copy(log_row.begin(), log_row.end(), best_row);
      std::copy(log_col.begin(), log_col.end(), best_col);
    }
  }
}

inline uint16_t to_half(float x) {
  return static_cast<float16_t>(x).bits_;
}

// One tile matrix m [R, C]: codes packed along each row (codes_out [R, C*bits/32]), per-row
// alpha = e_i * step_i and beta = e_i * lo_i, per-column scale f_j (float16 bits).
void quantize_matrix(const float* m, int R, int C, int bits, int iters, uint32_t* codes_out, uint16_t* alpha,
                     uint16_t* beta, uint16_t* col_scale_out) {
  std::vector<float> log_row(R), log_col(C), balanced(C);
  normalize(m, R, C, iters, log_row.data(), log_col.data());
  std::vector<float> col_scale(C);
  for (int j = 0; j < C; ++j) col_scale[j] = mlx_exp(log_col[j]);
  const float levels = static_cast<float>((1 << bits) - 1);
  const int per_word = 32 / bits, words = C * bits / 32;
  for (int i = 0; i < R; ++i) {
    const float row_scale = mlx_exp(log_row[i]);
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < C; ++j) {
      balanced[j] = m[i * C + j] / col_scale[j] / row_scale;
      lo = std::min(lo, balanced[j]);
      hi = std::max(hi, balanced[j]);
    }
    const float step = std::max((hi - lo) / levels, STEP_MIN);
    uint32_t* row_codes = codes_out + static_cast<size_t>(i) * words;
    std::fill(row_codes, row_codes + words, 0u);
    for (int j = 0; j < C; ++j) {
      const float code = clip(std::rint((balanced[j] - lo) / step), 0.0f, levels);
      row_codes[j / per_word] |= static_cast<uint32_t>(code) << (bits * (j % per_word));
    }
    alpha[i] = to_half(row_scale * step);
    beta[i] = to_half(row_scale * lo);
  }
  for (int j = 0; j < C; ++j) col_scale_out[j] = to_half(col_scale[j]);
}

class QuantizeTiles : public Primitive {
 public:
  QuantizeTiles(Stream s, int key_bits, int value_bits, int iters)
      : Primitive(s), key_bits_(key_bits), value_bits_(value_bits), iters_(iters) {}

  void eval_cpu(const std::vector<array>& given, std::vector<array>& outs) override {
    const std::vector<array> in = row_contiguous(given, stream());
    for (auto& o : outs) o.set_data(allocator::malloc(o.nbytes()));
    const int n = in[0].shape(0), H = in[0].shape(1), G = in[0].shape(2), D = in[0].shape(3);
    const bool f16 = in[0].dtype() == float16;
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& a : in) encoder.set_input_array(a);
    for (auto& o : outs) encoder.set_output_array(o);
    std::vector<void*> ptr;
    for (auto& o : outs) ptr.push_back(o.data<void>());
    encoder.dispatch([=, k = in[0].data<void>(), v = in[1].data<void>(), kb = key_bits_, vb = value_bits_,
                      iters = iters_]() {
      auto* k_codes = static_cast<uint32_t*>(ptr[0]);
      auto* k_alpha = static_cast<uint16_t*>(ptr[1]);
      auto* k_beta = static_cast<uint16_t*>(ptr[2]);
      auto* k_r = static_cast<uint16_t*>(ptr[3]);
      auto* v_codes = static_cast<uint32_t*>(ptr[4]);
      auto* v_alpha = static_cast<uint16_t*>(ptr[5]);
      auto* v_beta = static_cast<uint16_t*>(ptr[6]);
      auto* v_c = static_cast<uint16_t*>(ptr[7]);
      // one (tile, head, K or V) an item
      parallel_for(static_cast<int64_t>(n) * H * 2, static_cast<int64_t>(40) * G * D, [&](int64_t lo, int64_t hi) {
        std::vector<float> x(static_cast<size_t>(G) * D), m(x.size());
        for (int64_t item = lo; item < hi; ++item) {
          const int64_t th = item / 2;  // tile * H + head
          const bool is_key = item % 2 == 0;
          const size_t base = static_cast<size_t>(th) * G * D;
          const void* src = is_key ? k : v;
          if (f16)
            to_float(static_cast<const float16_t*>(src) + base, G * D, x.data());
          else
            std::copy(static_cast<const float*>(src) + base, static_cast<const float*>(src) + base + G * D, x.begin());
          if (is_key) {  // M = x^T: rows channels d, columns tokens g
            for (int g = 0; g < G; ++g)
              for (int d = 0; d < D; ++d) m[static_cast<size_t>(d) * G + g] = x[static_cast<size_t>(g) * D + d];
            quantize_matrix(m.data(), D, G, kb, iters, k_codes + th * D * (G * kb / 32), k_alpha + th * D,
                            k_beta + th * D, k_r + th * G);
          } else {  // M = x: rows tokens g, columns channels d
            quantize_matrix(x.data(), G, D, vb, iters, v_codes + th * G * (D * vb / 32), v_alpha + th * G,
                            v_beta + th * G, v_c + th * D);
          }
        }
      });
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("QuantizeTiles runs on the CPU only");
  }
  const char* name() const override { return "KvarnQuantizeTiles"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const QuantizeTiles&>(other);
    return key_bits_ == o.key_bits_ && value_bits_ == o.value_bits_ && iters_ == o.iters_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override {
    const int n = in[0].shape(0), H = in[0].shape(1), G = in[0].shape(2), D = in[0].shape(3);
    return {{n, H, 1, D, G * key_bits_ / 32}, {n, H, 1, D}, {n, H, 1, D}, {n, H, 1, G},
            {n, H, G, D * value_bits_ / 32}, {n, H, G, 1}, {n, H, G, 1}, {n, H, D}};
  }

 private:
  int key_bits_, value_bits_, iters_;
};

std::vector<array> quantize_tiles(const array& keys, const array& values, int key_bits, int value_bits, int iters) {
  auto s = to_stream(Device::cpu);
  if (keys.ndim() != 4 || keys.shape() != values.shape() || keys.dtype() != values.dtype() ||
      (keys.dtype() != float16 && keys.dtype() != float32))
    throw std::invalid_argument("quantize_tiles: keys and values must be float16 or float32 [n, H, G, D] alike");
  const int G = keys.shape(2), D = keys.shape(3);
  if (D > 128 || (G * key_bits) % 32 || (D * value_bits) % 32 || !(key_bits == 2 || key_bits == 4 || key_bits == 8) ||
      !(value_bits == 2 || value_bits == 4 || value_bits == 8) || G < 2 || D < 2)
    throw std::invalid_argument("quantize_tiles: D <= 128 (one slice) and 2-, 4- or 8-bit codes filling whole words");
  const int n = keys.shape(0), H = keys.shape(1);
  std::vector<Shape> shapes = {{n, H, 1, D, G * key_bits / 32}, {n, H, 1, D}, {n, H, 1, D}, {n, H, 1, G},
                               {n, H, G, D * value_bits / 32}, {n, H, G, 1}, {n, H, G, 1}, {n, H, D}};
  std::vector<Dtype> dtypes = {uint32, float16, float16, float16, uint32, float16, float16, float16};
  return array::make_arrays(shapes, dtypes, std::make_shared<QuantizeTiles>(s, key_bits, value_bits, iters),
                            {keys, values});
}


// ---------------------------------------------------------------------------------------------
// DequantizeRecords: the records ``table`` [B, nb] (fields as the pool stores them, D <= 128) ->
// rotated keys and values [B, H, nb*G, D] float32: (code * alpha + beta) * r for keys, (code *
// alpha + beta) * c for values, as kvarn.pool.dequantize_blocks computes them (no fused
// multiply-adds: the same bits), read in place instead of gathered first.
class DequantizeRecords : public Primitive {
 public:
  DequantizeRecords(Stream s, int key_bits, int value_bits)
      : Primitive(s), key_bits_(key_bits), value_bits_(value_bits) {}

  void eval_cpu(const std::vector<array>& given, std::vector<array>& outs) override {
    const std::vector<array> in = row_contiguous(given, stream());
    for (auto& o : outs) o.set_data(allocator::malloc(o.nbytes()));
    const int B = in[0].shape(0), nb = in[0].shape(1), H = in[1].shape(1), D = in[1].shape(2);
    const int G = in[5].shape(2);
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& a : in) encoder.set_input_array(a);
    for (auto& o : outs) encoder.set_output_array(o);
    encoder.dispatch([=, table = in[0].data<int32_t>(), k_codes = in[1].data<uint32_t>(),
                      k_alpha = in[2].data<float16_t>(), k_beta = in[3].data<float16_t>(),
                      k_r = in[4].data<float16_t>(), v_codes = in[5].data<uint32_t>(),
                      v_alpha = in[6].data<float16_t>(), v_beta = in[7].data<float16_t>(),
                      v_c = in[8].data<float16_t>(), ko = outs[0].data<float>(), vo = outs[1].data<float>(),
                      kb = key_bits_, vb = value_bits_]() {
      const int kw = G * kb / 32, vw = D * vb / 32;
      parallel_for(static_cast<int64_t>(B) * nb * H, static_cast<int64_t>(4) * G * D, [&](int64_t lo, int64_t hi) {
        std::vector<float> codes(std::max(G, D)), fa(std::max(G, D)), fb(std::max(G, D)), fr(std::max(G, D));
        for (int64_t item = lo; item < hi; ++item) {
          const int h = static_cast<int>(item % H);
          const int64_t bj = item / H;  // b * nb + j
          const int b = static_cast<int>(bj / nb), j = static_cast<int>(bj % nb);
          const size_t blk = static_cast<size_t>(table[bj]) * H + h;
          // out rows: [b, h, j*G + g, d]
          float* kout = ko + ((static_cast<size_t>(b) * H + h) * nb + j) * G * D;
          float* vout = vo + ((static_cast<size_t>(b) * H + h) * nb + j) * G * D;
          to_float(k_alpha + blk * D, D, fa.data());
          to_float(k_beta + blk * D, D, fb.data());
          to_float(k_r + blk * G, G, fr.data());
          const uint32_t* kc = k_codes + blk * D * kw;
          for (int d = 0; d < D; ++d) {
            unpack_bits(kc + static_cast<size_t>(d) * kw, G, kb, codes.data());
            for (int g = 0; g < G; ++g) kout[static_cast<size_t>(g) * D + d] = (codes[g] * fa[d] + fb[d]) * fr[g];
          }
          to_float(v_alpha + blk * G, G, fa.data());
          to_float(v_beta + blk * G, G, fb.data());
          to_float(v_c + blk * D, D, fr.data());
          const uint32_t* vc = v_codes + blk * G * vw;
          for (int g = 0; g < G; ++g) {
            unpack_bits(vc + static_cast<size_t>(g) * vw, D, vb, codes.data());
            float* row = vout + static_cast<size_t>(g) * D;
            for (int d = 0; d < D; ++d) row[d] = (codes[d] * fa[g] + fb[g]) * fr[d];
          }
        }
      });
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("DequantizeRecords runs on the CPU only");
  }
  const char* name() const override { return "KvarnDequantizeRecords"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const DequantizeRecords&>(other);
    return key_bits_ == o.key_bits_ && value_bits_ == o.value_bits_;
  }

 private:
  int key_bits_, value_bits_;
};

std::vector<array> dequantize_records(const array& table, const array& k_codes, const array& k_alpha,
                                      const array& k_beta, const array& k_r, const array& v_codes,
                                      const array& v_alpha, const array& v_beta, const array& v_c, int key_bits,
                                      int value_bits) {
  auto s = to_stream(Device::cpu);
  if (table.dtype() != int32 || table.ndim() != 2)
    throw std::invalid_argument("dequantize_records: table must be int32 [B, nb]");
  if (k_codes.ndim() != 4 || k_codes.dtype() != uint32 || v_codes.ndim() != 4 || v_codes.dtype() != uint32)
    throw std::invalid_argument("dequantize_records: k_codes [N, H, D, words], v_codes [N, H, G, words] uint32");
  const int H = k_codes.shape(1), D = k_codes.shape(2), G = v_codes.shape(2);
  if (!(key_bits == 2 || key_bits == 4 || key_bits == 8) || !(value_bits == 2 || value_bits == 4 || value_bits == 8) ||
      k_codes.shape(3) != G * key_bits / 32 || v_codes.shape(3) != D * value_bits / 32)
    throw std::invalid_argument("dequantize_records: 2-, 4- or 8-bit codes filling the code words");
  const size_t N = k_codes.shape(0);
  for (const array* f : {&k_alpha, &k_beta, &v_c})
    if (f->dtype() != float16 || f->size() != N * H * D)
      throw std::invalid_argument("dequantize_records: key factors and v_c float16 [N, H, D]");
  for (const array* f : {&k_r, &v_alpha, &v_beta})
    if (f->dtype() != float16 || f->size() != N * H * G)
      throw std::invalid_argument("dequantize_records: k_r and value factors float16 [N, H, G]");
  const int B = table.shape(0), nb = table.shape(1);
  Shape out = {B, H, nb * G, D};
  std::vector<array> inputs;
  for (const array* a : {&table, &k_codes, &k_alpha, &k_beta, &k_r, &v_codes, &v_alpha, &v_beta, &v_c})
    inputs.push_back(*a);
  return array::make_arrays({out, out}, {float32, float32},
                            std::make_shared<DequantizeRecords>(s, key_bits, value_bits), inputs);
}

}  // namespace

NB_MODULE(_kvarn_cpu, m) {
  m.doc() = "KVarN's CPU kernels (metal/cpu/src/kvarn_cpu.cpp)";
  m.def("exp_rows", &exp_rows, nb::arg("scores"), nb::arg("top") = nb::none(), nb::arg("mask") = nb::none(),
        nb::arg("floor") = nb::none(),
        "(exp(x - top), row sums, top) for float32 x = scores [..., n] (+ mask [m, n]); top [..., 1] given, "
        "or each row's max of x (at least floor)");
  m.def("rotate", &rotate, nb::arg("x"), nb::arg("width"), nb::arg("scale"), nb::arg("half") = false,
        "x @ H (float32) along the last axis, H the normalized Hadamard matrix block-diagonal over width; "
        "half: each result rounded to float16 and widened back");
  m.def("rope", &rope, nb::arg("x"), nb::arg("offset"), nb::arg("dims"), nb::arg("base"), nb::arg("scale"),
        "mx.fast.rope(x, dims, traditional=False, base=base, scale=scale, offset=offset) for float32 [B, N, T, D]");
  m.def("rows_matmul", &rows_matmul_of, nb::arg("x"), nb::arg("w"),
        "x @ w.T for float32 x [..., K] of 1 to 4 rows and w [N, K]: w read once (see the source)");
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("up"),
        "silu(gate) * up for float32 gate and up of one shape: MLX's bits (see the source)");
  m.def("decode_records", &decode_records, nb::arg("q"), nb::arg("win_k"), nb::arg("win_v"), nb::arg("win_ids"),
        nb::arg("table"), nb::arg("mask"), nb::arg("k_codes"), nb::arg("k_alpha"), nb::arg("k_beta"), nb::arg("k_r"),
        nb::arg("v_codes"), nb::arg("v_alpha"), nb::arg("v_beta"), nb::arg("v_c"), nb::arg("win_len"),
        nb::arg("key_bits"), nb::arg("value_bits"), nb::arg("rot_width") = 0, nb::arg("rot_scale") = 1.0f,
        nb::arg("scale") = 1.0f,
        "One decode step's attention [B, H, R, D] over float32 windows and KVarN records (see the source)");
  m.def("quantize_tiles", &quantize_tiles, nb::arg("keys"), nb::arg("values"), nb::arg("key_bits"),
        nb::arg("value_bits"), nb::arg("iters"),
        "The record fields (block-major, kvarn.pool's order) of rotated tiles [n, H, G, D], D <= 128");
  m.def("dequantize_records", &dequantize_records, nb::arg("table"), nb::arg("k_codes"), nb::arg("k_alpha"),
        nb::arg("k_beta"), nb::arg("k_r"), nb::arg("v_codes"), nb::arg("v_alpha"), nb::arg("v_beta"), nb::arg("v_c"),
        nb::arg("key_bits"), nb::arg("value_bits"),
        "Rotated keys and values [B, H, nb * G, D] float32 of the records table [B, nb] (see the source)");
}
