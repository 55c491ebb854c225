// The GEMM tiles every packed-weight kernel shares (cpu_gemm.cpp: fp32 / bf16 panels; cpu_gemm_int4.cpp,
// cpu_gemm_int8.cpp: quantized ones): the panel shape, the AVX2 micro-kernels and their row tile, x packed into
// row tiles, a tile stored to y, the int8 activations of the quantized decode kernels. Internal to each file that
// includes it (an anonymous namespace): the tiles are inlined or instantiated where they run.
#pragma once

#include "ops.h"
#include "decode_stack_parts.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PC_AVX2 1
#include "zmm_tile.h"  // PC_AVX512 where the CPU has it
#endif

namespace {

constexpr int64_t NR = 16;  // output columns per packed panel
constexpr int64_t MR = 6;   // rows of x per micro-kernel tile
constexpr int64_t MC = 96;  // rows of x per cache block (MC x K fp32 stays in L2)
constexpr int64_t PD = 256;  // rows of a panel prefetched ahead at M <= 2 (one decode step at 1 thread: 32 rows 41%, 256 rows 83% of read bw)
// Column held by each of a bf16 panel's 16 slots (its own inverse: it swaps columns 4-7 and 8-11).
constexpr int64_t BF16_ORDER[NR] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
template <typename W>
constexpr int64_t slot(int64_t col) { return std::is_same_v<W, c10::BFloat16> ? BF16_ORDER[col] : col; }

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename W>
inline float wval(const W* p) { return static_cast<float>(*p); }
template <>
inline float wval<c10::BFloat16>(const c10::BFloat16* p) { return bf16_to_float(p->x); }

// n cache lines from p, to ask for ahead of use.
struct Lines {
  const char* p = nullptr;
  int64_t n = 0;
  void all(int hint) {  // every one left, now
#ifdef PC_AVX2
    for (; n > 0; --n, p += 64) hint == _MM_HINT_T0 ? _mm_prefetch(p, _MM_HINT_T0) : _mm_prefetch(p, _MM_HINT_T1);
#else
    (void)hint, n = 0;
#endif
  }
};

#ifdef PC_AVX2
// 16 packed weights -> two 8-lane fp32 vectors.
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
// bf16 panels are stored in BF16_ORDER, so that interleaving with zeros (one op per half) yields
// columns 0-7 and 8-15 in order: a bf16 is the top half of its fp32.
inline void load16(const c10::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

// C[R, 16] = A @ panel[K, 16], row r of A's step k at a[k * ka + r * ra] (packed [K][R]: ka = R, ra = 1; fp32 rows
// read in place: ka = 1, ra = the row stride); R <= MR, results to c (row stride 16).
// Accumulators are named variables, not an array: with an array GCC spills them every iteration.
// Lines asked for on the way, spread over the k steps: `next` (this thread's next panel, into L1: from memory, the
// first row tile of each panel waited on it) and `side` (the decode stack's next K/V rows, a LineStream's share, into
// L2).
#define PC_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int R, typename W>
__attribute__((noinline)) void micro_kernel(const float* a, int64_t ka, int64_t ra, const W* panel, int64_t K, float* c,
                                            Lines next, Lines side) {
#define PC_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
  PC_ROWS(PC_DECL)
  const int64_t most = std::max(next.n, side.n), every = most > 0 ? std::max<int64_t>(1, K / most) : K + 1;
  for (int64_t k = 0, due = every; k < K; ++k) {
    if (--due == 0) {
      if (next.n > 0) _mm_prefetch(next.p, _MM_HINT_T0), next.p += 64, --next.n;
      if (side.n > 0) _mm_prefetch(side.p, _MM_HINT_T1), side.p += 64, --side.n;
      due = every;
    }
    __m256 b0, b1;
    load16(panel + k * NR, b0, b1);
    const float* ak = a + k * ka;
#define PC_FMA(r)                                         \
    if constexpr (R > r) {                                \
      const __m256 av = _mm256_broadcast_ss(ak + r * ra); \
      c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);         \
      c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);         \
    }
    PC_ROWS(PC_FMA)
  }
#define PC_STORE(r)                                       \
  if constexpr (R > r) {                                  \
    _mm256_storeu_ps(c + r * NR, c##r##0);                \
    _mm256_storeu_ps(c + r * NR + 8, c##r##1);            \
  }
  PC_ROWS(PC_STORE)
  next.all(_MM_HINT_T0), side.all(_MM_HINT_T1);
}

// One or two rows (decode): the weights streamed from memory with every line asked for PD rows ahead. S > 1
// interleaves S accumulator sets over k (summed at the end) to hide the FMA latency, but then a row's sums differ
// from micro_kernel's (batch invariance): tile() runs S = 1, as fast here, the weight read being the bound (AMD
// Zen 3: 26-32 GB/s at one row either way).
template <int R, int S, typename W>
__attribute__((noinline)) void micro_kernel_thin(const float* a, int64_t ka, int64_t ra, const W* panel, int64_t K,
                                                 float* c) {
  __m256 acc[S][R][2];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) acc[s][r][0] = acc[s][r][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + S <= K; k += S) {
    // Decode streams every weight from memory once: ask for every cache line of it PD rows ahead
    // (8 KiB for bf16). One line 1 KiB ahead kept too few misses in flight: 10 GB/s of ~16.
    for (int64_t l = 0; l < S * NR * int64_t(sizeof(W)); l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(panel + (k + PD) * NR) + l, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      __m256 b0, b1;
      load16(panel + (k + s) * NR, b0, b1);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_broadcast_ss(a + (k + s) * ka + r * ra);
        acc[s][r][0] = _mm256_fmadd_ps(av, b0, acc[s][r][0]);
        acc[s][r][1] = _mm256_fmadd_ps(av, b1, acc[s][r][1]);
      }
    }
  }
  for (; k < K; ++k) {
    __m256 b0, b1;
    load16(panel + k * NR, b0, b1);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + k * ka + r * ra);
      acc[0][r][0] = _mm256_fmadd_ps(av, b0, acc[0][r][0]);
      acc[0][r][1] = _mm256_fmadd_ps(av, b1, acc[0][r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 lo = acc[0][r][0], hi = acc[0][r][1];
    for (int s = 1; s < S; ++s) {
      lo = _mm256_add_ps(lo, acc[s][r][0]);
      hi = _mm256_add_ps(hi, acc[s][r][1]);
    }
    _mm256_storeu_ps(c + r * NR, lo);
    _mm256_storeu_ps(c + r * NR + 8, hi);
  }
}
#define PC_THIN 1
#else
template <int R, typename W>
void micro_kernel(const float* a, int64_t ka, int64_t ra, const W* panel, int64_t K, float* c, Lines, Lines) {
  float acc[R][NR] = {};
  for (int64_t k = 0; k < K; ++k) {
    const W* b = panel + k * NR;
    for (int r = 0; r < R; ++r) {
      const float av = a[k * ka + r * ra];
      for (int j = 0; j < NR; ++j) acc[r][j] += av * wval(b + slot<W>(j));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) c[r * NR + j] = acc[r][j];
}
#endif

// A's rows as micro_kernel's (ka, ra); next / side: lines asked for on the way (micro_kernel's; before the thin
// kernels, which stream their weights).
template <typename W>
inline void tile(int64_t rows, const float* a, int64_t ka, int64_t ra, const W* panel, int64_t K, float* c,
                 Lines next = {}, Lines side = {}) {
  switch (rows) {
#ifdef PC_THIN
    // One accumulator set (S = 1): each output the same FMA chain over k as in micro_kernel, so a row's result
    // does not depend on how many rows share its step (interleaved sets, 4 at one row, broke batch invariance).
    case 1:
    case 2:
      next.all(_MM_HINT_T0), side.all(_MM_HINT_T1);
      if (rows == 1)
        micro_kernel_thin<1, 1>(a, ka, ra, panel, K, c);
      else
        micro_kernel_thin<2, 1>(a, ka, ra, panel, K, c);
      break;
#else
    case 1: micro_kernel<1>(a, ka, ra, panel, K, c, next, side); break;
    case 2: micro_kernel<2>(a, ka, ra, panel, K, c, next, side); break;
#endif
    case 3: micro_kernel<3>(a, ka, ra, panel, K, c, next, side); break;
    case 4: micro_kernel<4>(a, ka, ra, panel, K, c, next, side); break;
    case 5: micro_kernel<5>(a, ka, ra, panel, K, c, next, side); break;
    default: micro_kernel<6>(a, ka, ra, panel, K, c, next, side); break;
  }
}

// Row tile t of x (rows [t*MR, t*MR + R)) as fp32 packed [K, R] at xp + t*MR*K: the micro-kernel
// then reads A sequentially.
template <typename X>
void pack_tiles(const X* x, int64_t M, int64_t K, int64_t t0, int64_t t1, float* xp) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * MR, R = std::min(MR, M - i0);
    float* out = xp + i0 * K;
    const X* rows = x + i0 * K;
    // Writes in order (R streams read): the other way round each store landed R floats from the last one.
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < R; ++r) out[k * R + r] = static_cast<float>(rows[r * K + k]);
  }
}

