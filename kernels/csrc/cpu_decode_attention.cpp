// Paged decode attention for the CPU: one query token per sequence, read straight from the block
// table (no gathered copy, no padding), fp32 math and accumulation.
//
// Work item = one sequence (or, with several threads and a sequence much longer than the rest of the
// step, one partition of its positions). Two passes per item:
//   1. scores [Hq, count]: the scale is folded into q; for a few positions at a time, every KV head's
//      key row is widened to fp32 once and FMA'd into the accumulators of all `group = Hq / Hkv` query
//      heads that read it (3 keys x 3 heads or 4 keys x 2 heads per register tile), one horizontal
//      reduction then yields 3-4 scores. Whole cache rows (all KV heads) are consumed together, so
//      blocks are read sequentially; K rows are software-prefetched 16 positions ahead, and the V row of
//      the same position into L2 beside it: the pass is bound by loads in flight, not arithmetic, and two
//      streams took a batch-64 step's attention from ~15 to ~12 ms (an AVX-512 rewrite of the loops, half
//      the instructions, had changed nothing). With AVX512-BF16, a bf16 query and cache and head_dim 64 or 128,
//      the dot products run on vdpbf16ps instead (scores_dp: q as it is, 4 keys x up to 4 heads a tile, one
//      reduction tree a tile): 64 sequences x 140 positions, one layer, 2 threads (Zen 4), K/V in L3 ~240 -> ~185 us,
//      from memory ~5-10% less.
//   2. softmax per head (AVX2 Cephes-style exp, ~1 ulp), then the weighted sum of V rows: tiles of
//      positions whose rows stay in L1 while each (head sub-group, 16-column block) pass goes over them (on
//      AVX-512, 3-head groups of head_dim 64: whole rows in zmm, one pass, the same FMA chains). A bf16 cache
//      with AVX512-BF16 and head_dim 64 or 128 takes vdpbf16ps instead (pv_dp): the weights rounded to bf16, as
//      torch's CPU flash attention rounds P, two positions a dot product, and the output divided by the rounded
//      weights' sum. From L2 PV had run at the FMA peak; on Zen 4 a 64-row step's attention ~13.8 -> ~12.1 ms
//      (30 layers, 64 x ~135 positions); accuracy against fp64 1.39e-3 -> 1.46e-3 (the bf16 output's rounding
//      dominates); over 48 chat prompts the engine's bf16 greedy text follows transformers' bf16 for 14.2 tokens
//      on average before a near-tie parts them, 12.4 with fp32 weights (torch rounds P too).
// In the decode stack at 8+ rows, the rows a layer's items read were asked for during the previous layer's gate/up
// GEMM (kv_lines, LineStream): from L3 rather than memory, a 64-row step's attention ~11.8 -> ~8.1 ms on Zen 4 (VNNI
// tiles), ~19 -> ~13 ms on an AVX2 Zen 3 (fp32 panels).
// bf16 K/V are widened in registers with one 32-byte load per 16 elements: even elements = lane << 16,
// odd ones = lane & 0xffff0000 (a bf16 is the top half of an fp32); q and the V accumulators are kept
// in that (even, odd) order, so the loops never shuffle. fp16 goes through F16C.
// Split sequences (flash-decoding): each partition keeps its max and sum, a cheap combine rescales.
// Only positions < seq_len (inside the window) are ever read: unwritten cache slots may hold NaN.
// Quantized caches (kv_cache_dtype int8 / fp8_e4m3, kernels/kv_quant.py): int8 rows are widened to fp32
// in registers (sign-extend, convert), e4m3 rows through a 256-entry table; the fp16 scale of each
// (position, KV head) multiplies its score after the dot product, and its softmax weight before the
// weighted sum of V, so the inner loops never touch the scales.
//
// AVX2 + FMA path for head_dim % 16 == 0 (head_dim 64 and 128 compiled as constants); a portable
// scalar path with the same structure otherwise, or when built without AVX2.
#include "ops.h"
#include "decode_stack_parts.h"
#include "ymm_exp.h"
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PC_ATTN_AVX2 1
#endif

namespace {

// Positions per partition when a sequence is split across threads. Fixed, not a share of the step's positions:
// a sequence's partitions then depend on its own length alone, so its logprobs do not move by ulps with the
// batch it shares a step with (a share of the step split a long sequence only once the batch had thinned).
// 30 layers, 2 threads (an AVX-512 Xeon), against the share: 64 sequences x 100-250 positions 26.6 -> 25.2 ms, x 300-600 67.4 ->
// 66.8, 2 x 1500-3000 11.0 -> 10.8, 8 x 800-2000 27.1 -> 28.8 (more partitions, combined on one thread).
constexpr int64_t kPart = 256;
// An item's fixed work (its query, softmax set-up, output) in positions' worth, for the threads' shares.
constexpr int64_t kItemCost = 8;

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

// Scores of NT keys (rows k[0..NT)) against G query heads q [G, d] -> s[h * stride + 0..NT), NT <= 4.
// G * NT accumulators + NT rows + q + the bf16 mask fit the 16 ymm registers for (G, NT) = (3, 3),
// (2, 4), (1, 4).
template <typename T, int G, int NT, int D>
PC_INLINE void scores_tile(const float* q, const T* const* k, int64_t d_, float* s, int64_t stride) {
  using R = Rows<T>;
  const int64_t d = D > 0 ? D : d_;  // D: head_dim known at compile time (0: not)
  __m256 a[NT][G];
  {
    __m256 x[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) x[t] = R::lo(k[t]);
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * d);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) a[t][h] = _mm256_mul_ps(x[t], qv);
    }
  }
