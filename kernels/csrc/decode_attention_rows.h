// The decode attention kernels' row-level parts (cpu_decode_attention.cpp): cache elements as fp32 (bf16, fp16,
// int8, e4m3 through a table), each position's cache-row offset from the block table, a quantized cache's row
// scales, the portable scalar scores / PV / softmax, and on AVX2 + FMA the 8-wide loads and stores, the bf16 row
// order (Rows), q's and the output's conversions, the horizontal sums, the softmax and the row prefetches. Internal to
// the file that includes it (an anonymous namespace).
#pragma once

#include "ops.h"
#include "ymm_exp.h"
#include <c10/util/Float8_e4m3fn.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PC_ATTN_AVX2 1
#endif

namespace {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {  // c10's conversion does not vectorise
  uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// e4m3 (float8_e4m3fn) -> fp32, all 256 codes, filled when the module loads.
struct Fp8Table {
  alignas(64) float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = static_cast<float>(c10::Float8_e4m3fn(uint8_t(i), c10::Float8_e4m3fn::from_bits()));
  }
};
const Fp8Table kFp8;

template <>
inline float to_float<int8_t>(int8_t x) {
  return static_cast<float>(x);
}
template <>
inline float to_float<c10::Float8_e4m3fn>(c10::Float8_e4m3fn x) {
  return kFp8.v[x.x];
}

// Element offset of the cache row (all KV heads) of each position in [p0, p1) of one sequence: rows
// are dense within a block, blocks `block_stride` elements apart (wider than a block's rows when a
// quantized block keeps its scales after them). With row_elems = Hkv and the scales' block stride,
// the same gives each position's first scale.
inline void row_offsets(const int32_t* table, int64_t p0, int64_t p1, int64_t block_size, int64_t row_elems,
                        int64_t block_stride, int64_t* off) {
  int64_t p = p0;
  while (p < p1) {
    const int64_t o = p % block_size, run = std::min(block_size - o, p1 - p);
    const int64_t base = int64_t(table[p / block_size]) * block_stride + o * row_elems;
    for (int64_t i = 0; i < run; ++i) off[p - p0 + i] = base + i * row_elems;
    p += run;
  }
}

// w[h * count + t] *= scale of (position t, KV head h / g), for all hkv * g heads: a quantized cache's
// per-row scale applied to scores (K) or softmax weights (V).
inline void apply_row_scales(float* w, int64_t hkv, int64_t g, int64_t count, const c10::Half* scales,
                             const int64_t* soff) {
  for (int64_t kv = 0; kv < hkv; ++kv) {
    for (int64_t t = 0; t < count; ++t) {
      const float f = static_cast<float>(scales[soff[t] + kv]);
      for (int64_t h = kv * g; h < (kv + 1) * g; ++h) w[h * count + t] *= f;
    }
  }
}

// ---------------------------------------------------------------- portable scalar kernels

// s[h * count + t] = q_h . k_t for the g heads of q [g, d].
template <typename T>
void scores_scalar(const float* q, int64_t g, const T* k, const int64_t* off, int64_t count, int64_t d, float* s) {
  for (int64_t t = 0; t < count; ++t) {
    const T* kr = k + off[t];
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = q + h * d;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < d; ++i) acc += qh[i] * to_float(kr[i]);
      s[h * count + t] = acc;
    }
  }
}

// acc[h] += sum_t w[h * count + t] * v_t, acc [g, d].
template <typename T>
void pv_scalar(const float* w, int64_t g, const T* v, const int64_t* off, int64_t count, int64_t d, float* acc) {
  for (int64_t t = 0; t < count; ++t) {
    const T* vr = v + off[t];
    for (int64_t h = 0; h < g; ++h) {
      const float wt = w[h * count + t];
      float* a = acc + h * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += wt * to_float(vr[i]);
    }
  }
}

// In place: s = exp(s - max(s)); returns (max, sum).
inline void softmax_scalar(float* s, int64_t count, float* m_out, float* l_out) {
  float m = -std::numeric_limits<float>::max();
  for (int64_t j = 0; j < count; ++j) m = std::max(m, s[j]);
  float l = 0.f;
  for (int64_t j = 0; j < count; ++j) {
    s[j] = std::exp(s[j] - m);
    l += s[j];
  }
  *m_out = m;
  *l_out = l;
}

#ifdef PC_ATTN_AVX2
// ---------------------------------------------------------------- AVX2 + FMA kernels
#define PC_INLINE inline __attribute__((always_inline))

template <typename T>
PC_INLINE __m256 load8(const T* p);
template <>
PC_INLINE __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
PC_INLINE __m256 load8<double>(const double* p) {
  return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(p + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(p)));
}
template <>
PC_INLINE __m256 load8<c10::Half>(const c10::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}

