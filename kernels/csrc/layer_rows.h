// One row (token) of the decoder layer's elementwise ops, shared by the torch ops (cpu_layer_ops.cpp)
// and the decoder stack (cpu_decode_stack.cpp). Each rounds where transformers' own sequence of ops
// rounds (to the tensor dtype after each op).
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "zmm_tile.h"  // exp_ps (AVX-512)

#if defined(__AVX512BF16__)
// The rows in 16-lane vectors for fp32 and bf16 (element by element GCC left them scalar: c10::BFloat16's rounding
// and std::exp do not vectorize; a 2048-row prefill chunk spent ~20% of its time in these ops). The same roundings
// (bf16: to nearest even, as c10::BFloat16 rounds; vcvtneps2bf16 also flushes denormals), the same order of each
// row's operations except RMSNorm's sum of squares (16 lanes, then their tree) and silu's exp (zmm::exp_ps, ~1 ulp).
namespace lrows {
template <typename T>
constexpr bool kVec = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }
template <typename T>
inline __m512 load(const T* p, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(m, p);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
template <typename T>
inline void store(T* p, __mmask16 m, __m512 v) {
  if constexpr (std::is_same_v<T, float>) _mm512_mask_storeu_ps(p, m, v);
  else _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
template <typename T>
inline __m512 round(__m512 v) {  // to T and back (fp32: itself)
  if constexpr (std::is_same_v<T, float>) return v;
  else return zmm::round_bf16(v);
}
}  // namespace lrows
#endif

#pragma GCC push_options
// No fused multiply-add where transformers rounds between the multiply and the add (fp32 path).
#pragma GCC optimize("fp-contract=off")

template <typename T>
static inline float r(float x) {  // round to T, as each aten op's output does
  return static_cast<float>(static_cast<T>(x));
}

// y = x.float() * rsqrt(mean(x.float()^2) + eps), rounded to x's dtype, then weight * y in x's dtype.
template <typename T>
static inline void rms_norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
#if defined(__AVX512BF16__)
  if constexpr (lrows::kVec<T>) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
      const __m512 v = lrows::load(x + i, lrows::lanes(h - i));
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / float(h) + eps));
    for (int64_t i = 0; i < h; i += 16) {
      const __mmask16 m = lrows::lanes(h - i);
      const __m512 y = lrows::round<T>(_mm512_mul_ps(lrows::load(x + i, m), inv));
      lrows::store(out + i, m, _mm512_mul_ps(lrows::load(w + i, m), y));
    }
    return;
  }
#endif
  float ss = 0.f;
  for (int64_t i = 0; i < h; ++i) { const float v = static_cast<float>(x[i]); ss += v * v; }
  const float inv = 1.f / std::sqrt(ss / float(h) + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = static_cast<T>(static_cast<float>(w[i]) * r<T>(static_cast<float>(x[i]) * inv));
}

// sum = x + residual (rounded), normed = rms_norm(sum). sum may alias x.
template <typename T>
static inline void add_rms_norm_row(const T* x, const T* residual, const T* w, T* sum, T* normed, int64_t h,
                                    float eps) {
#if defined(__AVX512BF16__)
  if constexpr (lrows::kVec<T>) {
    for (int64_t j = 0; j < h; j += 16) {
      const __mmask16 m = lrows::lanes(h - j);
      lrows::store(sum + j, m, _mm512_add_ps(lrows::load(x + j, m), lrows::load(residual + j, m)));
    }
    return rms_norm_row(sum, w, normed, h, eps);
  }
#endif
  for (int64_t j = 0; j < h; ++j) sum[j] = static_cast<T>(static_cast<float>(x[j]) + static_cast<float>(residual[j]));
  rms_norm_row(sum, w, normed, h, eps);
}

// transformers' RoPE on one token's heads: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1),
// each product and the sum rounded to x's dtype. x: head h at x + h * s_head, unit stride in D.
template <typename T>
static inline void rope_token(T* x, int64_t heads, int64_t d, int64_t s_head, const T* c, const T* s) {
  const int64_t half = d / 2;
#if defined(__AVX512BF16__)
  if constexpr (lrows::kVec<T>) {
    using lrows::load, lrows::round;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + h * s_head;
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = lrows::lanes(half - i);
        const __m512 x1 = load(v + i, m), x2 = load(v + i + half, m);
        const __m512 c1 = load(c + i, m), s1 = load(s + i, m), c2 = load(c + i + half, m), s2 = load(s + i + half, m);
        const __m512 nx2 = _mm512_xor_ps(x2, _mm512_set1_ps(-0.f));  // -x2 exactly (a signed zero too)
        const __m512 o1 = _mm512_add_ps(round<T>(_mm512_mul_ps(x1, c1)), round<T>(_mm512_mul_ps(nx2, s1)));
        const __m512 o2 = _mm512_add_ps(round<T>(_mm512_mul_ps(x2, c2)), round<T>(_mm512_mul_ps(x1, s2)));
        lrows::store(v + i, m, o1);
        lrows::store(v + i + half, m, o2);
      }
    }
    return;
  }
#endif
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * s_head;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
      const float o1 = r<T>(x1 * static_cast<float>(c[i])) + r<T>(-x2 * static_cast<float>(s[i]));
      const float o2 = r<T>(x2 * static_cast<float>(c[i + half])) + r<T>(x1 * static_cast<float>(s[i + half]));
      v[i] = static_cast<T>(o1);
      v[i + half] = static_cast<T>(o2);
    }
  }
}

// act_fn(gate) * up with act_fn = SiLU: silu rounded to the dtype (as torch's silu returns it), then the product.
template <typename T>
static inline void silu_and_mul_row(const T* g, const T* u, T* out, int64_t width) {
#if defined(__AVX512BF16__)
  if constexpr (lrows::kVec<T>) {
    for (int64_t i = 0; i < width; i += 16) {
      const __mmask16 m = lrows::lanes(width - i);
      const __m512 sv = lrows::round<T>(zmm::silu_ps(lrows::load(g + i, m)));
      lrows::store(out + i, m, _mm512_mul_ps(sv, lrows::load(u + i, m)));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < width; ++i) {
    const float x = static_cast<float>(g[i]);
    out[i] = static_cast<T>(r<T>(x / (1.f + std::exp(-x))) * static_cast<float>(u[i]));
  }
}

#pragma GCC pop_options