// A panel widened to fp32 once, so that for many rows the micro-kernel does not convert it again
// per tile (bf16 -> fp32 costs about a third of the FMA time).
template <typename W>
const float* widen_panel(const W* panel, int64_t K, float* buf) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < NR; ++j) buf[k * NR + j] = static_cast<float>(panel[k * NR + slot<W>(j)]);
  return buf;
}
template <>
const float* widen_panel<float>(const float* panel, int64_t, float*) { return panel; }

// A computed tile (fp32, row stride 16) to y (row stride N), plus bias, rounded once to X.
template <typename X>
inline void store_tile(const float* c, int64_t rows, int64_t ncols, const float* bias, int64_t n0, X* y, int64_t N) {
#ifdef PC_AVX512
  if constexpr (std::is_same_v<X, float>) {
    if (ncols == NR) {  // a whole panel: one vector a row
      const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * N, _mm512_add_ps(_mm512_loadu_ps(c + r * NR), b));
      return;
    }
  }
#elif defined(PC_AVX2)
  if constexpr (std::is_same_v<X, float>) {
    // A whole panel: two vectors a row (the loop below became a memmove call a row, ~1% of a prompt step).
    if (ncols == NR) {
      if (bias == nullptr) {
        for (int64_t r = 0; r < rows; ++r) {
          _mm256_storeu_ps(y + r * N, _mm256_loadu_ps(c + r * NR));
          _mm256_storeu_ps(y + r * N + 8, _mm256_loadu_ps(c + r * NR + 8));
        }
        return;
      }
      const __m256 b0 = _mm256_loadu_ps(bias + n0), b1 = _mm256_loadu_ps(bias + n0 + 8);
      for (int64_t r = 0; r < rows; ++r) {
        _mm256_storeu_ps(y + r * N, _mm256_add_ps(_mm256_loadu_ps(c + r * NR), b0));
        _mm256_storeu_ps(y + r * N + 8, _mm256_add_ps(_mm256_loadu_ps(c + r * NR + 8), b1));
      }
      return;
    }
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    X* out = y + r * N;
    const float* cr = c + r * NR;
    if (bias)
      for (int64_t j = 0; j < ncols; ++j) out[j] = static_cast<X>(cr[j] + bias[n0 + j]);
    else
      for (int64_t j = 0; j < ncols; ++j) out[j] = static_cast<X>(cr[j]);
  }
}