// A K/V row is consumed 16 elements at a time as two fp32 vectors, `lo` and `hi`. Natural order
// (elements 0..7, 8..15) except for bf16: one 32-byte load, even elements = each 32-bit lane << 16,
// odd elements = each lane & 0xffff0000 (a bf16 is the top half of an fp32). q and the V accumulators
// are kept in the same order (load_q / to_natural), so nothing is shuffled in the loops.
template <typename T>
struct Rows {
  static constexpr bool kPermuted = false;
  static PC_INLINE __m256 lo(const T* p) { return load8(p); }
  static PC_INLINE __m256 hi(const T* p) { return load8(p + 8); }
};
template <>
struct Rows<c10::BFloat16> {
  static constexpr bool kPermuted = true;
  static PC_INLINE __m256i raw(const c10::BFloat16* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static PC_INLINE __m256 lo(const c10::BFloat16* p) { return _mm256_castsi256_ps(_mm256_slli_epi32(raw(p), 16)); }
  static PC_INLINE __m256 hi(const c10::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_and_si256(raw(p), _mm256_set1_epi32(int(0xffff0000u))));
  }
};

template <>
PC_INLINE __m256 load8<int8_t>(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <>
PC_INLINE __m256 load8<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_i32gather_ps(kFp8.v, idx, 4);
}

// Natural-order fp32 vector load / store of 8 elements of any cache or query dtype.
template <>
PC_INLINE __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
template <typename Q>
PC_INLINE void store8(Q* o, __m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) o[i] = static_cast<Q>(f[i]);
}
template <>
PC_INLINE void store8<float>(float* o, __m256 v) {
  _mm256_storeu_ps(o, v);
}
#ifdef __F16C__
template <>
PC_INLINE void store8<c10::Half>(c10::Half* o, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif
template <>
PC_INLINE void store8<c10::BFloat16>(c10::BFloat16* o, __m256 v) {  // round to nearest even, as c10 does
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// q[0..d) = scale * x[0..d) (natural order, d % 16 == 0), stored in Rows<T> order.
template <typename T, typename Q>
inline void load_q(float* q, const Q* x, int64_t d, float scale) {
  const __m256 vs = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < d; j += 16) {
    __m256 n0 = _mm256_mul_ps(load8(x + j), vs), n1 = _mm256_mul_ps(load8(x + j + 8), vs);
    if constexpr (Rows<T>::kPermuted) {  // (0..7, 8..15) -> (0, 2, .., 14), (1, 3, .., 15)
      const __m256 e = _mm256_shuffle_ps(n0, n1, _MM_SHUFFLE(2, 0, 2, 0));
      const __m256 o = _mm256_shuffle_ps(n0, n1, _MM_SHUFFLE(3, 1, 3, 1));
      n0 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
      n1 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
    }
    _mm256_storeu_ps(q + j, n0);
    _mm256_storeu_ps(q + j + 8, n1);
  }
}

// acc[0..d) (Rows<T> order) back to natural order, in place.
template <typename T>
inline void to_natural(float* acc, int64_t d) {
  if constexpr (Rows<T>::kPermuted) {
    for (int64_t j = 0; j < d; j += 16) {
      const __m256 e = _mm256_loadu_ps(acc + j), o = _mm256_loadu_ps(acc + j + 8);
      const __m256 l = _mm256_unpacklo_ps(e, o), h = _mm256_unpackhi_ps(e, o);  // (0..3 | 8..11), (4..7 | 12..15)
      _mm256_storeu_ps(acc + j, _mm256_permute2f128_ps(l, h, 0x20));
      _mm256_storeu_ps(acc + j + 8, _mm256_permute2f128_ps(l, h, 0x31));
    }
  }
}

// out[0..d) = acc[0..d) * inv, acc in natural order.
template <typename Q>
inline void store_out(Q* out, const float* acc, int64_t d, float inv) {
  const __m256 vi = _mm256_set1_ps(inv);
  for (int64_t j = 0; j < d; j += 8) store8(out + j, _mm256_mul_ps(_mm256_loadu_ps(acc + j), vi));
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// (sum a0, sum a1, sum a2, sum a3)
PC_INLINE __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

using ymm::exp_nonpos;  // ymm_exp.h

inline void softmax_avx2(float* s, int64_t count, float* m_out, float* l_out) {
  __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::max());
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4)));
  for (; j < count; ++j) m = std::max(m, s[j]);
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 vl = _mm256_setzero_ps();
  for (j = 0; j + 8 <= count; j += 8) {
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmax));
    _mm256_storeu_ps(s + j, e);
    vl = _mm256_add_ps(vl, e);
  }
  if (j < count) {  // the tail through a padded copy; the pads are masked out of the sum
    alignas(32) float tail[8];
    const int64_t r = count - j;
    for (int i = 0; i < 8; ++i) tail[i] = i < r ? s[j + i] : m;
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_load_ps(tail), vmax));
    _mm256_store_ps(tail, e);
    const __m256 keep = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(int(r)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    vl = _mm256_add_ps(vl, _mm256_and_ps(e, keep));
    for (int64_t i = 0; i < r; ++i) s[j + i] = tail[i];
  }
  *m_out = m;
  *l_out = hsum(vl);
}

// Bring a row's d elements (from p) towards L1 ahead of use.
template <typename T>
PC_INLINE void prefetch_row(const T* p, int64_t d) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < d * int64_t(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

template <typename T>
PC_INLINE void prefetch_row_l2(const T* p, int64_t d) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < d * int64_t(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}
#endif  // PC_ATTN_AVX2

}  // namespace
