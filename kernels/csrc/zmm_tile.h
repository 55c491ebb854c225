// The AVX-512 fp32 tile of the GEMM (cpu_gemm.cpp), shared with prefill attention (cpu_prefill_attention.cpp):
// C[R, 16 P] = A @ P adjacent 16-column panels, row r of A's step k at a[k * ka + r * ra] (packed [K][R]: ka = R,
// ra = 1; fp32 rows in place: ka = 1, ra = the row stride), panel q's step k at b + (q % 2) * ps + (q / 2) * hs +
// k * 16 (adjacent panels: hs = 2 ps; a fused gate/up weight's gate panels p, p + 1 beside up's p, p + 1: hs = the
// up half's offset). Results go to c as P tiles of [6, 16].
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PC_AVX512 1

namespace zmm {
constexpr int64_t NR = 16;  // columns per panel
constexpr int64_t MR = 6;   // rows per tile
// R x P zmm accumulators (6 x 4 = 24 of the 32 registers): per k, P panel loads and R broadcasts feed R * P FMAs,
// so the loads keep up with both FMA ports; the 6 x 16 AVX2 tile ran at about half the rate of torch's AVX-512
// sgemm here (bench linears, M >= 64). pf_n cache lines from pf are prefetched every pf_every k (pf_n 0: none).
constexpr int64_t PZ = 4;  // panels per tile
#define PC_PANELS(X, r) X(r, 0) X(r, 1) X(r, 2) X(r, 3)
#define PC_ROWS_PANELS(X) PC_PANELS(X, 0) PC_PANELS(X, 1) PC_PANELS(X, 2) PC_PANELS(X, 3) PC_PANELS(X, 4) PC_PANELS(X, 5)
template <int R, int P>
__attribute__((noinline)) void micro_kernel_zmm(const float* a, int64_t ka, int64_t ra, const float* b, int64_t ps,
                                                int64_t hs, int64_t K, float* c, const char* pf, int64_t pf_n,
                                                int64_t pf_every) {
#define PZ_DECL(r, p) __m512 z##r##p = _mm512_setzero_ps();
  PC_ROWS_PANELS(PZ_DECL)
  for (int64_t k = 0, countdown = pf_every; k < K; ++k) {
    const float* bk = b + k * NR;
    const __m512 b0 = _mm512_loadu_ps(bk);
    const __m512 b1 = P > 1 ? _mm512_loadu_ps(bk + ps) : b0;
    const __m512 b2 = P > 2 ? _mm512_loadu_ps(bk + hs) : b0;
    const __m512 b3 = P > 3 ? _mm512_loadu_ps(bk + hs + ps) : b0;
    const float* ak = a + k * ka;
    if (pf_n > 0 && --countdown == 0) {
      countdown = pf_every;
      for (int64_t l = 0; l < pf_n; ++l) _mm_prefetch(pf + l * 64, _MM_HINT_T1);
      pf += pf_n * 64;
    }
#define PZ_FMA(r, p) \
    if constexpr (R > r && P > p) z##r##p = _mm512_fmadd_ps(_mm512_set1_ps(ak[r * ra]), b##p, z##r##p);
    PC_ROWS_PANELS(PZ_FMA)
  }
#define PZ_STORE(r, p) \
  if constexpr (R > r && P > p) _mm512_storeu_ps(c + p * MR * NR + r * NR, z##r##p);
  PC_ROWS_PANELS(PZ_STORE)
}

template <int R>
inline void tile_zmm_rows(int64_t np, const float* a, int64_t ka, int64_t ra, const float* b, int64_t ps, int64_t hs, int64_t K, float* c, const char* pf,
                          int64_t pf_n, int64_t pf_every) {
  switch (np) {
    case 1: return micro_kernel_zmm<R, 1>(a, ka, ra, b, ps, hs, K, c, pf, pf_n, pf_every);
    case 2: return micro_kernel_zmm<R, 2>(a, ka, ra, b, ps, hs, K, c, pf, pf_n, pf_every);
    case 3: return micro_kernel_zmm<R, 3>(a, ka, ra, b, ps, hs, K, c, pf, pf_n, pf_every);
    default: return micro_kernel_zmm<R, 4>(a, ka, ra, b, ps, hs, K, c, pf, pf_n, pf_every);
  }
}

inline void tile_zmm(int64_t rows, int64_t np, const float* a, int64_t ka, int64_t ra, const float* b, int64_t ps,
                     int64_t hs, int64_t K, float* c, const char* pf, int64_t pf_n, int64_t pf_every = 1) {
  switch (rows) {
    case 1: return tile_zmm_rows<1>(np, a, ka, ra, b, ps, hs, K, c, pf, pf_n, pf_every);
    case 2: return tile_zmm_rows<2>(np, a, ka, ra, b, ps, hs, K, c, pf, pf_n, pf_every);
    case 3: return tile_zmm_rows<3>(np, a, ka, ra, b, ps, hs, K, c, pf, pf_n, pf_every);
    case 4: return tile_zmm_rows<4>(np, a, ka, ra, b, ps, hs, K, c, pf, pf_n, pf_every);
    case 5: return tile_zmm_rows<5>(np, a, ka, ra, b, ps, hs, K, c, pf, pf_n, pf_every);
    default: return tile_zmm_rows<6>(np, a, ka, ra, b, ps, hs, K, c, pf, pf_n, pf_every);
  }
}

// Row tile t of a block of m rows cut into `tiles` tiles of near-equal size (8 rows as 4 + 4, not 6 + 2: the 2-row
// tile's 8 accumulators ran behind its loads, and 8-row decode steps took their weights' read + the tile's time; 64
// rows as 9 x 6 + 2 x 5, not 10 x 6 + 4). The bf16 dp tiles' and the greedy head's.
inline int64_t tile_start(int64_t m, int64_t tiles, int64_t t) { return t * (m / tiles) + std::min(t, m % tiles); }

// The next panel group's `lines` cache lines asked for evenly over `steps` k steps (its row tiles): n lines every
// `every` k. Crowded into the first tiles, at one line or more per k, they had the core wait on its line fill
// buffers there (standalone, 2 threads, fp32, weights from memory: M = 64 down_proj 382 -> 354 us, gate/up 765 -> 697).
struct PrefetchSpread {
  int64_t n = 0, every = 1;
  PrefetchSpread(int64_t lines, int64_t steps) {
    if (lines <= 0 || steps <= 0) return;
    if (lines >= steps) {
      n = (lines + steps - 1) / steps;
    } else {
      n = 1;
      every = steps / lines;
    }
  }
  int64_t per_tile(int64_t K) const { return K / every * n; }  // lines a tile of K steps asks for
};

// A packed [K][rows] (the common case).
inline void tile_zmm(int64_t rows, int64_t np, const float* a, const float* b, int64_t ps, int64_t K, float* c,
                     const char* pf, int64_t pf_n) {
  tile_zmm(rows, np, a, rows, 1, b, ps, 2 * ps, K, c, pf, pf_n);
}

// exp in 16 lanes, x clamped to [-87, 88]: Cephes' expf (~1 ulp) as in cpu_decode_attention.cpp, in AVX-512 (GCC
// leaves std::exp scalar).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// silu(x) = x / (1 + exp(-x)); NaN stays NaN (x itself is in the quotient).
inline __m512 silu_ps(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

#if defined(__AVX512BF16__)
// x rounded to bf16 (nearest even) and widened back.
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
#endif

// out[r, 0:16) = silu(g[r] + bias_g) * (u[r] + bias_u) from two computed tiles (row stride 16), rounded where the
// unfused ops round (to X after the matmul, after silu, after the product: silu_and_mul_row).
template <typename X>
inline void store_silu_mul(const float* g, const float* u, int64_t rows, const float* bias, int64_t ng, int64_t nu,
                           X* out, int64_t ldo) {
  const __m512 bg = bias ? _mm512_loadu_ps(bias + ng) : _mm512_setzero_ps();
  const __m512 bu = bias ? _mm512_loadu_ps(bias + nu) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    __m512 gv = _mm512_add_ps(_mm512_loadu_ps(g + r * NR), bg), uv = _mm512_add_ps(_mm512_loadu_ps(u + r * NR), bu);
    if constexpr (std::is_same_v<X, float>) {
      _mm512_storeu_ps(out + r * ldo, _mm512_mul_ps(zmm::silu_ps(gv), uv));
#if defined(__AVX512BF16__)
    } else if constexpr (std::is_same_v<X, c10::BFloat16>) {
      // In vectors (element by element this epilogue cost ~0.1 ms a layer at 64 rows): the same roundings, to
      // nearest even as c10::BFloat16 rounds.
      const __m512 s = round_bf16(zmm::silu_ps(round_bf16(gv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, round_bf16(uv))));
#endif
    } else {
      alignas(64) float t[NR], v[NR];
      _mm512_store_ps(t, gv);
      _mm512_store_ps(v, uv);
      for (int64_t j = 0; j < NR; ++j) t[j] = static_cast<float>(static_cast<X>(t[j]));
      _mm512_store_ps(t, zmm::silu_ps(_mm512_load_ps(t)));
      for (int64_t j = 0; j < NR; ++j)
        out[r * ldo + j] = static_cast<X>(static_cast<float>(static_cast<X>(t[j])) * static_cast<float>(static_cast<X>(v[j])));
    }
  }
}

}  // namespace zmm
#endif
