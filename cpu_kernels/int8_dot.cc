// int8 x int8 -> int32 products of a few rows with a row-major weight: out[r, n] = sum_k x[r, k] * w[n, k].
//
// Why it exists: XLA:CPU's int8 dot streams a w8a8 weight at a fraction of the memory bandwidth when the
// left side has a handful of rows (a decode step: one row per running request), and takes a slow path
// for a single row. Decoding is bound by reading the weights once per step, so this kernel reads each
// weight row once, from start to end, and multiplies it into every input row while it is in L1.
//
// The sums are exact int32 (as XLA's dot with preferred_element_type=int32), so the kernel and the dot
// it replaces agree bit for bit. Compiled on the machine that runs it (-march=native,
// cpu_kernels/build.py): AVX-512 VNNI, AVX2 or plain C++, whichever the compiler was given.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Input rows handled together: their accumulators stay in registers while one weight row streams by.
constexpr int64_t kRowGroup = 8;
// Weight rows per unit of work handed to a thread: large enough to amortize scheduling, small enough
// that two threads finish together.
constexpr int64_t kRowsPerTask = 64;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// vpdpbusd multiplies unsigned by signed bytes, so the input is shifted into [1, 255] (x + 128) and
// 128 * sum(w) is taken off afterwards; sum(w) comes from the same instruction against a vector of ones.
void dot_block(const uint8_t* xu, int64_t rows, int64_t k, const int8_t* w, int32_t* out, int64_t n_stride) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[kRowGroup];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_si512();
  __m512i wsum = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    const __m512i wv = _mm512_loadu_si512(w + i);
    wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
    for (int64_t r = 0; r < rows; ++r)
      acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(xu + r * k + i), wv);
  }
  if (i < k) {
    const __mmask64 m = (k - i) >= 64 ? ~__mmask64(0) : ((__mmask64(1) << (k - i)) - 1);
    const __m512i wv = _mm512_maskz_loadu_epi8(m, w + i);
    wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
    for (int64_t r = 0; r < rows; ++r)
      acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_maskz_loadu_epi8(m, xu + r * k + i), wv);
  }
  const int32_t bias = 128 * _mm512_reduce_add_epi32(wsum);
  for (int64_t r = 0; r < rows; ++r) out[r * n_stride] = _mm512_reduce_add_epi32(acc[r]) - bias;
}
constexpr bool kShifted = true;
#elif defined(__AVX2__)
// vpmaddubsw multiplies unsigned by signed bytes into saturating int16 pairs: |x| * (w with x's sign)
// never saturates (2 * 127 * 127 < 32767), and vpmaddwd widens the pairs to int32.
inline int32_t hsum256(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
void dot_block(const uint8_t* xu, int64_t rows, int64_t k, const int8_t* w, int32_t* out, int64_t n_stride) {
  const int8_t* x = reinterpret_cast<const int8_t*>(xu);
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m256i acc[kRowGroup];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
    for (int64_t r = 0; r < rows; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * k + i));
      const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xv), _mm256_sign_epi8(wv, xv));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, ones16));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    int32_t s = hsum256(acc[r]);
    for (int64_t j = i; j < k; ++j) s += int32_t(x[r * k + j]) * int32_t(w[j]);
    out[r * n_stride] = s;
  }
}
constexpr bool kShifted = false;
#else
void dot_block(const uint8_t* xu, int64_t rows, int64_t k, const int8_t* w, int32_t* out, int64_t n_stride) {
  const int8_t* x = reinterpret_cast<const int8_t*>(xu);
  for (int64_t r = 0; r < rows; ++r) {
    int32_t s = 0;
    for (int64_t j = 0; j < k; ++j) s += int32_t(x[r * k + j]) * int32_t(w[j]);
    out[r * n_stride] = s;
  }
}
constexpr bool kShifted = false;
#endif

// Weight rows [n0, n1) against every input row.
void dot_range(const uint8_t* xu, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1,
               int32_t* out) {
  for (int64_t r0 = 0; r0 < m; r0 += kRowGroup) {
    const int64_t rows = std::min(kRowGroup, m - r0);
    for (int64_t j = n0; j < n1; ++j) dot_block(xu + r0 * k, rows, k, w + j * k, out + r0 * n + j, n);
  }
}