#pragma GCC unroll 8
  for (int64_t i = 0; i < d; i += 16) {
    if (i > 0) {
      __m256 x[NT];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) x[t] = R::lo(k[t] + i);
#pragma GCC unroll 4
      for (int h = 0; h < G; ++h) {
        const __m256 qv = _mm256_loadu_ps(q + h * d + i);
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) a[t][h] = _mm256_fmadd_ps(x[t], qv, a[t][h]);
      }
    }
    __m256 x[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) x[t] = R::hi(k[t] + i);
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * d + i + 8);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) a[t][h] = _mm256_fmadd_ps(x[t], qv, a[t][h]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h) {
    if constexpr (NT == 4) {
      _mm_storeu_ps(s + h * stride, hsum4(a[0][h], a[1][h], a[2][h], a[3][h]));
    } else {
      alignas(16) float r[4];
      _mm_store_ps(r, hsum4(a[0][h], a[NT > 1 ? 1 : 0][h], a[NT > 2 ? 2 : 0][h], a[0][h]));
      for (int t = 0; t < NT; ++t) s[h * stride + t] = r[t];
    }
  }
}

// s[h * count + t] = q_h . k_t for all heads h = kv * g + j (q [hkv * g, d] in Rows<T> order; key row t
// of KV head kv at k + off[t] + kv * d). A group of 3 (or 6, 9, ..) heads takes 3 keys at a time in
// sub-groups of 3, any other group 4 keys at a time in sub-groups of 2 (and 1). All KV heads of a
// few positions are done together: whole cache rows (contiguous within a block) are consumed at
// once. Prefetches rows PF positions ahead (K, then the first V rows at vb for the pass after).
template <typename T, int D>
void scores_avx2(const float* q, int64_t hkv, int64_t g, const T* k, const T* vb, const int64_t* off, int64_t count,
                 int64_t d_, int64_t row_elems, float* s) {
  const int64_t d = D > 0 ? D : d_;
  constexpr int64_t PF = 16;
  const bool by3 = g % 3 == 0;
  const int64_t step = by3 ? 3 : 4;
  for (int64_t t = 0; t < std::min(count, PF); ++t) prefetch_row(k + off[t], row_elems);
  int64_t t = 0;
  for (; t + step <= count; t += step) {
    for (int64_t u = t + PF; u < t + PF + step; ++u) {
      if (u < count) {
        prefetch_row(k + off[u], row_elems);
        prefetch_row_l2(vb + off[u], row_elems);  // V into L2 alongside: two streams in flight
      } else if (u - count < std::min(count, PF)) {
        prefetch_row(vb + off[u - count], row_elems);  // off has count rows
      }
    }
    for (int64_t kv = 0; kv < hkv; ++kv) {
      const T* kk = k + kv * d;
      const T* rows[4] = {kk + off[t], kk + off[t + 1], kk + off[t + 2], kk + off[t + step - 1]};
      const int64_t h0 = kv * g;
      if (by3) {
        for (int64_t h = h0; h < h0 + g; h += 3) scores_tile<T, 3, 3, D>(q + h * d, rows, d, s + h * count + t, count);
      } else {
        int64_t h = h0;
        for (; h + 2 <= h0 + g; h += 2) scores_tile<T, 2, 4, D>(q + h * d, rows, d, s + h * count + t, count);
        if (h < h0 + g) scores_tile<T, 1, 4, D>(q + h * d, rows, d, s + h * count + t, count);
      }
    }
  }
  for (; t < count; ++t) {
    for (int64_t kv = 0; kv < hkv; ++kv) {
      const T* rows[1] = {k + kv * d + off[t]};
      const int64_t h0 = kv * g;
      int64_t h = h0;
      for (; h + 2 <= h0 + g; h += 2) scores_tile<T, 2, 1, D>(q + h * d, rows, d, s + h * count + t, count);
      if (h < h0 + g) scores_tile<T, 1, 1, D>(q + h * d, rows, d, s + h * count + t, count);
    }
  }
}

#if defined(__AVX512BF16__)
// Scores of a bf16 query against a bf16 cache on vdpbf16ps: one instruction multiplies 32 elements of a key row by
// the query head's and sums them in pairs into 16 fp32 lanes (no widening, twice an fp32 FMA's products), q used as
// it is (bf16, exact) and the scale applied to the dot product. A tile holds G heads x 4 keys of zmm accumulators;
// a transpose-and-add tree then reduces the 16 (G < 4: padded) of them into one zmm, head h's 4 scores in its
// 128-bit lane h (~3 instructions a score, where one reduction each took ~8).
PC_INLINE __m512 sum_pairs(__m512 a, __m512 b) {  // per 128-bit lane: (a, b, a, b) partial sums
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
PC_INLINE __m512 sum_quads(__m512 ab, __m512 cd) {  // per 128-bit lane: (a, b, c, d)
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
PC_INLINE __m512 sum_lanes(__m512 a, __m512 b) {  // lanes (a0 + a1, a2 + a3, b0 + b1, b2 + b3)
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

// s[h * stride + t] = scale * q_h . k_t for G <= 4 heads (q_h at q + h * qs) and keys t < n of k[0..4), C * 32
// elements a row (k[t >= n] repeat a valid row: computed, not stored).
template <int G, int C>
PC_INLINE void scores_tile_dp(const c10::BFloat16* q, int64_t qs, const c10::BFloat16* const* k, float scale,
                              float* s, int64_t stride, int64_t n) {
  __m512 a[G][4];
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) a[h][t] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    __m512bh qv[G];
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) qv[h] = (__m512bh)_mm512_loadu_si512(q + h * qs + 32 * c);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(k[t] + 32 * c);
#pragma GCC unroll 4
      for (int h = 0; h < G; ++h) a[h][t] = _mm512_dpbf16_ps(a[h][t], kv, qv[h]);
    }
  }
  __m512 u[4];
