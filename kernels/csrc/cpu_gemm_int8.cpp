// Linears over int8 weights packed once at load (w = q * scale per group: GGUF's Q8_0, compressed-tensors'
// W8A16): the panels' layout, the decode kernel over int8 activations, the fp32 one.
#include "quantized_panels.h"

namespace {
// ---- int8 weights (w = q * scale per group of G inputs: GGUF's Q8_0, compressed-tensors' W8A16) -------
// Panel p holds K (rounded up to 4, zero past K) inputs in quads: 64 bytes per quad, byte c * 4 + t =
// column c at input 4 * quad + t (columns 0-7 in its first 32 bytes, 8-15 in the next 32): each 32-bit
// lane holds 4 inputs of one column, as in the int4 panels. Beside it, per group, 16 scales (fp16 where
// every one is one, as Q8_0's d, else fp32); per channel is one group of K. Decode rows (M <= int8_rows)
// take int8 activations per 32 inputs as the int4 kernel does (llama.cpp's Q8_0 x Q8_0); other rows
// widen the panel to fp32 once and run the fp32 micro-kernel.
#ifdef PC_AVX2
// Each k of the panel dequantized (columns 0-7, 8-15) and handed to f(k, t = k % 4, w0, w1).
template <typename S, typename F>
inline void for_each_dequantized_int8(const int8_t* q, const sm_t<S>* sc, int64_t K, int64_t G, F&& f) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t next = 0;
  for (int64_t k0 = 0; k0 < K; k0 += 4) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k0 * 16));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k0 * 16 + 32));
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const int64_t k = k0 + t;
      if (k == K) return;
      if (k == next) {
        const sm_t<S>* g = sc + (k / G) * NR;
        s0 = load_sm(g), s1 = load_sm(g + 8);
        next += G;
      }
      // byte t of every lane, sign-extended: to the top byte, then an arithmetic shift down
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v0, 24 - 8 * t), 24));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v1, 24 - 8 * t), 24));
      f(k, t, _mm256_mul_ps(w0, s0), _mm256_mul_ps(w1, s1));
    }
  }
}

template <typename S>
void widen_int8(const int8_t* q, const sm_t<S>* sc, int64_t K, int64_t G, float* buf) {
  for_each_dequantized_int8<S>(q, sc, K, G, [&](int64_t k, int, __m256 w0, __m256 w1) {
    _mm256_storeu_ps(buf + k * NR, w0);
    _mm256_storeu_ps(buf + k * NR + 8, w1);
  });
}

template <typename S, int R>
__attribute__((noinline)) void micro_kernel_int8(const float* a, const int8_t* q, const sm_t<S>* sc, int64_t K,
                                                 int64_t G, float* c) {
  RegisterTile<R> tile;
  for_each_dequantized_int8<S>(q, sc, K, G, [&](int64_t k, int t, __m256 w0, __m256 w1) { tile.add(a, k, t, w0, w1); });
  tile.store(c);
}

// R rows of int8 activations against one int8 panel. Per quad and row: |w| (unsigned) times x with w's
// sign (maddubs: pairs summed to int16, |.| <= 2 * 128 * 127), widened by madd with ones and summed in
// int32 over the block; then y += s * d * sum per block in fp32.
template <int R, typename S>
__attribute__((noinline)) void micro_kernel_int8_int8(const int8_t* xq, const float* d, int64_t K, int64_t G,
                                                      const int8_t* q, const sm_t<S>* sc, float* c) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t blocks = K / QB, per_group = G / QB;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const sm_t<S>* g = sc + (b / per_group) * NR;
    const __m256 s0 = load_sm(g), s1 = load_sm(g + 8);
    const int8_t* qb = q + b * QB * 16;  // 512 bytes: 8 quads
    for (int l = 0; l < 512; l += 64) _mm_prefetch(reinterpret_cast<const char*>(qb + PF4 + l), _MM_HINT_T0);
    __m256i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + j * 64));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + j * 64 + 32));
      const __m256i a0 = _mm256_abs_epi8(v0), a1 = _mm256_abs_epi8(v1);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq + r * K + b * QB + j * 4, 4);
        const __m256i xv = _mm256_set1_epi32(x4);
        const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, v0));
        const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, v1));
        sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(p0, ones));
        sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(p1, ones));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dv = _mm256_broadcast_ss(d + r * blocks + b);
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][0]), _mm256_mul_ps(s0, dv), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][1]), _mm256_mul_ps(s1, dv), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * NR, acc[r][0]);
    _mm256_storeu_ps(c + r * NR + 8, acc[r][1]);
  }
}
#else
inline int code8(const int8_t* q, int64_t k, int64_t j) { return q[(k / 4) * 64 + j * 4 + k % 4]; }

template <typename S>
void widen_int8(const int8_t* q, const sm_t<S>* sc, int64_t K, int64_t G, float* buf) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < NR; ++j) buf[k * NR + j] = float(code8(q, k, j)) * float(sc[(k / G) * NR + j]);
}