// Work shared between the calling thread and the pool: tasks claim weight-row ranges until none are
// left, and the caller waits until every range is done, not until every task ran (a task the pool
// starts late finds nothing to do; the state it holds outlives the call).
struct Shared {
  std::vector<uint8_t> xu;
  const int8_t* w;
  int32_t* out;
  int64_t m, k, n, tasks;
  // w8a8's epilogue (W8A8DotImpl): each task turns its own outputs into float as soon as they are
  // summed, while they are in cache: y[r, j] = float(out[r, j]) * row_scale[r] * scale[j]
  std::vector<int32_t> acc;          // the int32 sums when the caller's output is float
  std::vector<float> row_scale;
  const float* scale = nullptr;
  float* y = nullptr;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t n0 = t * kRowsPerTask, n1 = std::min(n, n0 + kRowsPerTask);
      dot_range(xu.data(), m, k, w, n, n0, n1, out);
      if (y)
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = n0; j < n1; ++j) y[r * n + j] = float(out[r * n + j]) * row_scale[r] * scale[j];
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs every task of `state`, on the calling thread and the pool, and returns when all are done.
void run_tasks(const std::shared_ptr<Shared>& state, ffi::ThreadPool& pool) {
  state->tasks = (state->n + kRowsPerTask - 1) / kRowsPerTask;
  // The calling thread is one of XLA's own and takes a core's share, so the pool gets one thread fewer
  // than it has: one helper per pool thread put three threads on two cores, and a batch-1 w8a8 step's
  // projections took 24 ms instead of 13.7 (2-core EPYC, scripts/cpu_quant_matmul.py).
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1) - 1, state->tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->work(); });
  state->work();
  while (state->done.load(std::memory_order_acquire) < state->tasks) std::this_thread::yield();
}

std::shared_ptr<Shared> make_shared_state(int64_t m, int64_t k, int64_t n, const int8_t* w) {
  auto state = std::make_shared<Shared>();
  state->m = m, state->k = k, state->n = n, state->w = w;
  state->xu.resize(m * k);
  return state;
}

// The bytes the dot_block of this build reads: VNNI's are shifted into [1, 255].
inline uint8_t stored(int8_t v) { return kShifted ? uint8_t(int32_t(v) + 128) : uint8_t(v); }

ffi::Error Int8DotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                       ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("int8_dot expects x [M, K] and w [N, K]");
  auto state = make_shared_state(xd[0], xd[1], wd[0], w.typed_data());
  state->out = out->typed_data();
  const int8_t* xs = x.typed_data();
  for (int64_t i = 0; i < state->m * state->k; ++i) state->xu[i] = stored(xs[i]);
  run_tasks(state, pool);
  return ffi::Error::Success();
}

// w8a8's whole matmul in one call (models/linear.py's _w8a8_matmul, bit for bit): x * act_smooth
// rounded to int8 with one scale per row (max |.| / 127, ties to even), the exact int32 dot, times the
// row's scale and the weight's. One custom call instead of XLA's quantizing fusions, the dot and the
// rescaling fusion: three fewer operations per projection of a decode step.
ffi::Error W8A8DotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> smooth,
                       ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || smooth.element_count() != xd[1] ||
      scale.element_count() != wd[0])
    return ffi::Error::InvalidArgument("w8a8_dot expects x [M, K], act_smooth [K], w [N, K] and scale [N]");
  const int64_t m = xd[0], k = xd[1];
  auto state = make_shared_state(m, k, wd[0], w.typed_data());
  state->acc.resize(m * state->n);
  state->out = state->acc.data();
  state->row_scale.resize(m);
  state->scale = scale.typed_data();
  state->y = y->typed_data();
  const float* xf = x.typed_data();
  const float* sm = smooth.typed_data();
  // the same float operations as linear.py's: scale = max |x * smooth| * (1 / 127), q = x * smooth * (1 / scale)
  constexpr float kInv127 = 1.0f / 127.0f;
  std::vector<float> xs(k);
  for (int64_t r = 0; r < m; ++r) {
    float amax = 0.f;
    for (int64_t i = 0; i < k; ++i) {
      xs[i] = xf[r * k + i] * sm[i];
      amax = std::max(amax, std::fabs(xs[i]));
    }
    const float d = amax > 0.f ? amax * kInv127 : 1.f;
    const float inv = 1.f / d;
    state->row_scale[r] = d;
    for (int64_t i = 0; i < k; ++i) state->xu[r * k + i] = stored(int8_t(std::nearbyint(xs[i] * inv)));
  }
  run_tasks(state, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Dot, Int8DotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveW8A8Dot, W8A8DotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