#pragma GCC unroll 4
  for (int h = 0; h < 4; ++h)
    u[h] = h < G ? sum_quads(sum_pairs(a[h][0], a[h][1]), sum_pairs(a[h][2], a[h][3])) : _mm512_setzero_ps();
  alignas(64) float w[16];
  _mm512_store_ps(w, _mm512_mul_ps(sum_lanes(sum_lanes(u[0], u[1]), sum_lanes(u[2], u[3])), _mm512_set1_ps(scale)));
  const __mmask8 valid = __mmask8((1u << n) - 1);
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h) _mm_mask_storeu_ps(s + h * stride, valid, _mm_load_ps(w + 4 * h));
}

// scores_avx2 for a bf16 query and cache, head_dim C * 32: 4 keys a step, the same prefetches. Sub-groups of 4
// heads if g % 4 == 0, of 3 if g % 3 == 0, else of 2 (and 1).
template <int C>
void scores_dp(const c10::BFloat16* q, int64_t qs, int64_t hkv, int64_t g, const c10::BFloat16* k,
               const c10::BFloat16* vb, const int64_t* off, int64_t count, int64_t row_elems, float scale, float* s) {
  constexpr int64_t PF = 16, D = 32 * C;
  const int64_t sub = g % 4 == 0 ? 4 : g % 3 == 0 ? 3 : 2;
  for (int64_t t = 0; t < std::min(count, PF); ++t) prefetch_row(k + off[t], row_elems);
  for (int64_t t = 0; t < count; t += 4) {
    for (int64_t u = t + PF; u < t + PF + 4; ++u) {
      if (u < count) {
        prefetch_row(k + off[u], row_elems);
        prefetch_row_l2(vb + off[u], row_elems);
      } else if (u - count < std::min(count, PF)) {
        prefetch_row(vb + off[u - count], row_elems);
      }
    }
    const int64_t n = std::min<int64_t>(4, count - t);
    for (int64_t kv = 0; kv < hkv; ++kv) {
      const c10::BFloat16* kk = k + kv * D;
      const c10::BFloat16* rows[4];
      for (int64_t i = 0; i < 4; ++i) rows[i] = kk + off[t + std::min(i, n - 1)];
      for (int64_t h = kv * g; h < (kv + 1) * g;) {
        const int64_t m = std::min(sub, (kv + 1) * g - h);
        const c10::BFloat16* qh = q + h * qs;
        float* sh = s + h * count + t;
        switch (m) {
          case 1: scores_tile_dp<1, C>(qh, qs, rows, scale, sh, count, n); break;
          case 2: scores_tile_dp<2, C>(qh, qs, rows, scale, sh, count, n); break;
          case 3: scores_tile_dp<3, C>(qh, qs, rows, scale, sh, count, n); break;
          default: scores_tile_dp<4, C>(qh, qs, rows, scale, sh, count, n); break;
        }
        h += m;
      }
    }
  }
}
#endif

