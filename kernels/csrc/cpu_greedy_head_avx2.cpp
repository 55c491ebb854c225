// The fp32 greedy head on AVX2 CPUs without AVX-512 (cpu_greedy_head.cpp has the method and its bounds): the same
// int16 x codes against the same int8 codes, widened to int16 and multiplied in pairs by vpmaddwd (16 products an
// instruction, a quarter of the fp32 panels' bytes), the same bound, and the candidates' logits as the AVX2 fp32
// panels give them: cpu_gemm.cpp's tiles run one FMA chain per output, z = fma(x_k, w_k, z) from +0 over k in order,
// at every row count, so gathering a column's weights from the head's rows [V, K] and chaining them so is bit for bit.
// bf16 heads in plain panels (where no AVX512-BF16 makes them VNNI pairs) take the same path: their tiles widen x and
// the weights to fp32 exactly and run the same chain, then store the logits rounded to bf16 (nearest even). So the
// codes and bounds are those of the widened weights; the candidates reach down to 2 bf16 ulps below the largest lower
// bound (edge<true>, as the VNNI head's), and their exact logits, gathered from the bf16 rows, are rounded before the
// argmax. Bundled model, bf16, Zen 3, one decode row: the full logits and their argmax ~1.9 ms, this ~0.5 ms.
#include "greedy_head_codes.h"

#ifdef PC_GREEDY_HEAD_AVX2
#include <immintrin.h>
#include <omp.h>

#include <limits>
#include <type_traits>

namespace greedy_codes {
namespace {
constexpr int64_t GR = 6;  // rows per tile: 12 int32 accumulators, 16 columns a row
constexpr int64_t AHEAD = 2;  // panels of codes asked for ahead of the one the first row tile reads

// acc[r][h] (columns h * 8 .. h * 8 + 7 of the panel at w) = sum over the steps of the codes widened to int16, pairs
// times row r's pair of x codes (xw[r * steps + i]); the panel AHEAD on (pf) asked for a line every other step.
template <int R>
__attribute__((noinline)) void approx_tile(const int32_t* xw, int64_t steps, const int8_t* w, const int8_t* pf,
                                           __m256i* out) {
  __m256i acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t i = 0; i < steps; ++i) {
    if (pf != nullptr && (i & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(pf + i * 32), _MM_HINT_T0);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * 32)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * 32 + 16)));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_set1_epi32(xw[r * steps + i]);
#ifdef __AVXVNNI__
      acc[r][0] = _mm256_dpwssd_avx_epi32(acc[r][0], xv, w0);
      acc[r][1] = _mm256_dpwssd_avx_epi32(acc[r][1], xv, w1);
#else
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(xv, w0));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(xv, w1));
#endif
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) out[2 * r] = acc[r][0], out[2 * r + 1] = acc[r][1];
}

void approx(int64_t rows, const int32_t* xw, int64_t steps, const int8_t* w, const int8_t* pf, __m256i* out) {
  switch (rows) {
    case 1: return approx_tile<1>(xw, steps, w, pf, out);
    case 2: return approx_tile<2>(xw, steps, w, pf, out);
    case 3: return approx_tile<3>(xw, steps, w, pf, out);
    case 4: return approx_tile<4>(xw, steps, w, pf, out);
    case 5: return approx_tile<5>(xw, steps, w, pf, out);
    default: return approx_tile<6>(xw, steps, w, pf, out);
  }
}

inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

// 8 stats of columns j.. (n of them real; the rest 0).
inline __m256 stat8(const float* st, int64_t j, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(st + j);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(st + j, _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(n)), lane));
}

// 8 fp32 -> bf16 bits, nearest even, as 8 uint16 (the hi buffer's: its input was raised first to make it an upper
// bound, so the rounding may go either way).
inline __m128i bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// 8 weights at element offsets idx of the rows, as fp32. A bf16 gather reads 4 bytes at each (the element, then the
// next one's 2 bytes, shifted out): the caller keeps the array's very last element out of it.
inline __m256 gather8(const float* rows, __m256i idx) { return _mm256_i32gather_ps(rows, idx, 4); }
inline __m256 gather8(const c10::BFloat16* rows, __m256i idx) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_i32gather_epi32(reinterpret_cast<const int*>(rows), idx, 2), 16));
}

