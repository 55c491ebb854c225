// One row (token) of the decoder layer's elementwise ops, shared by the torch ops (cpu_layer_ops.cpp)
// and the decoder stack (cpu_decode_stack.cpp). Each rounds where transformers' own sequence of ops
// rounds (to the tensor dtype after each op).
#pragma once
#include <cmath>
#include <cstdint>

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
  float ss = 0.f;
  for (int64_t i = 0; i < h; ++i) { const float v = static_cast<float>(x[i]); ss += v * v; }
  const float inv = 1.f / std::sqrt(ss / float(h) + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = static_cast<T>(static_cast<float>(w[i]) * r<T>(static_cast<float>(x[i]) * inv));
}

// sum = x + residual (rounded), normed = rms_norm(sum). sum may alias x.
template <typename T>
static inline void add_rms_norm_row(const T* x, const T* residual, const T* w, T* sum, T* normed, int64_t h,
                                    float eps) {
  for (int64_t j = 0; j < h; ++j) sum[j] = static_cast<T>(static_cast<float>(x[j]) + static_cast<float>(residual[j]));
  rms_norm_row(sum, w, normed, h, eps);
}

// transformers' RoPE on one token's heads: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1),
// each product and the sum rounded to x's dtype. x: head h at x + h * s_head, unit stride in D.
template <typename T>
static inline void rope_token(T* x, int64_t heads, int64_t d, int64_t s_head, const T* c, const T* s) {
  const int64_t half = d / 2;
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
  for (int64_t i = 0; i < width; ++i) {
    const float x = static_cast<float>(g[i]);
    out[i] = static_cast<T>(r<T>(x / (1.f + std::exp(-x))) * static_cast<float>(u[i]));
  }
}

#pragma GCC pop_options