// acc[h][c .. c + 16 NB) += sum over tokens [t0, t1) of w[h * count + t] * v_t[c ..], for G heads.
// With PF, also prefetches pf_len elements at pfb + pf[t - t0] for each token (the next tile's rows,
// spread over this pass).
template <typename T, int G, int NB, bool PF, int D>
PC_INLINE void pv_tile(const float* w, int64_t count, const T* v, const int64_t* off, int64_t t0, int64_t t1,
                       int64_t c, float* acc, int64_t d_, const T* pfb, const int64_t* pf, int64_t npf,
                       int64_t pf_len) {
  using R = Rows<T>;
  const int64_t d = D > 0 ? D : d_;
  __m256 a[G][2 * NB];
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NB; ++j) a[h][j] = _mm256_loadu_ps(acc + h * d + c + 8 * j);
  for (int64_t t = t0; t < t1; ++t) {
    if (PF && t - t0 < npf) prefetch_row(pfb + pf[t - t0], pf_len);
    const T* vr = v + off[t] + c;
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const __m256 lo = R::lo(vr + 16 * b), hi = R::hi(vr + 16 * b);
#pragma GCC unroll 4
      for (int h = 0; h < G; ++h) {
        const __m256 wt = _mm256_broadcast_ss(w + h * count + t);
        a[h][2 * b] = _mm256_fmadd_ps(wt, lo, a[h][2 * b]);
        a[h][2 * b + 1] = _mm256_fmadd_ps(wt, hi, a[h][2 * b + 1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NB; ++j) _mm256_storeu_ps(acc + h * d + c + 8 * j, a[h][j]);
}

template <typename T, int G, int D>
PC_INLINE void pv_sub(const float* w, int64_t count, const T* v, const int64_t* off, int64_t t0, int64_t t1,
                      float* acc, int64_t d_, const T* pfb, const int64_t* pf, int64_t npf, int64_t pf_len) {
  const int64_t d = D > 0 ? D : d_;
  constexpr int NB = G == 1 ? 4 : (G == 2 ? 2 : 1);  // 2 G NB accumulators: enough chains, <= 16 ymm in all
  int64_t c = 0;
  if (npf > 0) {  // the first pass over the tile prefetches the next one
    if (16 * NB <= d) {
      pv_tile<T, G, NB, true, D>(w, count, v, off, t0, t1, c, acc, d, pfb, pf, npf, pf_len);
      c += 16 * NB;
    } else {
      pv_tile<T, G, 1, true, D>(w, count, v, off, t0, t1, c, acc, d, pfb, pf, npf, pf_len);
      c += 16;
    }
  }
  for (; c + 16 * NB <= d; c += 16 * NB)
    pv_tile<T, G, NB, false, D>(w, count, v, off, t0, t1, c, acc, d, pfb, pf, 0, 0);
  for (; c < d; c += 16) pv_tile<T, G, 1, false, D>(w, count, v, off, t0, t1, c, acc, d, pfb, pf, 0, 0);
}

#if defined(__AVX512F__)
// 16 elements of a cache row as fp32, in natural order.
PC_INLINE __m512 zrow16(const float* p) { return _mm512_loadu_ps(p); }
PC_INLINE __m512 zrow16(const c10::BFloat16* p) {  // zero-extend, shift
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// pv_tile for an fp32 or bf16 cache, 3 heads of one KV head, head_dim 64, on AVX-512: each head's whole output row in
// 4 zmm, so one pass over the tile's positions loads each V row and broadcasts each weight once (the AVX2 tile takes
// 4 passes of 16 columns, re-broadcasting the weights in each). For bf16 the accumulators are permuted from / to
// Rows<bf16> order (evens, odds of each 16 columns) at the tile's ends. Each output element is the same FMA chain
// over the positions in order as there: bit for bit the AVX2 result. 64 sequences x 176 positions, 30 layers, 2
// threads, fp32: 9.5 -> 8.8 ms over cache-resident blocks, 22.4 -> 21.8 ms with the cache past the LLC.
template <typename T>
PC_INLINE void pv_tile_g3_d64(const float* w, int64_t count, const T* v, const int64_t* off, int64_t t0, int64_t t1,
                              float* acc, const T* pfb, const int64_t* pf, int64_t npf, int64_t pf_len) {
  const __m512i to_nat = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m512i to_rows = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  auto order = [](__m512i idx, __m512 x) { return Rows<T>::kPermuted ? _mm512_permutexvar_ps(idx, x) : x; };
  __m512 a[3][4];
#pragma GCC unroll 3
  for (int h = 0; h < 3; ++h)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) a[h][j] = order(to_nat, _mm512_loadu_ps(acc + h * 64 + 16 * j));
  for (int64_t t = t0; t < t1; ++t) {
    if (t - t0 < npf) prefetch_row(pfb + pf[t - t0], pf_len);
    const T* vr = v + off[t];
    __m512 x[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) x[j] = zrow16(vr + 16 * j);
#pragma GCC unroll 3
    for (int h = 0; h < 3; ++h) {
      const __m512 wt = _mm512_set1_ps(w[h * count + t]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) a[h][j] = _mm512_fmadd_ps(wt, x[j], a[h][j]);
    }
  }
#pragma GCC unroll 3
  for (int h = 0; h < 3; ++h)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + h * 64 + 16 * j, order(to_rows, a[h][j]));
}
#endif

// acc [hkv * g, d] (Rows<T> order) += sum_t w[h * count + t] * v_t (row t of KV head kv = h / g at
// v + off[t] + kv * d). Tiles of a few positions whose cache rows (all KV heads) stay in L1 while
// every (KV head, head sub-group, column block) pass goes over them; the first pass over a tile
// prefetches the next tile's rows. Sub-groups of 3 heads if g % 3 == 0, else of 2 (and 1).
template <typename T, int D>
void pv_avx2(const float* w, int64_t hkv, int64_t g, const T* v, const int64_t* off, int64_t count, int64_t d_,
             int64_t row_elems, float* acc) {
  const int64_t d = D > 0 ? D : d_;
  const int64_t tile = std::max<int64_t>(8, std::min<int64_t>(32, 12288 / (row_elems * int64_t(sizeof(T)))));
  const bool by3 = g % 3 == 0;
#if defined(__AVX512F__)
  if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) && D == 64) {
    if (by3) {
      for (int64_t t0 = 0; t0 < count; t0 += tile) {
        const int64_t t1 = std::min(count, t0 + tile);
        int64_t npf = std::min(count, t1 + tile) - t1;
        for (int64_t kv = 0; kv < hkv; ++kv)
          for (int64_t h = kv * g; h < (kv + 1) * g; h += 3, npf = 0)
            pv_tile_g3_d64(w + h * count, count, v + kv * 64, off, t0, t1, acc + h * 64, v, off + t1, npf, row_elems);
      }
      return;
    }
  }
#endif
  for (int64_t t0 = 0; t0 < count; t0 += tile) {
    const int64_t t1 = std::min(count, t0 + tile);
    int64_t npf = std::min(count, t1 + tile) - t1;
    for (int64_t kv = 0; kv < hkv; ++kv) {
      const T* vv = v + kv * d;
      for (int64_t h = kv * g; h < (kv + 1) * g;) {
        const int64_t sub = by3 ? 3 : std::min<int64_t>(2, (kv + 1) * g - h);
        const float* wh = w + h * count;
        float* ah = acc + h * d;
        switch (sub) {
          case 1: pv_sub<T, 1, D>(wh, count, vv, off, t0, t1, ah, d, v, off + t1, npf, row_elems); break;
          case 2: pv_sub<T, 2, D>(wh, count, vv, off, t0, t1, ah, d, v, off + t1, npf, row_elems); break;
          default: pv_sub<T, 3, D>(wh, count, vv, off, t0, t1, ah, d, v, off + t1, npf, row_elems); break;
        }
        npf = 0;
        h += sub;
      }
    }
  }
}
#endif  // PC_ATTN_AVX2