// The exact logits of up to 16 columns cols[0, n) for one row, each the panels' chain (two chains of 8 side by side
// where n > 8, to hide the FMA latency), its weights gathered from the rows [V, K].
template <bool TWO, typename W>
void exact16(const float* x, int64_t K, const W* rows, const int32_t* cols, int64_t n, float* out) {
  alignas(32) int32_t base[16];
  for (int64_t i = 0; i < 16; ++i) base[i] = int32_t(cols[std::min<int64_t>(i, n - 1)] * K);
  __m256i i0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(base));
  __m256i i1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(base + 8));
  const __m256i one = _mm256_set1_epi32(1);
  __m256 z0 = _mm256_setzero_ps(), z1 = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 xv = _mm256_set1_ps(x[k]);
    z0 = _mm256_fmadd_ps(xv, gather8(rows, i0), z0);
    i0 = _mm256_add_epi32(i0, one);
    if constexpr (TWO) {
      z1 = _mm256_fmadd_ps(xv, gather8(rows, i1), z1);
      i1 = _mm256_add_epi32(i1, one);
    }
  }
  _mm256_store_ps(out, z0);
  _mm256_store_ps(out + 8, z1);
}

// The same chain one column at a time (std::fma rounds as the vector FMA does): a bf16 head's last column, whose
// gather would read past the rows.
inline float exact1(const float* x, int64_t K, const c10::BFloat16* row) {
  float z = 0.f;
  for (int64_t k = 0; k < K; ++k) z = std::fma(x[k], static_cast<float>(row[k]), z);
  return z;
}

// Candidates' exact logits as the panels store them: fp32, or rounded to bf16 (nearest even).
inline void exact_logits(const float* x, int64_t K, int64_t V, const float* rows, const int32_t* cols, int64_t n,
                         float* out) {
  if (n > 8)
    exact16<true>(x, K, rows, cols, n, out);
  else
    exact16<false>(x, K, rows, cols, n, out);
}
inline void exact_logits(const float* x, int64_t K, int64_t V, const c10::BFloat16* rows, const int32_t* cols,
                         int64_t n, float* out) {
  const int64_t vec = cols[n - 1] == V - 1 ? n - 1 : n;  // cols ascend: only the last can be column V - 1
  if (vec > 8)
    exact16<true>(x, K, rows, cols, vec, out);
  else if (vec > 0)
    exact16<false>(x, K, rows, cols, vec, out);
  if (vec < n) out[n - 1] = exact1(x, K, rows + (V - 1) * K);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(c10::BFloat16(out[i]));
}

// Pass 1's bounds for one row's 16 columns of panel p (acc: its two halves): the lower bounds' running max (low),
// the upper bounds rounded up to bf16 into hb (as cpu_greedy_head.cpp's argmax_rows).
inline void bound16(const RowCodes& rc, int64_t row, const __m256i* acc, int64_t j, int64_t V, const float* st,
                    float gamma, __m256& low, uint16_t* hb) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t jh = j + 8 * h, n = V - jh;
    if (n <= 0) break;
    const __m256 s = stat8(st + SCALE * V, jh, n), werr = stat8(st + WERR * V, jh, n);
    const __m256 l1 = stat8(st + L1 * V, jh, n), w1 = stat8(st + W1 * V, jh, n);
    const __m256 a = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[h]), s), _mm256_set1_ps(rc.t[row]));
    __m256 e = _mm256_mul_ps(werr, _mm256_set1_ps(rc.x1[row]));
    e = _mm256_fmadd_ps(l1, _mm256_set1_ps(rc.xerr[row]), e);
    e = _mm256_fmadd_ps(w1, _mm256_set1_ps(gamma * rc.xinf[row]), e);
    e = _mm256_fmadd_ps(abs8(a), _mm256_set1_ps(1e-6f), e);
    e = _mm256_fmadd_ps(e, _mm256_set1_ps(1.01f), _mm256_set1_ps(1e-6f));
    const __m256 hi = _mm256_add_ps(a, e);
    const __m256 in = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(std::min<int64_t>(n, 8))), lane));
    low = _mm256_max_ps(low, _mm256_blendv_ps(ninf, _mm256_sub_ps(a, e), in));
    // Rounded up: + 2^-6 |hi| (over a bf16 ulp, however the rounding goes) before the nearest-even bf16.
    const __m256 up = _mm256_add_ps(hi, _mm256_fmadd_ps(abs8(hi), _mm256_set1_ps(1.f / 64), _mm256_set1_ps(1e-30f)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hb + jh), bf16_bits(up));
  }
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
}  // namespace

