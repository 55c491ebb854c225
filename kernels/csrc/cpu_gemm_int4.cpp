// Linears over int4 weights packed once at load (w = q * scale + min per group, as GGUF's Q4_1; GPTQ's zero
// points as fp16 (scale, zero) pairs): the panels' layout, the decode kernel over int8 activations, the fp32 one.
#include "quantized_panels.h"

namespace {
// ---- int4 weights (w = q * scale + min per group of G inputs, as GGUF's Q4_1) ------------------
// Panel p holds K (rounded up to 4, zero codes past K) inputs in quads of 4: 32 bytes per quad, byte
// c * 4 + t = column c (low nibble) | column c + 8 (high nibble) at input 4 * quad + t. So each 32-bit
// lane holds 4 consecutive inputs of one column: the operand of an integer dot product (maddubs +
// madd) against 4 int8 activations, with no horizontal sums. Beside it, per group g, 16 scales then
// 16 mins: fp16 where the format's own are (GGUF's d and m; pagedcore's int4 rounds its scale and min
// so), else fp32. Decode reads 4 bits per weight plus 1 (fp16) or 2 (fp32) of scale and min (groups of 32).
//
// Two ways to run it. Decode (M <= int8_rows, groups a multiple of 32): x is quantized once per call
// to int8 per block of 32 inputs (symmetric, round to nearest, d = max|x| / 127, as llama.cpp's Q8
// blocks), products summed in integers per block, then y += s * d * dot(q, xq) per block and
// y += m * sum(d * sum(xq)) per group in fp32: ~0.15 instructions per weight, so it runs at memory
// speed. Otherwise x stays fp32 and the panel is dequantized to fp32 (in registers at M = 1, into a
// buffer for more rows, then the fp32 micro-kernel): exact, ALU-bound at M = 1 (~0.7 per weight).
#ifdef PC_AVX2
// Each k of the panel dequantized (columns 0-7, 8-15) and handed to f(k, t = k % 4, w0, w1).
template <typename S, typename F>
inline void for_each_dequantized(const uint8_t* q, const sm_t<S>* sm, int64_t K, int64_t G, F&& f) {
  const __m256i nib = _mm256_set1_epi32(0x0F);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, m0 = s0, m1 = s0;
  int64_t next = 0;  // first input of the next group
  for (int64_t k0 = 0; k0 < K; k0 += 4) {
    _mm_prefetch(reinterpret_cast<const char*>(q + k0 * 8 + PF4), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k0 * 8));
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const int64_t k = k0 + t;
      if (k == K) return;
      if (k == next) {  // groups of any even size: one may start inside a quad
        const sm_t<S>* gsm = sm + (k / G) * 2 * NR;
        s0 = load_sm(gsm), s1 = load_sm(gsm + 8);
        m0 = load_min<S>(gsm + NR, s0), m1 = load_min<S>(gsm + NR + 8, s1);
        next += G;
      }
      const __m256i b = _mm256_srli_epi32(v, 8 * t);
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, nib));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 4), nib));
      f(k, t, _mm256_fmadd_ps(lo, s0, m0), _mm256_fmadd_ps(hi, s1, m1));
    }
  }
}


template <typename S, int R>
__attribute__((noinline)) void micro_kernel_int4(const float* a, const uint8_t* q, const sm_t<S>* sm, int64_t K,
                                                 int64_t G, float* c) {
  RegisterTile<R> tile;
  for_each_dequantized<S>(q, sm, K, G, [&](int64_t k, int t, __m256 w0, __m256 w1) { tile.add(a, k, t, w0, w1); });
  tile.store(c);
}

// The panel as fp32 [K, 16], for many rows (then the fp32 micro-kernel runs at the FMA rate).
template <typename S>
void widen_int4(const uint8_t* q, const sm_t<S>* sm, int64_t K, int64_t G, float* buf) {
  for_each_dequantized<S>(q, sm, K, G, [&](int64_t k, int, __m256 w0, __m256 w1) {
    _mm256_storeu_ps(buf + k * NR, w0);
    _mm256_storeu_ps(buf + k * NR + 8, w1);
  });
}