#if defined(__AVX512BF16__)
// PV of a bf16 cache on vdpbf16ps: the softmax weights rounded to bf16 (as torch's CPU flash attention rounds P for
// its PV matmul), positions in pairs (t, t + 1): the two V rows interleaved by 16-bit lanes (vpunpckl/hwd), so each
// dword holds one column's pair, against each head's weight pair broadcast: half the multiply-adds of fp32 weights,
// which is what PV costs from L2 (it ran at the FMA peak). Per 32 columns the unpacks leave columns {0-3, 8-11,
// 16-19, 24-27} in one accumulator and the rest in the other, put back in natural order at the end. An odd last
// position pairs with a zero row: nothing past seq_len is read (unwritten slots may hold NaN).
// G heads of one KV head (weight pairs wp[h * wstride + pair]), head_dim 32 C, out [G, 32 C] natural order.
template <int G, int C>
PC_INLINE void pv_dp_heads(const uint32_t* wp, int64_t wstride, int64_t count, const c10::BFloat16* v,
                           const int64_t* off, float* out) {
  constexpr int64_t PF = 16;
  __m512 a[G][2 * C];
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * C; ++j) a[h][j] = _mm512_setzero_ps();
  auto step = [&](const c10::BFloat16* r0, const c10::BFloat16* r1, int64_t pair) {
    __m512 x[2 * C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i u0 = _mm512_loadu_si512(r0 + 32 * c);
      const __m512i u1 = r1 != nullptr ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
      x[2 * c] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(u0, u1));
      x[2 * c + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(u0, u1));
    }
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const __m512bh wt = (__m512bh)_mm512_set1_epi32(int(wp[h * wstride + pair]));
#pragma GCC unroll 8
      for (int j = 0; j < 2 * C; ++j) a[h][j] = _mm512_dpbf16_ps(a[h][j], wt, (__m512bh)x[j]);
    }
  };
  const int64_t pairs = count / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t t = 2 * p;
    if (t + PF + 1 < count) {
      prefetch_row(v + off[t + PF], 32 * C);
      prefetch_row(v + off[t + PF + 1], 32 * C);
    }
    step(v + off[t], v + off[t + 1], p);
  }
  if (count & 1) step(v + off[count - 1], nullptr, pairs);
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(out + h * 32 * C + 32 * c, _mm512_permutex2var_ps(a[h][2 * c], lo, a[h][2 * c + 1]));
      _mm512_storeu_ps(out + h * 32 * C + 32 * c + 16, _mm512_permutex2var_ps(a[h][2 * c], hi, a[h][2 * c + 1]));
    }
}

// acc [hkv * g, 32 C] (natural order) = sum_t w[h * count + t] * v_t for a bf16 cache, through pv_dp_heads: each
// KV head's column of V read once for up to 4 (head_dim 64) or 2 (128) of its query heads. wb: scratch.
template <int C>
void pv_dp(const float* w, int64_t hkv, int64_t g, const c10::BFloat16* v, const int64_t* off, int64_t count,
           float* acc, float* ml, std::vector<c10::BFloat16>& wb) {
  constexpr int64_t kMaxG = C == 2 ? 4 : 2;
  const int64_t hq = hkv * g, wstride = count / 2 + 1;  // weight pairs a head, an odd count's last padded with 0
  wb.resize(hq * 2 * wstride);
  for (int64_t h = 0; h < hq; ++h) {
    const float* src = w + h * count;
    c10::BFloat16* dst = wb.data() + h * 2 * wstride;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < count; t += 16) {
      const __mmask16 m = count - t >= 16 ? __mmask16(0xffff) : __mmask16((1u << (count - t)) - 1);
      const __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + t));
      _mm256_mask_storeu_epi16(dst + t, m, r);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
    }
    dst[count] = c10::BFloat16(0.f);
    // The sum the output is divided by: of the weights as rounded, so they still sum to 1 (the rounding's common part
    // cancels: the output stays a weighted mean of V rows).
    ml[2 * h + 1] = _mm512_reduce_add_ps(sum);
  }
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(wb.data());
  for (int64_t kv = 0; kv < hkv; ++kv) {
    const c10::BFloat16* vk = v + kv * 32 * C;
    for (int64_t h = kv * g; h < (kv + 1) * g;) {
      const int64_t m = std::min<int64_t>(kMaxG, (kv + 1) * g - h);
      const uint32_t* wh = wp + h * wstride;
      float* out = acc + h * 32 * C;
      switch (m) {
        case 1: pv_dp_heads<1, C>(wh, wstride, count, vk, off, out); break;
        case 2: pv_dp_heads<2, C>(wh, wstride, count, vk, off, out); break;
        case 3: if constexpr (kMaxG >= 3) pv_dp_heads<3, C>(wh, wstride, count, vk, off, out); break;
        default: if constexpr (kMaxG >= 4) pv_dp_heads<4, C>(wh, wstride, count, vk, off, out); break;
      }
      h += m;
    }
  }
}
#endif

// Scores [hq, count] of one item (query head h reads KV head h / group): scale * q_h . k_t.
template <typename T, typename Q>
void item_scores(const DecodeAttention& a, const Q* qrow, const float* q, const T* k_cache, const T* v_cache,
                 const int64_t* off, int64_t count, float* sc) {
  const int64_t hkv = a.hkv, d = a.d, group = a.hq / hkv, row_elems = hkv * d;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>) {
    if (d == 64) return scores_dp<2>(qrow, a.q_head_stride, hkv, group, k_cache, v_cache, off, count, row_elems, a.scale, sc);
    if (d == 128) return scores_dp<4>(qrow, a.q_head_stride, hkv, group, k_cache, v_cache, off, count, row_elems, a.scale, sc);
  }
