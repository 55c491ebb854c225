// exp in 8 AVX2 lanes, shared by decode (cpu_decode_attention.cpp) and prefill (cpu_prefill_attention.cpp) attention
// and the GEMM's fused silu (cpu_gemm.cpp) on AVX2 CPUs. Cephes expf: range reduction by ln 2 in two parts, degree-5
// polynomial, 2^n through the exponent bits; ~1 ulp (as zmm_tile.h's exp_ps).
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace ymm {
#define PC_YMM_INLINE inline __attribute__((always_inline))

// x in [-87, 88].
PC_YMM_INLINE __m256 exp_in_range(__m256 x) {
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// x <= 0 (scores minus their max): x < -87 gives ~1e-38 instead of 0 (harmless next to the max's weight of 1).
PC_YMM_INLINE __m256 exp_nonpos(__m256 x) { return exp_in_range(_mm256_max_ps(x, _mm256_set1_ps(-87.0f))); }

// Any x, clamped to [-87, 88] (past 88 the exponent bits would wrap).
PC_YMM_INLINE __m256 exp_ps(__m256 x) {
  return exp_in_range(_mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f)));
}

// silu(x) = x / (1 + exp(-x)); NaN stays NaN (x itself is in the quotient).
PC_YMM_INLINE __m256 silu_ps(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
#undef PC_YMM_INLINE
}  // namespace ymm
#endif