// ---- the quantized panels' shared parts (int4: cpu_gemm_int4.cpp, int8: cpu_gemm_int8.cpp) ----------
constexpr int64_t QB = 32;  // inputs per int8 activation block
constexpr int64_t PF4 = 1024;  // bytes of a panel prefetched ahead by the decode kernels
// Up to this many fp32 rows, quantized weights are dequantized in registers for every row; more rows widen
// each panel into a [K, 16] fp32 buffer once. Widening at 2 rows measured 4x slower with 2 threads than
// with 1 here (the 36 KB buffers per thread), registers: M = 2 ~1.5 ms -> ~0.25 ms (1536 x 576, int4).
#ifdef PC_AVX2
constexpr int64_t REGISTER_ROWS = 3;
#else
constexpr int64_t REGISTER_ROWS = 0;
#endif

inline int64_t round4(int64_t K) { return (K + 3) / 4 * 4; }

// The scale/min panels' kinds: fp32 or fp16 (scale, min) pairs, or HalfZero: fp16 (scale, zero point z)
// with min = -z * scale formed in fp32 (exact: an 11-bit mantissa times a small integer), so that GPTQ's
// (q - z) * s keeps 16 bits a pair although -z * s is rarely an fp16.
struct HalfZero {};
template <typename S> struct ScaleMinStorage { using T = S; };
template <> struct ScaleMinStorage<HalfZero> { using T = c10::Half; };
template <typename S> using sm_t = typename ScaleMinStorage<S>::T;