template <typename W>
void argmax_rows_avx2(const RowCodes& rc, const float* x, int64_t B, int64_t K, int64_t V, int64_t P,
                      const int8_t* codes, const float* st, const W* weight, int64_t* ptok, int32_t* pcnt) {
  const float gamma = float(1.01 * (K + 2) * UNIT / (1 - (K + 2) * UNIT));
  const int64_t ps = rc.per_row * 2 * NR, VP = P * NR;  // bytes of codes a panel; hi's row stride
  const int nth = std::max<int>(1, std::min<int>(at::get_num_threads(), int(P)));
  std::vector<__m256> lower(nth * B, _mm256_set1_ps(-std::numeric_limits<float>::infinity()));
  static thread_local std::vector<uint16_t> hib;  // kept: fresh pages each call cost ~2 ms of faults at 64 rows
  if (hib.size() < size_t(B * VP)) hib.resize(B * VP);
  uint16_t* const hb = hib.data();
  // Pass 1, panels split over the threads, every row per panel (its codes then stay in L1 across the row tiles).
#pragma omp parallel num_threads(nth)
  {
    alignas(32) __m256i acc[2 * GR];
    const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t p0 = P * tid / n, p1 = P * (tid + 1) / n;
    __m256* low = lower.data() + tid * B;
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* pf = p + AHEAD < p1 ? codes + (p + AHEAD) * ps : nullptr;
      for (int64_t r0 = 0; r0 < B; r0 += GR) {
        const int64_t rows = std::min(GR, B - r0);
        approx(rows, rc.words.data() + r0 * rc.per_row, rc.per_row, codes + p * ps, r0 == 0 ? pf : nullptr, acc);
        for (int64_t r = 0; r < rows; ++r)
          bound16(rc, r0 + r, acc + 2 * r, p * NR, V, st, gamma, low[r0 + r], hb + (r0 + r) * VP);
      }
    }
  }
  // Pass 2, per row: the candidates (upper bound >= the largest lower bound) in index order, their exact logits,
  // the first of the largest.
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> cand;
    for (int64_t r = b0; r < b1; ++r) {
      if (!rc.ok[r]) continue;
      __m256 lv = lower[r];
      for (int i = 1; i < nth; ++i) lv = _mm256_max_ps(lv, lower[i * B + r]);
      const __m256 L = _mm256_set1_ps(edge<std::is_same_v<W, c10::BFloat16>>(hmax(lv)));
      cand.clear();
      for (int64_t j = 0; j < V; j += 8) {
        const __m128i h16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hb + r * VP + j));
        const __m256 h = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h16), 16));
        uint32_t m = uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(h, L, _CMP_GE_OQ)));
        if (V - j < 8) m &= (1u << (V - j)) - 1;
        for (; m != 0; m &= m - 1) cand.push_back(int32_t(j + __builtin_ctz(m)));
      }
      pcnt[r] = int32_t(cand.size());
      ptok[r] = first_largest(cand.data(), int64_t(cand.size()), [&](const int32_t* cols, int64_t n, float* out) {
        exact_logits(x + r * K, K, V, weight, cols, n, out);
      });
    }
  });
}

template void argmax_rows_avx2<float>(const RowCodes&, const float*, int64_t, int64_t, int64_t, int64_t, const int8_t*,
                                      const float*, const float*, int64_t*, int32_t*);
template void argmax_rows_avx2<c10::BFloat16>(const RowCodes&, const float*, int64_t, int64_t, int64_t, int64_t,
                                              const int8_t*, const float*, const c10::BFloat16*, int64_t*, int32_t*);
}  // namespace greedy_codes
#endif