// R rows of int8 activations (xq rows at stride K, block scales d at stride K / 32, group sums xs at
// stride K / G) against one panel; G a multiple of 32. Per quad and row: one maddubs per 8 columns
// (u4 x s8, pairs summed to int16: |.| <= 2 * 15 * 127), added in int16 over the block's 8 quads
// (<= 30480, no overflow), widened once per block by madd with ones.
template <int R, typename S>
__attribute__((noinline)) void micro_kernel_int4_int8(const int8_t* xq, const float* d, const float* xs, int64_t K,
                                                      int64_t G, const uint8_t* q, const sm_t<S>* sm, float* c) {
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t blocks = K / QB, groups = K / G, per_group = G / QB;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const sm_t<S>* gsm = sm + g * 2 * NR;
    const __m256 s0 = load_sm(gsm), s1 = load_sm(gsm + 8);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* qb = q + b * QB * 8;  // 256 bytes: 8 quads
      for (int l = 0; l < 256; l += 64) _mm_prefetch(reinterpret_cast<const char*>(qb + PF4 + l), _MM_HINT_T0);
      __m256i sum[R][2];
      for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + j * 32));
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, xq + r * K + b * QB + j * 4, 4);
          const __m256i xv = _mm256_set1_epi32(x4);
          sum[r][0] = _mm256_add_epi16(sum[r][0], _mm256_maddubs_epi16(lo, xv));
          sum[r][1] = _mm256_add_epi16(sum[r][1], _mm256_maddubs_epi16(hi, xv));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 dv = _mm256_broadcast_ss(d + r * blocks + b);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][0], ones)), _mm256_mul_ps(s0, dv), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][1], ones)), _mm256_mul_ps(s1, dv), acc[r][1]);
      }
    }
    const __m256 m0 = load_min<S>(gsm + NR, s0), m1 = load_min<S>(gsm + NR + 8, s1);
    for (int r = 0; r < R; ++r) {
      const __m256 xsv = _mm256_broadcast_ss(xs + r * groups + g);
      acc[r][0] = _mm256_fmadd_ps(xsv, m0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xsv, m1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * NR, acc[r][0]);
    _mm256_storeu_ps(c + r * NR + 8, acc[r][1]);
  }
}
#else
template <typename S>
inline float min_of(const sm_t<S>* gsm, int64_t j) {  // column j's min in a group's panel
  if constexpr (std::is_same_v<S, HalfZero>)
    return -(float(gsm[NR + j]) * float(gsm[j]));
  else
    return float(gsm[NR + j]);
}

inline int code(const uint8_t* q, int64_t k, int64_t j) {  // column j's code at input k
  const uint8_t b = q[(k / 4) * 32 + (j % 8) * 4 + k % 4];
  return j < 8 ? (b & 0x0F) : (b >> 4);
}

template <typename S>
void widen_int4(const uint8_t* q, const sm_t<S>* sm, int64_t K, int64_t G, float* buf) {
  for (int64_t k = 0; k < K; ++k) {
    const sm_t<S>* gsm = sm + (k / G) * 2 * NR;
    for (int64_t j = 0; j < NR; ++j) buf[k * NR + j] = float(code(q, k, j)) * float(gsm[j]) + min_of<S>(gsm, j);
  }
}

template <int R, typename S>
void micro_kernel_int4_int8(const int8_t* xq, const float* d, const float* xs, int64_t K, int64_t G,
                            const uint8_t* q, const sm_t<S>* sm, float* c) {
  const int64_t blocks = K / QB, groups = K / G, per_group = G / QB;
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < NR; ++j) {
      float acc = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const sm_t<S>* gsm = sm + g * 2 * NR;
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
          int32_t dot = 0;
          for (int64_t k = b * QB; k < (b + 1) * QB; ++k) dot += code(q, k, j) * xq[r * K + k];
          acc += float(dot) * (float(gsm[j]) * d[r * blocks + b]);
        }
        acc += xs[r * groups + g] * min_of<S>(gsm, j);
      }
      c[r * NR + j] = acc;
    }
}
#endif

// int4 panels for quantized_panels.h: 8 bytes a panel per input (16 nibbles), per group 16 scales then 16 mins.
struct Int4Panels {
  using Code = uint8_t;
  static constexpr int64_t kPanelStride = 8, kScaleStride = 2 * NR;
  template <typename S>
  static void widen(const Code* q, const sm_t<S>* sm, int64_t K, int64_t G, float* buf) {
    widen_int4<S>(q, sm, K, G, buf);
  }
  template <int R, typename S>
  static void int8_rows(const GemmInput& in, int64_t i, int64_t K, int64_t G, const Code* q, const sm_t<S>* sm,
                        float* c) {
    micro_kernel_int4_int8<R, S>(in.xq.data() + i * K, in.d.data() + i * (K / QB), in.xs.data() + i * (K / G), K, G, q,
                                 sm, c);
  }
#ifdef PC_AVX2
  template <typename S, int R>
  static void registers(const float* a, const Code* q, const sm_t<S>* sm, int64_t K, int64_t G, float* c) {
    micro_kernel_int4<S, R>(a, q, sm, K, G, c);
  }
#endif
};