#ifdef PC_AVX2
// 8 scales or mins as fp32.
inline __m256 load_sm(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_sm(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 8 mins for the 8 scales s.
template <typename S>
inline __m256 load_min(const sm_t<S>* p, __m256 s) {
  if constexpr (std::is_same_v<S, HalfZero>)
    return _mm256_fnmadd_ps(load_sm(p), s, _mm256_setzero_ps());
  else
    return load_sm(p);
}

// R <= 3 rows (a packed [K, R]), fp32 activations: each weight dequantized in registers and used for every
// row. One row keeps two interleaved accumulator sets (FMA latency); more rows are independent chains.
template <int R>
struct RegisterTile {
  static constexpr int I = R == 1 ? 2 : 1;
  __m256 acc[I][R][2];
  RegisterTile() {
    for (int i = 0; i < I; ++i)
      for (int r = 0; r < R; ++r) acc[i][r][0] = acc[i][r][1] = _mm256_setzero_ps();
  }
  inline void add(const float* a, int64_t k, int t, __m256 w0, __m256 w1) {
    const int i = I == 2 ? (t & 1) : 0;
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + k * R + r);
      acc[i][r][0] = _mm256_fmadd_ps(av, w0, acc[i][r][0]);
      acc[i][r][1] = _mm256_fmadd_ps(av, w1, acc[i][r][1]);
    }
  }
  void store(float* c) const {
    for (int r = 0; r < R; ++r) {
      __m256 c0 = acc[0][r][0], c1 = acc[0][r][1];
      if (I == 2) c0 = _mm256_add_ps(c0, acc[I - 1][r][0]), c1 = _mm256_add_ps(c1, acc[I - 1][r][1]);
      _mm256_storeu_ps(c + r * NR, c0);
      _mm256_storeu_ps(c + r * NR + 8, c1);
    }
  }
};
#endif

// Rows of x as int8 per block of 32 inputs (xq = round-half-even(x * (127 * (1 / max|x|))), d = max|x| / 127),
// and per row and group xs = sum over its blocks of d * sum(xq): the min term's activation sum. A block
// holding inf or NaN gets d = NaN, so it reaches the output as NaN rather than as a wrong number.
template <typename X>
void quantize_rows(const X* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* d, float* xs) {
  const int64_t blocks = K / QB, groups = K / G, per_group = G / QB;
  for (int64_t i = 0; i < M * groups; ++i) xs[i] = 0.f;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t b = 0; b < blocks; ++b) {
      float v[QB];
      uint32_t amax_bits = 0;  // max of |x| on the bits: ordered like the floats, and NaN sorts above inf
      for (int64_t j = 0; j < QB; ++j) {
        v[j] = static_cast<float>(x[i * K + b * QB + j]);
        uint32_t u;
        std::memcpy(&u, &v[j], 4);
        amax_bits = std::max(amax_bits, u & 0x7FFFFFFFu);
      }
      int8_t* out = xq + i * K + b * QB;
      float db = 0.f;
      int32_t total = 0;
      if (amax_bits >= 0x7F800000u) {
        const uint32_t nan_bits = 0x7FC00000u;
        std::memcpy(&db, &nan_bits, 4);
        std::memset(out, 0, QB);
      } else if (amax_bits == 0) {
        std::memset(out, 0, QB);
      } else {
        float amax;
        std::memcpy(&amax, &amax_bits, 4);
        const float id = 127.f * (1.f / amax);  // as written: -ffast-math may turn 127 / amax into this anyway
        db = amax / 127.f;
        for (int64_t j = 0; j < QB; ++j) {
          const int32_t qv = static_cast<int32_t>(std::nearbyint(v[j] * id));
          out[j] = static_cast<int8_t>(qv);
          total += qv;
        }
      }
      d[i * blocks + b] = db;
      xs[i * groups + b / per_group] += db * static_cast<float>(total);
    }
}
}  // namespace