#endif
#ifdef PC_ATTN_AVX2
  if (d % 16 == 0) {  // q: scaled, in Rows<T> order (load_q)
    if (d == 64) return scores_avx2<T, 64>(q, hkv, group, k_cache, v_cache, off, count, d, row_elems, sc);
    if (d == 128) return scores_avx2<T, 128>(q, hkv, group, k_cache, v_cache, off, count, d, row_elems, sc);
    return scores_avx2<T, 0>(q, hkv, group, k_cache, v_cache, off, count, d, row_elems, sc);
  }
#endif
  for (int64_t kv = 0; kv < hkv; ++kv)
    scores_scalar(q + kv * group * d, group, k_cache + kv * d, off, count, d, sc + kv * group * count);
}

// One sequence's positions [p0, p1) (or the whole sequence) for every head, as the items of a step.
template <typename T, typename Q>
void run_items(const DecodeAttention& a, int64_t begin, int64_t end) {
  const int64_t hq = a.hq, hkv = a.hkv, d = a.d, group = hq / hkv, row_elems = hkv * d, pstride = d + 2;
  const Q* query = static_cast<const Q*>(a.query);
  const T *k_cache = static_cast<const T*>(a.k_cache), *v_cache = static_cast<const T*>(a.v_cache);
  Q* out = static_cast<Q*>(a.out);
#ifdef PC_ATTN_AVX2
  const bool vec = d % 16 == 0;
#else
  [[maybe_unused]] const bool vec = false;
#endif
  std::vector<float> q(hq * d), acc(hq * d), scores, ml(2 * hq);
  [[maybe_unused]] std::vector<c10::BFloat16> wb;  // pv_dp's bf16 weights
  std::vector<int64_t> off, soff;
  for (int64_t it = begin; it < end; ++it) {
    const DecodeItem& item = a.items[it];
    const int64_t count = item.p1 - item.p0;
    const Q* qrow = query + a.rows[item.seq] * a.q_row_stride;
#ifdef PC_ATTN_AVX2
    if (vec)
      for (int64_t h = 0; h < hq; ++h) load_q<T>(&q[h * d], qrow + h * a.q_head_stride, d, a.scale);
    else
#endif
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t i = 0; i < d; ++i) q[h * d + i] = to_float(qrow[h * a.q_head_stride + i]) * a.scale;
    std::fill(acc.begin(), acc.end(), 0.f);
    if (count > 0) {
      if (int64_t(off.size()) < count) off.resize(count);
      if (int64_t(scores.size()) < hq * count) scores.resize(hq * count);
      const int32_t* table = a.block_table + item.seq * a.max_blocks;
      row_offsets(table, item.p0, item.p1, a.block_size, row_elems, a.block_stride, off.data());
      if (a.k_scales != nullptr) {
        if (int64_t(soff.size()) < count) soff.resize(count);
        row_offsets(table, item.p0, item.p1, a.block_size, hkv, a.scale_block_stride, soff.data());
      }
      float* sc = scores.data();
      // Scores [hq, count] (query head h reads KV head h / group), softmax per head, weighted V.
      item_scores<T, Q>(a, qrow, q.data(), k_cache, v_cache, off.data(), count, sc);
      if (a.k_scales != nullptr) apply_row_scales(sc, hkv, group, count, a.k_scales, soff.data());
      if (a.softcap > 0.f)
        for (int64_t j = 0; j < hq * count; ++j) sc[j] = a.softcap * std::tanh(sc[j] / a.softcap);
      for (int64_t h = 0; h < hq; ++h) {
#ifdef PC_ATTN_AVX2
        if (vec) softmax_avx2(sc + h * count, count, &ml[2 * h], &ml[2 * h + 1]);
        else
#endif
          softmax_scalar(sc + h * count, count, &ml[2 * h], &ml[2 * h + 1]);
      }
      // After the softmax (its sums stay those of the weights): V's scales go into the weights.
      if (a.v_scales != nullptr) apply_row_scales(sc, hkv, group, count, a.v_scales, soff.data());
      bool pv_ran = false;  // by the bf16 cache's vdpbf16ps PV (natural order), else below
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (d == 64 || d == 128) {
          if (d == 64) pv_dp<2>(sc, hkv, group, v_cache, off.data(), count, acc.data(), ml.data(), wb);
          else pv_dp<4>(sc, hkv, group, v_cache, off.data(), count, acc.data(), ml.data(), wb);
          pv_ran = true;
        }
      }
#endif
#ifdef PC_ATTN_AVX2
      if (!pv_ran && vec) {
        if (d == 64) pv_avx2<T, 64>(sc, hkv, group, v_cache, off.data(), count, d, row_elems, acc.data());
        else if (d == 128) pv_avx2<T, 128>(sc, hkv, group, v_cache, off.data(), count, d, row_elems, acc.data());
        else pv_avx2<T, 0>(sc, hkv, group, v_cache, off.data(), count, d, row_elems, acc.data());
        for (int64_t h = 0; h < hq; ++h) to_natural<T>(&acc[h * d], d);
      } else
#endif
        if (!pv_ran)
          for (int64_t kv = 0; kv < hkv; ++kv)
            pv_scalar(sc + kv * group * count, group, v_cache + kv * d, off.data(), count, d, &acc[kv * group * d]);
    } else {
      for (int64_t h = 0; h < hq; ++h) ml[2 * h] = -std::numeric_limits<float>::max(), ml[2 * h + 1] = 0.f;
    }
    if (item.slot >= 0) {
      float* dst = const_cast<float*>(a.partial.data()) + item.slot * hq * pstride;
      for (int64_t h = 0; h < hq; ++h) {
        dst[h * pstride] = ml[2 * h];
        dst[h * pstride + 1] = ml[2 * h + 1];
        std::copy(acc.data() + h * d, acc.data() + (h + 1) * d, dst + h * pstride + 2);
      }
    } else {
      Q* orow = out + item.seq * hq * d;
      for (int64_t h = 0; h < hq; ++h) {
        const float inv = ml[2 * h + 1] > 0.f ? 1.f / ml[2 * h + 1] : 0.f;
#ifdef PC_ATTN_AVX2
        if (vec) {
          store_out(orow + h * d, &acc[h * d], d, inv);
          continue;
        }
#endif
        for (int64_t i = 0; i < d; ++i) orow[h * d + i] = static_cast<Q>(acc[h * d + i] * inv);
      }
    }
  }
}

