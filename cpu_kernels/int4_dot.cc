// Float rows times an int4 weight, the weight read as its packed nibbles: out[r, n] = sum_k x[r, k] * w[k, n].
//
// Why it exists: on a CPU XLA widens a group-wise int4 weight to float in front of its dot, writing and
// reading back four times the bytes it stored, so int4 decoded no faster than float32. A decode step has
// a handful of rows and is bound by reading the weight once, so this kernel reads each packed byte once
// and multiplies it, still packed, into every row while it is in a register.
//
// The arithmetic is llama.cpp's Q4 x Q8 dot: each row's activations are rounded to int8 with one scale
// per weight group (dx = max |x| / 127 over the group's inputs), a group's integer dot is exact, and the
// float sum is  sum_g dx[r, g] * (scale[g, n] * sum_k xq[r, k] * nibble[k, n]  +  offset[g, n] * sum_k xq[r, k])
// where a weight element is nibble * scale + offset (offset -8 * scale for the symmetric form). So the
// result differs from the float dot by the activations' rounding, not by the weight's.
//
// The weight is the params' layout (models/linear.py): qweight uint8 [K / 2, N], byte j of group g holds
// element g * group + j in its low nibble and element g * group + j + group / 2 in its high nibble. A
// byte's two nibbles are two inputs of one output, so widened to a 16-bit lane (low nibble in the low
// byte) they meet a 16-bit pair of the row's int8 activations in one multiply-add of unsigned by signed
// bytes (vpmaddubsw), which sums both products without saturating (2 * 15 * 127 < 32767).
// With AVX-512 VNNI, four packed rows' bytes are transposed so one 32-bit lane holds an output's
// four consecutive inputs (low nibbles) and four more (high nibbles), each meeting four of the row's
// int8 activations as they lie in memory in one vpdpbusd, summed exactly in int32 over the group.
//
// Compiled on the machine that runs it (-march=native, cpu_kernels/build.py): AVX-512 VNNI, AVX2 or
// plain C++.
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

// Outputs one pass accumulates in registers (two 16-lane int16 vectors per row).
constexpr int64_t kBlock = 32;
// Packed rows summed in int16 before they are widened: 8 * 2 * 15 * 127 = 30480 < 32767.
constexpr int64_t kFlushRows = 8;
// Rows multiplied in one pass over the weight (their accumulators stay in registers).
constexpr int64_t kRowGroup = 4;

// One call's activations, rounded: per row, the int8 pairs each packed byte meets, and per group
// the scale and the sum of the group's int8 values (the offset's factor).
struct Activations {
  int64_t m = 0, k = 0, groups = 0, half = 0;
  std::vector<int16_t> pairs;   // [m, k / 2]: low byte x[g * group + j], high byte x[g * group + j + half]
  std::vector<int8_t> xq;       // [m, k]: the int8 values in input order (the VNNI path's quads)
  std::vector<float> dx;        // [m, groups]
  std::vector<float> xsum;      // [m, groups]: dx * sum of the group's int8 values

  void quantize(const float* x, int64_t m_, int64_t k_, int64_t group) {
    m = m_, k = k_, groups = k_ / group, half = group / 2;
    pairs.resize(m * (k / 2));
    xq.resize(m * k);
    dx.resize(m * groups);
    xsum.resize(m * groups);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = x + r * k + g * group;
        int8_t* q = xq.data() + r * k + g * group;
        float amax = 0.f;
        for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(xg[i]));
        const float d = amax > 0.f ? amax / 127.f : 1.f;
        int32_t s = 0;
        for (int64_t i = 0; i < group; ++i) {
          q[i] = int8_t(std::nearbyint(xg[i] / d));     // |x / d| <= 127; ties to even, as jnp.round
          s += q[i];
        }
        for (int64_t j = 0; j < half; ++j)
          pairs[r * (k / 2) + g * half + j] = int16_t(uint16_t(uint8_t(q[j])) | (uint16_t(uint8_t(q[j + half])) << 8));
        dx[r * groups + g] = d;
        xsum[r * groups + g] = d * float(s);
      }
    }
  }
};

struct Weight {
  const uint8_t* q;        // [k / 2, n]
  const float* scale;      // [groups, n]
  const float* offset;     // [groups, n], or null: symmetric (offset = -8 * scale)
  int64_t n;
};

