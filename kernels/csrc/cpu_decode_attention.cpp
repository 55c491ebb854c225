// Paged decode attention for the CPU: one query token per sequence, read straight from the block
// table (no gathered copy, no padding), fp32 math, parallel over sequences.
#include "ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

template <typename T>
static inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
static inline void axpy(float* acc, float w, const T* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += w * static_cast<float>(v[i]);
}

// bf16 -> fp32 is a 16-bit shift; spelled out so the compiler vectorises it (c10's conversion does not).
static inline float bf16_to_float(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <>
inline float dot<c10::BFloat16>(const float* q, const c10::BFloat16* k, int64_t d) {
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k);
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * bf16_to_float(kb[i]);
  return s;
}

template <>
inline void axpy<c10::BFloat16>(float* acc, float w, const c10::BFloat16* v, int64_t d) {
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += w * bf16_to_float(vb[i]);
}

template <typename T, typename Q>
static void decode_kernel(const Q* query, const T* k_cache, const T* v_cache, const int32_t* block_table,
                          const int32_t* seq_lens, const int64_t* rows, Q* out, int64_t n, int64_t hq, int64_t hkv,
                          int64_t d, int64_t block_size, int64_t max_blocks, int64_t q_row_stride,
                          int64_t q_head_stride, float scale, int64_t window, float softcap) {
  const int64_t group = hq / hkv;
  // One sequence per work item: each token's K (and V) row, all KV heads, is read from memory once.
  int64_t total_len = 0;
  for (int64_t s = 0; s < n; ++s) total_len += seq_lens[s];
  at::parallel_for(0, n, grain_for(total_len / std::max<int64_t>(1, n) * hq * d, 1 << 17), [&](int64_t begin, int64_t end) {
    std::vector<float> q(hq * d), acc(hq * d), scores;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = seq_lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t count = len - first;
      const Q* qrow = query + rows[s] * q_row_stride;
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t i = 0; i < d; ++i) q[h * d + i] = static_cast<float>(qrow[h * q_head_stride + i]);
      scores.assign(hq * count, 0.f);
      const int32_t* table = block_table + s * max_blocks;
      // Pass 1: scores [Hq, count]; query head j reads KV head j / group.
      for (int64_t p = first; p < len; ++p) {
        const T* kp = k_cache + (int64_t(table[p / block_size]) * block_size + p % block_size) * hkv * d;
        for (int64_t h = 0; h < hq; ++h) {
          float x = dot(&q[h * d], kp + (h / group) * d, d) * scale;
          if (softcap > 0.f) x = softcap * std::tanh(x / softcap);
          scores[h * count + (p - first)] = x;
        }
      }
      for (int64_t h = 0; h < hq; ++h) {
        float* sh = &scores[h * count];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < count; ++j) m = std::max(m, sh[j]);
        float total = 0.f;
        for (int64_t j = 0; j < count; ++j) { sh[j] = std::exp(sh[j] - m); total += sh[j]; }
        const float inv = 1.f / total;
        for (int64_t j = 0; j < count; ++j) sh[j] *= inv;
      }
      // Pass 2: weighted values, V read once.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = first; p < len; ++p) {
        const T* vp = v_cache + (int64_t(table[p / block_size]) * block_size + p % block_size) * hkv * d;
        for (int64_t h = 0; h < hq; ++h) axpy(&acc[h * d], scores[h * count + (p - first)], vp + (h / group) * d, d);
      }
      Q* orow = out + s * hq * d;
      for (int64_t i = 0; i < hq * d; ++i) orow[i] = static_cast<Q>(acc[i]);
    }
  });
}

// query [T, Hq, D] (last dim contiguous); rows [n] int64: query row of each sequence;
// caches [num_blocks, block_size, Hkv, D] contiguous; block_table [n, max_blocks] int32; seq_lens [n] int32.
// Returns [n, Hq, D] in query's dtype.
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor rows, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, double scale, int64_t window,
                           double softcap) {
  TORCH_CHECK(query.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(), "layout");
  TORCH_CHECK(block_table.is_contiguous() && block_table.scalar_type() == at::kInt, "block_table int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && rows.scalar_type() == at::kLong, "seq_lens int32, rows int64");
  const int64_t n = rows.size(0), hq = query.size(1), d = query.size(2);
  const int64_t hkv = k_cache.size(2), block_size = k_cache.size(1);
  auto out = torch::empty({n, hq, d}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode_kv", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_q", [&] {
      decode_kernel<T, scalar_t>(query.data_ptr<scalar_t>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                                 block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                                 rows.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), n, hq, hkv, d, block_size,
                                 block_table.size(1), query.stride(0), query.stride(1), float(scale), window,
                                 float(softcap));
    });
  });
  return out;
}