// Combine the partitions of each split sequence (consecutive items): rescale to the common max.
template <typename Q>
void combine_items(const DecodeAttention& a) {
  const int64_t hq = a.hq, d = a.d, pstride = d + 2, num_items = int64_t(a.items.size());
  const auto& items = a.items;
  const auto& partial = a.partial;
  Q* out = static_cast<Q*>(a.out);
  std::vector<float> o(d);
  for (int64_t it = 0; it < num_items;) {
    if (items[it].slot < 0) {
      ++it;
      continue;
    }
    int64_t last = it;
    while (last + 1 < num_items && items[last + 1].seq == items[it].seq) ++last;
    for (int64_t h = 0; h < hq; ++h) {
      float m = -std::numeric_limits<float>::max();
      for (int64_t j = it; j <= last; ++j) m = std::max(m, partial[(items[j].slot * hq + h) * pstride]);
      float l = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t j = it; j <= last; ++j) {
        const float* pj = partial.data() + (items[j].slot * hq + h) * pstride;
        if (pj[1] == 0.f) continue;  // empty partition
        const float f = std::exp(pj[0] - m);
        l += f * pj[1];
        for (int64_t i = 0; i < d; ++i) o[i] += f * pj[2 + i];
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      Q* orow = out + (items[it].seq * hq + h) * d;
      for (int64_t i = 0; i < d; ++i) orow[i] = static_cast<Q>(o[i] * inv);
    }
    it = last + 1;
  }
}

// Calls f(T{}, Q{}) with the cache's and the query's element types.
template <typename F>
void dispatch_types(const DecodeAttention& a, F&& f) {
  auto with_cache = [&](auto cache_elem) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.query_type, "paged_decode_q",
                                    [&] { f(cache_elem, scalar_t{}); });
  };
  if (a.cache_type == at::kChar) {
    with_cache(int8_t{});
  } else if (a.cache_type == at::kFloat8_e4m3fn) {
    with_cache(c10::Float8_e4m3fn{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.cache_type, "paged_decode_kv",
                                    [&] { with_cache(scalar_t{}); });
  }
}
}  // namespace

void DecodeAttention::plan(int64_t threads) {
  auto first_of = [&](int64_t s) {
    const int64_t len = seq_lens[s];
    return window > 0 ? std::max<int64_t>(0, len - window) : int64_t(0);
  };
  int64_t total = 0;
  for (int64_t s = 0; s < n; ++s) total += seq_lens[s] - first_of(s);
  // Work items: one per sequence, except that with several threads a sequence longer than kPart positions is
  // split into ceil(count / kPart) even partitions.
  const int64_t part_len = threads > 1 ? kPart : std::numeric_limits<int64_t>::max();
  items.clear();
  items.reserve(n);
  int64_t slots = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t first = first_of(s), len = seq_lens[s], count = len - first;
    const int64_t parts = count > part_len ? (count + part_len - 1) / part_len : 1;
    const int64_t step = (count + parts - 1) / parts;
    for (int64_t p = 0; p < parts; ++p)
      items.push_back({s, first + p * step, std::min(len, first + (p + 1) * step), parts > 1 ? slots++ : -1});
  }
  has_split = slots > 0;
  // Partial results of split items: [slot][head] x (max, sum, acc[d]).
  partial.assign(slots * hq * (d + 2), 0.f);
  // Cuts at even shares of the work, an item weighing its positions plus kItemCost for its fixed part.
  cuts.assign(threads + 1, int64_t(items.size()));
  cuts[0] = 0;
  int64_t work = 0, done = 0;
  for (const DecodeItem& it : items) work += it.p1 - it.p0 + kItemCost;
  for (int64_t i = 0, t = 1; i < int64_t(items.size()) && t < threads; ++i) {
    const int64_t w = items[i].p1 - items[i].p0 + kItemCost;
    // cut before item i if that lands nearer thread t's share than cutting after it
    while (t < threads && 2 * (done + w) * threads - w * threads > 2 * work * t) cuts[t++] = i;
    done += w;
  }
  // Small batches run inline (grain: a chunk holds >= 2^18 query-head x position x head_dim FMAs, ~50 us here).
  const int64_t per_item = std::max<int64_t>(1, total / std::max<int64_t>(1, int64_t(items.size())));
  grain = grain_for(per_item * hq * d, 1 << 18);
}

std::pair<int64_t, int64_t> DecodeAttention::share_of(int64_t tid, int64_t nth) const {
  if (int64_t(cuts.size()) == nth + 1) return {cuts[tid], cuts[tid + 1]};
  const int64_t n = int64_t(items.size()), per = (n + nth - 1) / nth;  // not planned for nth: even counts
  return {std::min(n, tid * per), std::min(n, (tid + 1) * per)};
}