// Outputs [n0, n1) of rows [r0, r0 + rows) with plain C++: the remainder a vector pass leaves, and the
// whole kernel where no vector unit was compiled for.
void dot_plain(const Activations& a, const Weight& w, int64_t g0, int64_t g1, int64_t r0, int64_t rows, int64_t n0,
               int64_t n1, float* out) {
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int64_t c = n0; c < n1; ++c) {
      float acc = 0.f;
      for (int64_t g = g0; g < g1; ++g) {
        int32_t dot = 0;
        for (int64_t j = 0; j < a.half; ++j) {
          const int64_t row = g * a.half + j;
          const uint8_t b = w.q[row * w.n + c];
          const uint16_t p = uint16_t(a.pairs[r * (a.k / 2) + row]);
          dot += int32_t(b & 15) * int32_t(int8_t(p & 255)) + int32_t(b >> 4) * int32_t(int8_t(p >> 8));
        }
        const float s = w.scale[g * w.n + c];
        const float o = w.offset ? w.offset[g * w.n + c] : -8.f * s;
        acc += a.dx[r * a.groups + g] * float(dot) * s + a.xsum[r * a.groups + g] * o;
      }
      out[r * w.n + c] += acc;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Group g's share of kBlock outputs starting at c, for ROWS rows starting at r0, added into out.
template <int ROWS>
void group_block_avx2(const Activations& a, const Weight& w, int64_t g, int64_t r0, int64_t c, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int64_t half_k = a.k / 2;
  const float* sg = w.scale + g * w.n + c;
  for (int64_t j0 = 0; j0 < a.half; j0 += kFlushRows) {
    __m256i part[ROWS][2];
    for (int r = 0; r < ROWS; ++r) part[r][0] = part[r][1] = _mm256_setzero_si256();
    const int64_t j1 = std::min(a.half, j0 + kFlushRows);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t row = g * a.half + j;
      const uint8_t* src = w.q + row * w.n + c;
      // the 32 bytes' nibbles apart, then each byte's two side by side in a 16-bit lane (low nibble in
      // the low byte). unpack works within 128-bit halves, so `lo` holds outputs 0-7 and 16-23, `hi`
      // 8-15 and 24-31: the stores below put them back in order
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      const __m256i bl = _mm256_and_si256(b, low4);
      const __m256i bh = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
      const __m256i lo = _mm256_unpacklo_epi8(bl, bh);
      const __m256i hi = _mm256_unpackhi_epi8(bl, bh);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i xp = _mm256_set1_epi16(a.pairs[(r0 + r) * half_k + row]);
        part[r][0] = _mm256_add_epi16(part[r][0], _mm256_maddubs_epi16(lo, xp));
        part[r][1] = _mm256_add_epi16(part[r][1], _mm256_maddubs_epi16(hi, xp));
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256 d = _mm256_set1_ps(a.dx[(r0 + r) * a.groups + g]);
      float* o = out + (r0 + r) * w.n + c;
      for (int h = 0; h < 2; ++h) {       // part[r][0]: outputs 0-7 | 16-23, part[r][1]: 8-15 | 24-31
        const __m256i p = part[r][h];
        const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(p)));
        const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(p, 1)));
        const int64_t c0 = 8 * h, c1 = 16 + 8 * h;
        const __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(sg + c0), d);
        const __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(sg + c1), d);
        _mm256_storeu_ps(o + c0, _mm256_fmadd_ps(f0, s0, _mm256_loadu_ps(o + c0)));
        _mm256_storeu_ps(o + c1, _mm256_fmadd_ps(f1, s1, _mm256_loadu_ps(o + c1)));
      }
    }
  }
  // the offset's share: offset[g, n] * dx * sum(xq) (symmetric: -8 * scale)
  const float* og = w.offset ? w.offset + g * w.n + c : sg;
  for (int r = 0; r < ROWS; ++r) {
    const float xs = a.xsum[(r0 + r) * a.groups + g];
    const __m256 f = _mm256_set1_ps(w.offset ? xs : -8.f * xs);
    float* o = out + (r0 + r) * w.n + c;
    for (int v = 0; v < 4; ++v)
      _mm256_storeu_ps(o + 8 * v, _mm256_fmadd_ps(_mm256_loadu_ps(og + 8 * v), f, _mm256_loadu_ps(o + 8 * v)));
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kBlockVnni = 64;
// The permutation that makes the byte transposes below come out in output order: dword 4L + m of the
// loaded row is its dword 4m + L, so after the in-lane unpacks vector m holds outputs 16m .. 16m + 15.
inline __m512i transpose_order() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// Group g's share of kBlockVnni outputs starting at c, for ROWS rows starting at r0, added into out.
// Needs a.half % 4 == 0 (four packed rows per step).
template <int ROWS>
void group_block_vnni(const Activations& a, const Weight& w, int64_t g, int64_t r0, int64_t c, float* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i order = transpose_order();
  __m512i acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_si512();
  const int8_t* xg = a.xq.data() + r0 * a.k + g * 2 * a.half;
  for (int64_t j = 0; j < a.half; j += 4) {
    const uint8_t* src = w.q + (g * a.half + j) * w.n + c;
    __m512i b[4];
    for (int i = 0; i < 4; ++i)
      b[i] = _mm512_permutexvar_epi32(order, _mm512_loadu_si512(src + i * w.n));
    // bytes of rows j, j+1 side by side, then of j+2, j+3: each 32-bit lane one output's four bytes
    const __m512i p01l = _mm512_unpacklo_epi8(b[0], b[1]), p01h = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i p23l = _mm512_unpacklo_epi8(b[2], b[3]), p23h = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i quad[4] = {_mm512_unpacklo_epi16(p01l, p23l), _mm512_unpackhi_epi16(p01l, p23l),
                             _mm512_unpacklo_epi16(p01h, p23h), _mm512_unpackhi_epi16(p01h, p23h)};
    __m512i lo[4], hi[4];      // inputs j..j+3 (low nibbles) and j+half..j+half+3 (high nibbles)
    for (int v = 0; v < 4; ++v) {
      lo[v] = _mm512_and_si512(quad[v], low4);
      hi[v] = _mm512_and_si512(_mm512_srli_epi16(quad[v], 4), low4);
    }
    for (int r = 0; r < ROWS; ++r) {
      int32_t xl, xh;
      std::memcpy(&xl, xg + r * a.k + j, 4);
      std::memcpy(&xh, xg + r * a.k + a.half + j, 4);
      const __m512i vl = _mm512_set1_epi32(xl), vh = _mm512_set1_epi32(xh);
      for (int v = 0; v < 4; ++v) {
        acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], lo[v], vl);
        acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], hi[v], vh);
      }
    }
  }
  // the group's exact integer dots scaled, and the offset's share: offset[g, n] * dx * sum(xq)
  // (symmetric: -8 * scale)
  const float* sg = w.scale + g * w.n + c;
  const float* og = w.offset ? w.offset + g * w.n + c : sg;
  for (int r = 0; r < ROWS; ++r) {
    const __m512 d = _mm512_set1_ps(a.dx[(r0 + r) * a.groups + g]);
    const float xs = a.xsum[(r0 + r) * a.groups + g];
    const __m512 f = _mm512_set1_ps(w.offset ? xs : -8.f * xs);
    float* o = out + (r0 + r) * w.n + c;
    for (int v = 0; v < 4; ++v) {
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sg + 16 * v), d);
      __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][v]), s, _mm512_loadu_ps(o + 16 * v));
      _mm512_storeu_ps(o + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(og + 16 * v), f, y));
    }
  }
}
#endif