template <int R, typename S>
void micro_kernel_int8_int8(const int8_t* xq, const float* d, int64_t K, int64_t G, const int8_t* q,
                            const sm_t<S>* sc, float* c) {
  const int64_t blocks = K / QB, per_group = G / QB;
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < NR; ++j) {
      float acc = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = 0;
        for (int64_t k = b * QB; k < (b + 1) * QB; ++k) dot += code8(q, k, j) * xq[r * K + k];
        acc += float(dot) * (float(sc[(b / per_group) * NR + j]) * d[r * blocks + b]);
      }
      c[r * NR + j] = acc;
    }
}
#endif

// int8 panels for quantized_panels.h: 16 bytes a panel per input, per group 16 scales.
struct Int8Panels {
  using Code = int8_t;
  static constexpr int64_t kPanelStride = NR, kScaleStride = NR;
  template <typename S>
  static void widen(const Code* q, const sm_t<S>* sc, int64_t K, int64_t G, float* buf) {
    widen_int8<S>(q, sc, K, G, buf);
  }
  template <int R, typename S>
  static void int8_rows(const GemmInput& in, int64_t i, int64_t K, int64_t G, const Code* q, const sm_t<S>* sc,
                        float* c) {
    micro_kernel_int8_int8<R, S>(in.xq.data() + i * K, in.d.data() + i * (K / QB), K, G, q, sc, c);
  }
#ifdef PC_AVX2
  template <typename S, int R>
  static void registers(const float* a, const Code* q, const sm_t<S>* sc, int64_t K, int64_t G, float* c) {
    micro_kernel_int8<S, R>(a, q, sc, K, G, c);
  }
#endif
};

template <typename X>
void panels_of(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1, std::vector<float>& wbuf) {
  if (w.half_scales) {
    if (in.int8) return quantized_int8_panels<Int8Panels, X, c10::Half>(w, in, y, p0, p1);
    return quantized_panels<Int8Panels, X, c10::Half>(w, in, y, p0, p1, wbuf);
  }
  if (in.int8) return quantized_int8_panels<Int8Panels, X, float>(w, in, y, p0, p1);
  quantized_panels<Int8Panels, X, float>(w, in, y, p0, p1, wbuf);
}
}  // namespace

void int8_gemm_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t p0,
                      int64_t p1, std::vector<float>& wbuf) {
  if (x_type == at::kFloat) return panels_of(w, in, static_cast<float*>(y), p0, p1, wbuf);
  TORCH_CHECK(x_type == at::kBFloat16, "x: float32 or bfloat16");
  panels_of(w, in, static_cast<c10::BFloat16*>(y), p0, p1, wbuf);
}

// q: int8 [N, K]; scale: fp32 or fp16 [N, K / G] (one group of K: per channel). Returns (q panels int8
// [panels, K rounded up to 4, 16] in quads (the layout at the top of this file), scale panels [panels, K / G, 16] in
// scale's dtype); padding columns and inputs are zero.
std::tuple<torch::Tensor, torch::Tensor> pack_int8_weight(torch::Tensor q, torch::Tensor scale, int64_t group_size) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "q: int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), G = group_size, panels = (N + NR - 1) / NR, Kp = round4(K);
  TORCH_CHECK(G > 0 && K % G == 0, "K must be a multiple of the group size");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / G, "scale: [N, K / G]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf, "scale: fp32 or fp16");
  auto qp = torch::zeros({panels * NR, Kp}, q.options());
  qp.narrow(0, 0, N).narrow(1, 0, K).copy_(q);
  auto packed = qp.view({panels, NR, Kp / 4, 4}).permute({0, 2, 1, 3}).contiguous().view({panels, Kp, NR});
  auto sc = torch::zeros({panels * NR, K / G}, scale.options());
  sc.narrow(0, 0, N).copy_(scale);
  return {packed, sc.view({panels, NR, K / G}).permute({0, 2, 1}).contiguous()};
}

torch::Tensor packed_linear_int8(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t out_features,
                                 int64_t group_size, c10::optional<torch::Tensor> bias, int64_t int8_rows) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == NR && q.is_contiguous() && q.scalar_type() == at::kChar,
              "q: int8 [panels, K, 16]");
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == q.size(0) && scale.size(2) == NR && scale.is_contiguous() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "scale: [panels, K / G, 16] fp32 or fp16");
  const int64_t G = group_size, K = scale.size(1) * G, N = out_features;
  TORCH_CHECK(G > 0 && q.size(1) == round4(K), "group_size does not match the packed weight");
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be the weight's in_features");
  TORCH_CHECK(q.size(0) * NR >= N, "out_features larger than the packed weight");
  return run_packed(x, {at::kChar, q.data_ptr(), scale.data_ptr(), nullptr, N, K, G, int8_rows,
                       scale.scalar_type() == at::kHalf, false}, bias);
}