void DecodeAttention::run(int64_t begin, int64_t end) const {
  dispatch_types(*this, [&](auto t, auto q) { run_items<decltype(t), decltype(q)>(*this, begin, end); });
}

void DecodeAttention::kv_lines(int64_t begin, int64_t end, LineStream& out) const {
  const int64_t esize = int64_t(c10::elementSize(cache_type)), row_bytes = hkv * d * esize;
  for (const void* cache : {k_cache, v_cache}) {  // all K, then all V: adjacent blocks merge into one span
    for (int64_t it = begin; it < end; ++it) {
      const DecodeItem& item = items[it];
      const int32_t* table = block_table + item.seq * max_blocks;
      for (int64_t p = item.p0; p < item.p1;) {
        const int64_t o = p % block_size, run = std::min(block_size - o, item.p1 - p);
        out.add(static_cast<const char*>(cache) + (int64_t(table[p / block_size]) * block_stride + o * hkv * d) * esize,
                run * row_bytes);
        p += run;
      }
    }
  }
}

void DecodeAttention::combine() const {
  if (!has_split) return;
  dispatch_types(*this, [&](auto, auto q) { combine_items<decltype(q)>(*this); });
}

// query [T, Hq, D] (last dim contiguous); rows [n] int64: query row of each sequence;
// caches [num_blocks, block_size, Hkv, D], rows dense within a block (blocks any stride apart); block_table
// [n, max_blocks] int32; seq_lens [n] int32. A quantized cache (int8 / float8_e4m3fn) comes with its fp16
// scales [num_blocks, block_size, Hkv]. Returns [n, Hq, D] in query's dtype.
namespace {
DecodeAttention describe(const torch::Tensor& query, const torch::Tensor& rows, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                         double scale, int64_t window, double softcap, const c10::optional<torch::Tensor>& k_scales,
                         const c10::optional<torch::Tensor>& v_scales, void* out) {
  const int64_t n = rows.size(0), hq = query.size(1), d = query.size(2);
  const int64_t hkv = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(query.stride(2) == 1, "query layout");
  for (const auto& c : {k_cache, v_cache})
    TORCH_CHECK(c.stride(3) == 1 && c.stride(2) == d && c.stride(1) == hkv * d, "cache rows dense within a block");
  TORCH_CHECK(k_cache.stride(0) == v_cache.stride(0), "K and V caches of one layout");
  TORCH_CHECK(block_table.is_contiguous() && block_table.scalar_type() == at::kInt, "block_table int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && rows.scalar_type() == at::kLong, "seq_lens int32, rows int64");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches of one dtype");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && k_cache.size(3) == d, "heads / head_dim");
  const bool quant = k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(quant == (k_scales.has_value() && v_scales.has_value()), "scales exactly with an int8 / fp8 cache");
  const c10::Half *ks = nullptr, *vs = nullptr;
  int64_t scale_block_stride = 0;
  if (quant) {
    for (const auto& c : {*k_scales, *v_scales})
      TORCH_CHECK(c.scalar_type() == at::kHalf && c.stride(2) == 1 && c.stride(1) == hkv, "scales fp16, dense rows");
    TORCH_CHECK(k_scales->stride(0) == v_scales->stride(0), "K and V scales of one layout");
    ks = k_scales->data_ptr<c10::Half>();
    vs = v_scales->data_ptr<c10::Half>();
    scale_block_stride = k_scales->stride(0);
  }
  return DecodeAttention{query.scalar_type(), k_cache.scalar_type(), query.data_ptr(), k_cache.data_ptr(),
                         v_cache.data_ptr(), block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                         rows.data_ptr<int64_t>(), out, n, hq, hkv, d, block_size, block_table.size(1),
                         query.stride(0), query.stride(1), float(scale), window, float(softcap), k_cache.stride(0), ks,
                         vs, scale_block_stride};
}
}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor rows, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, double scale, int64_t window,
                           double softcap, c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales) {
  auto out = torch::empty({rows.size(0), query.size(1), query.size(2)}, query.options());
  DecodeAttention a = describe(query, rows, k_cache, v_cache, block_table, seq_lens, scale, window, softcap, k_scales,
                               v_scales, out.data_ptr());
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  a.plan(threads);
  const int64_t items = int64_t(a.items.size());
  if (threads == 1 || items <= a.grain) {
    a.run(0, items);
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const auto [i0, i1] = a.share_of(t, threads);
        if (i0 < i1) a.run(i0, i1);
      }
    });
  }
  a.combine();
  return out;
}

// The K/V lines the decode stack asks for ahead of each of `threads` threads' items (kv_lines): rows
// [thread, address, lines] of its LineStream's spans, for the tests.
torch::Tensor decode_kv_lines(torch::Tensor query, torch::Tensor rows, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_table, torch::Tensor seq_lens, int64_t window, int64_t threads) {
  DecodeAttention a = describe(query, rows, k_cache, v_cache, block_table, seq_lens, 1.0, window, 0.0, c10::nullopt,
                               c10::nullopt, nullptr);
  a.plan(threads);
  std::vector<int64_t> out;
  for (int64_t t = 0; t < threads; ++t) {
    const auto [i0, i1] = a.share_of(t, threads);
    LineStream s;
    a.kv_lines(i0, i1, s);
    for (const auto& span : s.spans) out.insert(out.end(), {t, int64_t(reinterpret_cast<uintptr_t>(span.p)), span.lines});
  }
  return torch::tensor(out, torch::kLong).view({-1, 3});
}