// Groups [g0, g1)'s share of every output of every row, added into out: a slice of the reduction, a
// contiguous run of the weight's memory read front to back.
void dot_groups(const Activations& a, const Weight& w, int64_t g0, int64_t g1, float* out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t vnni_end = a.half % 4 == 0 ? w.n / kBlockVnni * kBlockVnni : 0;
#else
  const int64_t vnni_end = 0;
#endif
  const int64_t vec_end = vnni_end + (w.n - vnni_end) / kBlock * kBlock;
  for (int64_t r0 = 0; r0 < a.m; r0 += kRowGroup) {
    const int64_t rows = std::min(kRowGroup, a.m - r0);
    for (int64_t g = g0; g < g1; ++g) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      for (int64_t c = 0; c < vnni_end; c += kBlockVnni) {
        switch (rows) {
          case 1: group_block_vnni<1>(a, w, g, r0, c, out); break;
          case 2: group_block_vnni<2>(a, w, g, r0, c, out); break;
          case 3: group_block_vnni<3>(a, w, g, r0, c, out); break;
          default: group_block_vnni<4>(a, w, g, r0, c, out); break;
        }
      }
#endif
      for (int64_t c = vnni_end; c < vec_end; c += kBlock) {
        switch (rows) {
          case 1: group_block_avx2<1>(a, w, g, r0, c, out); break;
          case 2: group_block_avx2<2>(a, w, g, r0, c, out); break;
          case 3: group_block_avx2<3>(a, w, g, r0, c, out); break;
          default: group_block_avx2<4>(a, w, g, r0, c, out); break;
        }
      }
    }
    if (vec_end < w.n) dot_plain(a, w, g0, g1, r0, rows, vec_end, w.n, out);
  }
}
#else
void dot_groups(const Activations& a, const Weight& w, int64_t g0, int64_t g1, float* out) {
  dot_plain(a, w, g0, g1, 0, a.m, 0, w.n, out);
}
#endif