template <typename X>
void panels_of(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1, std::vector<float>& wbuf) {
  if (w.zero_point) {
    if (in.int8) return quantized_int8_panels<Int4Panels, X, HalfZero>(w, in, y, p0, p1);
    return quantized_panels<Int4Panels, X, HalfZero>(w, in, y, p0, p1, wbuf);
  }
  if (w.half_scales) {
    if (in.int8) return quantized_int8_panels<Int4Panels, X, c10::Half>(w, in, y, p0, p1);
    return quantized_panels<Int4Panels, X, c10::Half>(w, in, y, p0, p1, wbuf);
  }
  if (in.int8) return quantized_int8_panels<Int4Panels, X, float>(w, in, y, p0, p1);
  quantized_panels<Int4Panels, X, float>(w, in, y, p0, p1, wbuf);
}
}  // namespace

void int4_gemm_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t p0,
                      int64_t p1, std::vector<float>& wbuf) {
  if (x_type == at::kFloat) return panels_of(w, in, static_cast<float*>(y), p0, p1, wbuf);
  TORCH_CHECK(x_type == at::kBFloat16, "x: float32 or bfloat16");
  panels_of(w, in, static_cast<c10::BFloat16*>(y), p0, p1, wbuf);
}

// q: uint8 [N, K] values 0..15; scale, min: fp32 [N, K / G]. Returns (q panels uint8 [panels, K
// rounded up to 4, 8] in quads (the layout at the top of this file), scale/min [panels, K / G, 2, 16] in scale's dtype,
// fp32 or fp16); padding
// columns and inputs are zero.
std::tuple<torch::Tensor, torch::Tensor> pack_int4_weight(torch::Tensor q, torch::Tensor scale, torch::Tensor min,
                                                         int64_t group_size) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "q: uint8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), G = group_size, panels = (N + NR - 1) / NR, Kp = round4(K);
  TORCH_CHECK(G > 0 && G % 2 == 0 && K % G == 0, "K must be a multiple of an even group size");
  TORCH_CHECK(scale.sizes() == min.sizes() && scale.size(0) == N && scale.size(1) == K / G, "scale/min: [N, K / G]");
  auto qp = torch::zeros({panels * NR, Kp}, q.options());
  qp.narrow(0, 0, N).narrow(1, 0, K).copy_(q.bitwise_and(0x0F));
  qp = qp.view({panels, NR, Kp / 4, 4}).permute({0, 2, 1, 3});  // [panels, quads, 16 columns, 4 inputs]
  auto packed = qp.narrow(2, 0, 8).bitwise_or(qp.narrow(2, 8, 8).bitwise_left_shift(4)).contiguous().view({panels, Kp, 8});
  TORCH_CHECK(scale.scalar_type() == min.scalar_type() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "scale/min: both fp32 or both fp16 (the panels keep their dtype)");
  auto sm = torch::zeros({panels * NR, K / G, 2}, scale.options());
  sm.narrow(0, 0, N).select(2, 0).copy_(scale);
  sm.narrow(0, 0, N).select(2, 1).copy_(min);
  sm = sm.view({panels, NR, K / G, 2}).permute({0, 2, 3, 1}).contiguous();  // [panels, K/G, 2, 16]
  return {packed, sm};
}

torch::Tensor packed_linear_int4(torch::Tensor x, torch::Tensor q, torch::Tensor sm, int64_t out_features,
                                 int64_t group_size, c10::optional<torch::Tensor> bias, int64_t int8_rows,
                                 bool zero_point) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 8 && q.is_contiguous() && q.scalar_type() == at::kByte, "q: [panels, K, 8]");
  TORCH_CHECK(sm.dim() == 4 && sm.size(0) == q.size(0) && sm.size(2) == 2 && sm.size(3) == NR && sm.is_contiguous() &&
                  (sm.scalar_type() == at::kFloat || sm.scalar_type() == at::kHalf),
              "scale/min: [panels, K / G, 2, 16] fp32 or fp16");
  const int64_t G = group_size, K = sm.size(1) * G, N = out_features;
  TORCH_CHECK(!zero_point || sm.scalar_type() == at::kHalf, "zero points: fp16 scale/zero panels");
  TORCH_CHECK(G > 0 && q.size(1) == round4(K), "group_size does not match the packed weight");
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be the weight's in_features");
  TORCH_CHECK(q.size(0) * NR >= N, "out_features larger than the packed weight");
  return run_packed(x, {at::kByte, q.data_ptr(), sm.data_ptr(), nullptr, N, K, G, int8_rows,
                       sm.scalar_type() == at::kHalf, zero_point}, bias);
}