// Work shared between the calling thread and the pool, as in int8_dot.cc: workers claim chunks of the
// groups until none are left, each adding into its own buffer (the caller's is the result), and the
// caller waits until every chunk is done, then adds the helpers' buffers in. Chunks rather than one
// slice per thread: a helper starts tens of microseconds late (its wake-up), and the caller goes on
// taking chunks meanwhile instead of waiting for it.
struct Shared {
  Activations a;
  Weight w;
  float* out;
  std::vector<float> partial;            // [helpers, m, n]
  std::vector<char> used;                // which helpers' buffers hold anything
  int64_t chunks, chunk;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work(int64_t worker) {
    float* dst = worker == 0 ? out : partial.data() + (worker - 1) * a.m * w.n;
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      if (worker > 0 && !used[worker - 1]) {
        std::fill(dst, dst + a.m * w.n, 0.f);
        used[worker - 1] = 1;
      }
      dot_groups(a, w, t * chunk, std::min(a.groups, (t + 1) * chunk), dst);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Int4DotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                       ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), od = offset.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || 2 * qd[0] != xd[1] || sd[1] != qd[1] || sd[0] <= 0 ||
      xd[1] % sd[0] || (xd[1] / sd[0]) % 2)
    return ffi::Error::InvalidArgument("int4_dot expects x [M, K], qweight [K / 2, N], scale [G, N] (G | K, even groups)");
  const bool symmetric = offset.element_count() == 0;
  if (!symmetric && (od.size() != 2 || od[0] != sd[0] || od[1] != sd[1]))
    return ffi::Error::InvalidArgument("int4_dot expects offset [G, N] like scale, or an empty offset");
  auto state = std::make_shared<Shared>();
  state->a.quantize(x.typed_data(), xd[0], xd[1], xd[1] / sd[0]);
  state->w = Weight{q.typed_data(), scale.typed_data(), symmetric ? nullptr : offset.typed_data(), qd[1]};
  state->out = out->typed_data();
  // Each worker reads whole packed rows, contiguous runs of memory (column slices read short runs of
  // every row and streamed the weight at half the rate). The calling thread is one of XLA's own, so it
  // works too and the pool gets one helper fewer than its threads: one per pool thread put three threads
  // on two cores and the step ran 1.4x slower (scripts/cpu_quant_matmul.py).
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  state->chunk = std::max<int64_t>(1, state->a.groups / (4 * threads));
  state->chunks = (state->a.groups + state->chunk - 1) / state->chunk;
  const int64_t helpers = std::min<int64_t>(threads - 1, state->chunks - 1);
  std::fill(state->out, state->out + state->a.m * state->w.n, 0.f);
  state->partial.resize(helpers * state->a.m * state->w.n);
  state->used.assign(helpers, 0);
  for (int64_t i = 1; i <= helpers; ++i) pool.Schedule([state, i] { state->work(i); });
  state->work(0);
  while (state->done.load(std::memory_order_acquire) < state->chunks) std::this_thread::yield();
  const int64_t size = state->a.m * state->w.n;
  for (int64_t h = 0; h < helpers; ++h) {
    if (!state->used[h]) continue;
    const float* p = state->partial.data() + h * size;
    for (int64_t i = 0; i < size; ++i) state->out[i] += p[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt4Dot, Int4DotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
